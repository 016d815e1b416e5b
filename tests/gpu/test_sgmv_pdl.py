"""SGMV kernels launched with programmatic dependent launch: each kernel starts while the one
before it still runs and waits only before it touches that kernel's outputs. A chain of layers
whose every shrink reads the previous layer's expand output must give, bit for bit, what plain
launches give, eagerly and replayed from a CUDA graph."""

import pytest
import torch

from kernels.sgmv import SgmvBatch
from tests.factories import sgmv_batch

pytestmark = pytest.mark.gpu

HIDDEN, RANK, LAYERS = 512, 16, 6
OUTS = (HIDDEN, HIDDEN // 4, HIDDEN // 4)  # q/k/v widths under GQA; q feeds the next layer


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def make_batch(num_tokens: int, device) -> SgmvBatch:
    # decode: a token per segment, each its own slot
    slots = [i % 4 for i in range(num_tokens)]
    return sgmv_batch([1] * num_tokens, slots, (16, 8, 16, 4), (0.5, 2.0, 1.0, 1.5), device)


def make_chain_inputs(num_tokens: int, device, seed: int):
    """LAYERS layers of bf16 q/k/v adapter weights over 4 slots, a decode batch and its input."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = [
        (torch.randn(4, 3 * RANK, HIDDEN, device=device, generator=g, dtype=torch.bfloat16) / 8,
         torch.randn(4, RANK, sum(OUTS), device=device, generator=g, dtype=torch.bfloat16) / 4)
        for _ in range(LAYERS)
    ]
    x = torch.randn(num_tokens, HIDDEN, device=device, generator=g, dtype=torch.bfloat16)
    return weights, make_batch(num_tokens, device), x


def chain(x, weights, batch):
    """Layer by layer: y = x, y += LoRA(x); the next layer's input is y's q slice."""
    from kernels import sgmv_triton

    offsets = (0, OUTS[0], OUTS[0] + OUTS[1], sum(OUTS))
    for a, b in weights:
        y = torch.zeros(x.shape[0], sum(OUTS), dtype=x.dtype, device=x.device)
        y[:, : OUTS[0]] = x
        h = sgmv_triton.triton_shrink(x, a, batch, 3)
        sgmv_triton.triton_expand(h, b, batch, y, offsets)
        x = y[:, : OUTS[0]].contiguous()
    return x


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_pdl_chain_equals_plain_launches(monkeypatch, num_tokens):
    device = torch.device("cuda")
    if not hopper():
        pytest.skip("programmatic dependent launch needs Hopper or later")
    # imported here: a module-level import would compile-mode the kernels before the CPU kernel
    # tests set the Triton interpreter up
    from kernels import sgmv_triton

    assert sgmv_triton._pdl_enabled(device), "PDL should be on for this GPU and Triton"
    weights, batch, x = make_chain_inputs(num_tokens, device, seed=0)

    monkeypatch.setattr(sgmv_triton, "PDL", False)
    plain = chain(x, weights, batch)
    monkeypatch.setattr(sgmv_triton, "PDL", True)
    eager = chain(x, weights, batch)
    assert torch.equal(eager, plain)

    chain(x, weights, batch)  # settle allocations before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = chain(x, weights, batch)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, plain)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_timeline_records_every_program_in_order_and_changes_no_result(num_tokens):
    """`record_timeline` (the timeline benchmark's timestamps): the same outputs bit for bit, a
    start and an end for every program of every launch, and per program start <= located <=
    waited <= end; under PDL a kernel's first wait returns no earlier than the kernel before it
    ended."""
    device = torch.device("cuda")
    if not hopper():
        pytest.skip("programmatic dependent launch needs Hopper or later")
    from kernels import sgmv_triton

    weights, batch, x = make_chain_inputs(num_tokens, device, seed=1)
    plain = chain(x, weights, batch)
    timeline = sgmv_triton.Timeline(2 * LAYERS, 4096, device)
    with sgmv_triton.record_timeline(timeline):
        traced = chain(x, weights, batch)
    torch.cuda.synchronize()
    assert torch.equal(traced, plain)
    assert len(timeline.grids) == 2 * LAYERS
    records = timeline.records.tolist()
    prev_end = None
    for launch, grid in enumerate(timeline.grids):
        programs = records[launch][:grid]
        assert all(p[0] > 0 and p[3] >= p[0] for p in programs), f"launch {launch}"
        stamped = [p for p in programs if p[2]]
        assert stamped, f"launch {launch}: no program waited"
        assert all(p[0] <= p[1] <= p[2] <= p[3] for p in stamped), f"launch {launch}"
        if prev_end is not None:
            assert min(p[2] for p in stamped) >= prev_end, f"launch {launch} waited early"
        prev_end = max(p[3] for p in programs)


def test_timeline_of_a_register_capped_row_changes_no_result():
    """A row with a register cap (a rank-64 pool's shrink over segments of several tokens) is
    traced without it, since the timestamps need registers: the same outputs bit for bit, and
    every program of every launch stamped."""
    device = torch.device("cuda")
    if not hopper():
        pytest.skip("programmatic dependent launch needs Hopper or later")
    from kernels import sgmv_triton
    from kernels.sgmv_tuning import pick

    rank, tokens = sgmv_triton.WIDE_RANK, 8
    assert pick(sgmv_triton._shrink_table(False, rank), tokens).max_registers is not None
    g = torch.Generator(device=device).manual_seed(2)
    weights = [
        (torch.randn(2, 3 * rank, HIDDEN, device=device, generator=g, dtype=torch.bfloat16) / 8,
         torch.randn(2, rank, sum(OUTS), device=device, generator=g, dtype=torch.bfloat16) / 4)
        for _ in range(2)
    ]
    batch = sgmv_batch([tokens], [1], (0, rank), (1.0, 0.5), device)
    x = torch.randn(tokens, HIDDEN, device=device, generator=g, dtype=torch.bfloat16)
    plain = chain(x, weights, batch)
    timeline = sgmv_triton.Timeline(2 * len(weights), 4096, device)
    with sgmv_triton.record_timeline(timeline):
        traced = chain(x, weights, batch)
    torch.cuda.synchronize()
    assert torch.equal(traced, plain)
    records = timeline.records.tolist()
    for launch, grid in enumerate(timeline.grids):
        assert all(p[0] > 0 and p[3] >= p[0] for p in records[launch][:grid]), f"launch {launch}"
