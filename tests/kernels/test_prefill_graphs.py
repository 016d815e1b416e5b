"""What a captured prefill graph computes, checked eagerly: the forward pass over the padded
shapes and static buffers that `PrefillGraphs` captures must give the real rows of the eager
step. Without a GPU the kernels run in Triton's interpreter; the GPU tests replay real graphs
(tests/gpu/test_prefill_graphs.py)."""

import pytest
import torch

pytest.importorskip("triton")

from replicas.adapters.loader import load_adapter  # noqa: E402
from replicas.config import EngineConfig  # noqa: E402
from replicas.cuda_graphs import PrefillGraphs  # noqa: E402
from replicas.flat_step import FlatStep  # noqa: E402
from replicas.model_runner import ModelRunner  # noqa: E402
from replicas.models.spec import ModelSpec  # noqa: E402
from tests.factories import make_adapter, make_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BS = 4  # tokens per KV block


def step(seqs):
    """Flat step metadata for `seqs`: (slot or None, first position, new tokens, blocks)."""
    gen = torch.Generator().manual_seed(len(seqs))
    meta = dict(ids=[], positions=[], slot_mapping=[], q_starts=[0], tables=[], ctx_lens=[],
                seg_lens=[], seg_slots=[])
    for slot, start, count, table in seqs:
        meta["ids"] += torch.randint(0, 200, (count,), generator=gen).tolist()
        meta["positions"] += range(start, start + count)
        meta["slot_mapping"] += [table[p // BS] * BS + p % BS for p in range(start, start + count)]
        meta["q_starts"].append(meta["q_starts"][-1] + count)
        meta["ctx_lens"].append(start + count)
        meta["tables"].append(table)
        if slot is not None:
            meta["seg_lens"].append(count)
            meta["seg_slots"].append(slot)
    return meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests replay the real graphs")
def test_the_padded_graph_step_gives_the_eager_steps_rows(tmp_path):
    # One layer: the padding under test is the step's metadata, the same for every layer (each
    # layer costs about 20 s in Triton's interpreter).
    model_dir = make_model(tmp_path / "m", hidden_size=64, intermediate_size=96, num_heads=4,
                           num_kv_heads=2, num_layers=1)
    spec = ModelSpec.from_dir(model_dir)
    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=32, block_size=BS, max_lora_rank=8,
        max_loras_per_batch=3, sgmv_backend="triton", attention_backend="triton",
        layer_ops_backend="triton",
    )
    runner = ModelRunner(config, spec, 64)
    for slot, rank in ((0, 8), (2, 4)):
        path = make_adapter(model_dir, tmp_path / f"a{rank}", rank=rank, lora_alpha=2 * rank,
                            target_modules=ALL, seed=rank)
        runner.lora_pool.write(slot, load_adapter(f"a{rank}", path, spec, 8))
    gen = torch.Generator().manual_seed(0)
    for k_cache, v_cache in runner.kv_caches:  # cached prefixes to attend over
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    graphs = PrefillGraphs(runner.model, runner.lora_pool, runner.kv_caches, max_tokens=32,
                           max_seqs=8, max_blocks_per_seq=16, block_size=BS,
                           pad_slot=runner.pad_slot, device=torch.device("cpu"))
    assert graphs.buckets == [16, 32]

    def padded(meta):
        b = graphs.stage_step(runner.staging, FlatStep(**meta))
        with torch.inference_mode():
            out = runner.model(graphs.input_ids[:b], graphs.positions[:b],
                               graphs._prefill_context(b))
        return b, out[: len(meta["ids"])]

    # A larger step first leaves stale values in every static buffer past the next step's.
    big = step([(0, 0, 11, [8, 9, 10]), (2, 0, 7, [11, 12]), (None, 0, 6, [13, 14]),
                (0, 0, 4, [15])])
    assert padded(big)[0] == 32
    # A prefill chunk over a cached prefix (slot 0), a decode (slot 2), a base-model prompt: 13
    # tokens, so 3 padding tokens, 5 spare sequences and one spare segment.
    meta = step([(0, 4, 9, [0, 1, 2, 3]), (2, 5, 1, [4, 5]), (None, 0, 3, [6])])
    b, got = padded(meta)
    assert b == 16
    with torch.inference_mode():
        want = runner._forward(runner.staging, FlatStep(**meta))
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # And the adapters mattered: without them the rows differ.
    with torch.inference_mode():
        base = runner._forward(runner.staging, FlatStep(**{**meta, "seg_lens": [],
                                                             "seg_slots": []}))
    assert not torch.allclose(base[:10], want[:10], atol=1e-3)


def test_warm_up_skips_graph_sizes_but_covers_both_specializations_above(tmp_path):
    # One layer: the padding under test is the step's metadata, the same for every layer (each
    # layer costs about 20 s in Triton's interpreter).
    model_dir = make_model(tmp_path / "m", hidden_size=64, intermediate_size=96, num_heads=4,
                           num_kv_heads=2, num_layers=1)
    spec = ModelSpec.from_dir(model_dir)
    runner = ModelRunner(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=32,
                                      block_size=BS), spec, 64)
    runner.prefill_graphs = PrefillGraphs(
        runner.model, runner.lora_pool, runner.kv_caches, max_tokens=128, max_seqs=8,
        max_blocks_per_seq=16, block_size=BS, pad_slot=runner.pad_slot,
        device=torch.device("cpu"))
    sizes = []
    runner._forward = lambda stage, step: sizes.append(step.num_tokens)
    runner.warm_up(max_tokens=512, max_model_len=64)
    assert min(sizes) == 129 and max(sizes) == 512  # nothing the graphs cover
    assert {n % 16 == 0 for n in sizes} == {True, False}
    sizes.clear()
    runner.warm_up(max_tokens=128, max_model_len=64)  # every size is a graph's
    assert sizes == []


def test_a_negative_prefill_graph_bound_is_refused():
    with pytest.raises(ValueError, match="max_prefill_graph_tokens must be at least 0"):
        EngineConfig(model="m", max_prefill_graph_tokens=-1)
