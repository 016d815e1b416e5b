"""Multi-adapter batches against PEFT (CPU, float32): every adapter's greedy output equals
transformers + PEFT, whatever else shares the batch."""

import time

import pytest
import torch

from replicas.request import Request
from tests.factories import hf_greedy, hf_logits, make_adapter
from tests.replicas.conftest import greedy, make_engine, run_to_completion

PROMPTS = [[5, 17, 200, 33, 98, 4], [61, 150, 7, 12, 250, 3, 44, 9], [8, 8, 8], [100, 2, 77, 13]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = models["llama"]
    specs = {
        "qv-r4": dict(rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "all-r8-rslora": dict(rank=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
        "mlp-r2": dict(rank=2, lora_alpha=7, target_modules=["o_proj", "gate_proj", "up_proj",
                                                              "down_proj"]),
        "kd-r16": dict(rank=16, lora_alpha=64, target_modules=["k_proj", "down_proj"]),
    }
    return {
        name: make_adapter(base, root / name, seed=i + 1, **kw)
        for i, (name, kw) in enumerate(specs.items())
    }


def test_each_adapter_changes_the_output(models, adapters):
    base_tokens = hf_greedy(models["llama"], PROMPTS[0], 8)
    for path in adapters.values():
        assert hf_greedy(models["llama"], PROMPTS[0], 8, adapter_dir=path) != base_tokens


def test_mixed_batch_matches_peft_for_base_and_every_adapter(models, adapters):
    engine = make_engine(models["llama"], adapters=tuple((k, str(v)) for k, v in adapters.items()),
                         max_loras_per_batch=4)
    requests, expected = [], {}
    for i, prompt in enumerate(PROMPTS):
        for name in [None, *adapters]:
            rid = f"{name}-{i}"
            requests.append(Request(rid, prompt, greedy(8), name))
            path = adapters[name] if name else None
            expected[rid] = hf_greedy(models["llama"], prompt, 8, adapter_dir=path)
    results = run_to_completion(engine, requests)
    for rid, tokens in expected.items():
        assert results[rid][0] == tokens, rid
    # All four adapters and the base ran in the same steps: one batch held several adapters.
    assert engine.max_adapters_in_step == 4


def test_more_adapters_than_slots(models, adapters):
    engine = make_engine(models["llama"], adapters=tuple((k, str(v)) for k, v in adapters.items()),
                         max_loras_per_batch=2, max_loaded_loras=2)
    requests, expected = [], {}
    for i, prompt in enumerate(PROMPTS[:2]):
        for name in adapters:
            rid = f"{name}-{i}"
            requests.append(Request(rid, prompt, greedy(6), name))
            expected[rid] = hf_greedy(models["llama"], prompt, 6, adapter_dir=adapters[name])
    results = run_to_completion(engine, requests)
    for rid, tokens in expected.items():
        assert results[rid][0] == tokens, rid
    assert engine.adapters.stats.gpu_loads >= len(adapters)
    assert engine.adapters.slots.num_held == 0


def test_adapter_logits_match_peft(models, adapters):
    """Tight check of the delta itself, not only the argmax."""
    engine = make_engine(models["llama"], adapters=(("a", str(adapters["all-r8-rslora"])),))
    deadline = time.monotonic() + 30
    while not engine.adapters.prepare("a"):  # the read runs on a worker thread
        assert time.monotonic() < deadline
        time.sleep(0.01)
    slot = engine.adapters.acquire("a")
    runner = engine.runner
    prompt = PROMPTS[1]
    from kernels.attention import AttentionBatch
    from replicas.models.llama import StepContext

    n = len(prompt)
    attn = AttentionBatch(
        q_starts=[0, n], ctx_lens=[n], slot_mapping=torch.arange(n),
        block_table=torch.arange(-(-n // 4), dtype=torch.int32).unsqueeze(0),
        ctx_lens_t=torch.tensor([n], dtype=torch.int32),
        q_starts_t=torch.tensor([0, n], dtype=torch.int32), block_size=4,
    )
    ctx = StepContext(attn, runner.lora_pool.make_batch([n], [slot], n), runner.kv_caches,
                      runner.lora_pool)
    with torch.inference_mode():
        ours = runner.model.logits(runner.model(torch.tensor(prompt), torch.arange(n), ctx))
    ref = hf_logits(models["llama"], prompt, adapter_dir=adapters["all-r8-rslora"])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_adapters_on_other_architectures(models, tmp_path, arch):
    path = make_adapter(models[arch], tmp_path / "a", rank=4, lora_alpha=16, target_modules=ALL,
                        seed=3)
    engine = make_engine(models[arch], adapters=(("a", str(path)),))
    prompt = PROMPTS[1]
    results = run_to_completion(engine, [Request("x", prompt, greedy(8), "a"),
                                         Request("y", prompt, greedy(8))])
    assert results["x"][0] == hf_greedy(models[arch], prompt, 8, adapter_dir=path)
    assert results["y"][0] == hf_greedy(models[arch], prompt, 8)


class TestPackedWrites:
    """An adapter packed in the slot layout goes to its slot one copy per layer and leaves the
    slot exactly as the module-by-module write does, over whatever the slot held before."""

    def _pool_and_weights(self, models, tmp_path, rank, targets):
        from replicas.adapters.loader import load_adapter
        from replicas.lora import LoraWeightPool
        from replicas.models.spec import ModelSpec

        spec = ModelSpec.from_dir(models["llama"])
        pool = LoraWeightPool(spec, 3, 8, torch.float32, torch.device("cpu"))
        path = make_adapter(models["llama"], tmp_path / f"r{rank}", rank=rank,
                            target_modules=targets, seed=rank)
        return pool, load_adapter("x", path, spec, 8)

    def test_packed_write_equals_module_write(self, models, tmp_path):
        pool, weights = self._pool_and_weights(models, tmp_path, 8, ALL)
        packed = pool.pack(weights)
        assert packed.layers is not None and len(packed.layers) == pool.spec.num_layers
        assert pool.pack(packed) is packed  # packing twice changes nothing
        _, small = self._pool_and_weights(models, tmp_path, 4, ["q_proj", "down_proj"])
        for layer in pool.layers:  # poison: every value left in the slot must come from a write
            layer.fill_(float("nan"))
        pool.write(1, small)  # the slot held another adapter before
        pool.write(1, packed)
        module_pool = type(pool)(pool.spec, 3, 8, torch.float32, torch.device("cpu"))
        module_pool.write(1, weights)
        for got, want in zip(pool.layers, module_pool.layers, strict=True):
            assert torch.equal(got[1], want[1])
        assert pool.layers[0][0].isnan().all()  # other slots untouched

    @pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
    def test_pack_from_the_file_equals_module_write(self, models, tmp_path, pool_dtype):
        """Straight from the file's bytes (float32 files: the bytes themselves for a float32
        pool, converted per module for a bfloat16 one)."""
        from replicas.adapters.loader import read_adapter_file
        from replicas.lora import LoraWeightPool

        pool, weights = self._pool_and_weights(models, tmp_path, 8, ALL)
        pool = LoraWeightPool(pool.spec, 2, 8, pool_dtype, torch.device("cpu"))
        file = read_adapter_file("x", tmp_path / "r8", pool.spec, 8)
        packed = pool.pack_file(file)
        assert packed.layers is not None and packed.rank == 8
        assert packed.scaling == weights.scaling
        for layer in pool.layers:
            layer.fill_(float("nan"))
        pool.write(0, packed)
        module_pool = LoraWeightPool(pool.spec, 2, 8, pool_dtype, torch.device("cpu"))
        module_pool.write(0, file.to_weights(pool_dtype))
        for got, want in zip(pool.layers, module_pool.layers, strict=True):
            assert torch.equal(got[0], want[0])
        assert pool.layers[0][1].isnan().all()

    def test_lower_rank_or_sparse_adapters_stay_unpacked(self, models, tmp_path):
        pool, low_rank = self._pool_and_weights(models, tmp_path, 4, ALL)
        assert pool.pack(low_rank).layers is None
        _, sparse = self._pool_and_weights(models, tmp_path, 8, ["q_proj"])
        assert pool.pack(sparse).layers is None  # mostly zeros in the slot layout
