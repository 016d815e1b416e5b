"""The model against transformers on the same weights (CPU, float32)."""

import pytest
import torch

from replicas.request import Request
from tests.factories import hf_greedy, hf_logits
from tests.replicas.conftest import forward_logits, greedy, make_engine, run_to_completion

PROMPT = [5, 17, 200, 33, 98, 4, 61, 150, 7, 12, 250, 3, 44]
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "llama-tied"]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_transformers(models, arch):
    engine = make_engine(models[arch])
    ours = forward_logits(engine, [PROMPT])
    ref = hf_logits(models[arch], PROMPT)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_over_cached_prefix_gives_the_same_logits(models, arch):
    engine = make_engine(models[arch])
    ours = forward_logits(engine, [PROMPT[:5], PROMPT[5:6], PROMPT[6:]])
    ref = hf_logits(models[arch], PROMPT)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_equals_transformers(models, arch):
    engine = make_engine(models[arch])
    prompts = {"a": PROMPT, "b": PROMPT[:4], "c": PROMPT[3:11]}
    results = run_to_completion(
        engine, [Request(rid, p, greedy(12)) for rid, p in prompts.items()]
    )
    for rid, prompt in prompts.items():
        tokens, reason = results[rid]
        assert tokens == hf_greedy(models[arch], prompt, 12), rid
        assert reason == "length"


def test_small_token_budget_and_tiny_cache_still_match(models):
    """Chunked prefills, preemption and recomputation must not change greedy outputs."""
    engine = make_engine(models["llama"], max_num_batched_tokens=5, num_kv_blocks=12,
                         block_size=2, max_model_len=20)
    prompts = {f"r{i}": PROMPT[i : i + 6] for i in range(4)}
    results = run_to_completion(engine, [Request(k, p, greedy(8)) for k, p in prompts.items()])
    for rid, prompt in prompts.items():
        assert results[rid][0] == hf_greedy(models["llama"], prompt, 8), rid
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_dummy_load_format_needs_only_the_config(models, tmp_path):
    import shutil

    shutil.copy(models["llama"] / "config.json", tmp_path / "config.json")
    engine = make_engine(tmp_path, load_format="dummy")
    results = run_to_completion(engine, [Request("a", PROMPT, greedy(5))])
    assert len(results["a"][0]) == 5
    with pytest.raises(FileNotFoundError):
        make_engine(tmp_path)  # the real format needs the weights


def test_warm_up_leaves_every_cache_block_alone(models):
    """Start-up warm-up (run on CUDA; called by hand here) writes keys and values only to the pad
    block and leaves the engine serving the same tokens."""
    engine = make_engine(models["llama"], max_num_batched_tokens=300)
    runner = engine.runner
    for k, v in runner.kv_caches:
        k.fill_(3.0)
        v.fill_(3.0)
    runner.warm_up(300, engine.max_model_len)
    for k, v in runner.kv_caches:
        assert (k[:-1] == 3.0).all() and (v[:-1] == 3.0).all()  # only the pad block changed
        assert not (k[-1] == 3.0).all()
    prompt = [5, 17, 200, 33, 98, 4]
    out = run_to_completion(engine, [Request("r", prompt, greedy(5))])
    assert out["r"][0] == hf_greedy(models["llama"], prompt, 5)


@pytest.mark.parametrize("num_slots", [1, 4, 8, 16, 17, 32, 40, 100])
def test_warm_up_segment_counts_reach_every_kernel_variant_a_step_can(num_slots):
    """Every segment count a step can have (1..slots) launches the SGMV kernels with the same
    table width and the same integer specialization as one count the warm-up runs, by the
    kernels' own rules, so no step compiles a kernel while serving."""
    from kernels.launch import _specialization_key
    from kernels.sgmv_triton import _pow2_at_least_16
    from replicas.model_runner import warm_up_segment_counts

    def variant(n: int) -> tuple:
        return _pow2_at_least_16(n), _specialization_key(None, (n,))

    counts = warm_up_segment_counts(num_slots)
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] <= num_slots
    assert {variant(n) for n in range(1, num_slots + 1)} == {variant(c) for c in counts}
    assert len({variant(c) for c in counts}) == len(counts)  # no count run twice for nothing


@pytest.mark.parametrize(
    ("max_tokens", "max_model_len", "num_slots", "graph_bound"),
    [(2048, 1024, 32, 1024), (2048, 1024, 8, 0), (4096, 2048, 16, 512), (1024, 4096, 32, 0)],
)
@pytest.mark.parametrize("rank", [16, 64])
def test_warm_up_steps_reach_every_kernel_variant_an_eager_step_can(
    max_tokens, max_model_len, num_slots, graph_bound, rank
):
    """Every eager step a scheduler can form (any size above the prefill graphs, any segment
    count its tokens allow, sequences however long the model allows) launches the SGMV kernels
    with the tilings and integer specializations of one warm-up step, by the kernels' own
    rules: one adapter's 1,500-token prefill over two sequences is one segment, for one."""
    import functools

    from kernels.launch import _specialization_key
    from kernels.sgmv_triton import _pow2_at_least_16
    from kernels.sgmv_tuning import DEFAULT_TUNING
    from replicas.model_runner import size_key, warm_up_steps

    key = functools.lru_cache(maxsize=None)(lambda n: size_key(n, DEFAULT_TUNING, rank))

    def variant(n: int, k: int) -> tuple:
        return key(n), _pow2_at_least_16(k), _specialization_key(None, (k,))

    steps = warm_up_steps(max_tokens, max_model_len, num_slots, graph_bound, key)
    for n, lengths, segments in steps:
        assert graph_bound < n <= max_tokens
        assert sum(lengths) == sum(segments) == n and max(lengths) <= max_model_len
        assert 1 <= len(segments) <= min(len(lengths), num_slots)
        ends = {sum(lengths[: i + 1]) for i in range(len(lengths))}
        assert all(sum(segments[: i + 1]) in ends for i in range(len(segments)))
    warmed = {variant(n, len(segments)) for n, _, segments in steps}
    for n in range(graph_bound + 1, max_tokens + 1):
        for k in range(1, min(n, num_slots) + 1):
            assert variant(n, k) in warmed, (n, k)


def test_warm_up_runs_its_steps_and_leaves_every_cache_alone(models):
    """The warm-up's dummy steps (several sequences per LoRA segment among them) run through
    the eager forward pass, and what the engine generates afterwards is what it generated
    before (every key and value went to the pad slot)."""
    from replicas.request import Request
    from tests.replicas.conftest import greedy, make_engine, run_to_completion

    engine = make_engine(models["llama"], max_loras_per_batch=4)
    prompt = Request("before", [5, 17, 200, 33], greedy(8))
    before = run_to_completion(engine, [prompt])["before"]
    engine.runner.warm_up(max_tokens=40, max_model_len=16)
    after = run_to_completion(engine, [Request("after", [5, 17, 200, 33], greedy(8))])["after"]
    assert after == before
