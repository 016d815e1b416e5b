"""Triton SGMV against the torch reference, and the torch reference against a per-token loop.

Without a GPU the kernels run in Triton's interpreter (float32, tiny sizes); with one, the same
sweeps run compiled, and the `gpu` tests add bf16 at Llama-3-8B widths, CUDA-graph replay over new
metadata, and repeated split-K launches that must agree bit for bit. Each tiling below is a tuning
of one row a kernel, passed to the backend as the weight pool passes its own.
"""

import os
from dataclasses import asdict, dataclass, replace

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported

import pytest  # noqa: E402

from kernels.sgmv import (  # noqa: E402
    SgmvBatch,
    TorchSgmv,
    get_backend,
    torch_expand,
    torch_shrink,
)
from kernels.sgmv_tuning import (  # noqa: E402
    DEFAULT_TUNING,
    FLOAT32_CAPS,
    NO_SPLIT,
    WIDE_RANK,
    ExpandTiling,
    Row,
    SgmvTuning,
    ShrinkTiling,
)

try:
    from kernels import sgmv_triton
except ImportError:  # no triton: only the reference and tuning tests run
    sgmv_triton = None

needs_triton = pytest.mark.skipif(sgmv_triton is None, reason="triton is not importable")
TRITON = get_backend("triton") if sgmv_triton is not None else None

EMPTY_SLOT = 0  # every pool below keeps slot 0 empty (rank 0)


@dataclass(frozen=True)
class Layout:
    """One projection group: `hidden` inputs, fused slices of widths `outs`."""

    hidden: int
    outs: tuple[int, ...]

    @property
    def out_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for w in self.outs:
            offsets.append(offsets[-1] + w)
        return tuple(offsets)


LAYOUTS = {
    "qkv_gqa": Layout(72, (48, 16, 16)),  # q wider than k and v; hidden not a power of two
    "gate_up": Layout(40, (56, 56)),
    "single": Layout(100, (24,)),  # o/down: one slice
}

# runs: (tokens, slot) in token order, slot None = base-model tokens; ranks: per slot (slot 0
# empty); the pool's max rank.
BATCHES = {
    "one_token": ([(1, 1)], [0, 16], 16),
    "base_interleaved": ([(2, None), (3, 1), (2, None), (4, 2), (1, None)], [0, 8, 16], 16),
    "ranks_1_3_8_16": ([(2, 1), (1, 2), (3, 3), (2, 4)], [0, 1, 3, 8, 16], 16),
    "slot_in_two_segments": ([(3, 1), (2, 2), (4, 1)], [0, 5, 16], 16),
    "long_segments": ([(33, 1), (5, 2), (18, 3)], [0, 16, 4, 11], 16),  # 33 = 16 + 16 + 1
    "decode_distinct": ([(1, 1 + i % 5) for i in range(11)], [0, 2, 16, 7, 1, 12], 16),
    "rank_loop_r32": ([(3, 1), (2, 2), (4, 3)], [0, 32, 20, 9], 32),
    # a pool of max rank 8: rank steps clamped to 16, rows past 8 read nothing
    "pool_of_rank_8": ([(1, 1), (2, 2), (1, 3), (3, 1)], [0, 8, 3, 5], 8),
    # one-token segments in a pool of max rank WIDE_RANK: the wide-rank rows by default
    "decode_wide_rank": ([(1, 1 + i % 4) for i in range(6)], [0, 64, 8, 33, 1], 64),
    # one-token segments after a base token, one of them on the empty slot (rank 0)
    "decode_base_and_empty": ([(1, None), (1, 1), (1, 2), (1, None), (1, 3), (1, 1), (1, 4)],
                              [0, 16, 3, 8, 1], 16),
}


def one_row(shrink: ShrinkTiling, expand: ExpandTiling) -> SgmvTuning:
    """A tuning of one row a kernel, serving every batch."""
    return SgmvTuning(shrink=(Row(shrink, None),), expand=(Row(expand, None),))


# Each forces paths the default rows may not reach on the small shapes below.
TILINGS = {
    # split-K over an uneven hidden size, several column blocks a slice, a rank loop of several
    # steps, tiles of several tokens in tile products
    "small": one_row(ShrinkTiling(16, 16, 16, 48, num_warps=4, num_stages=2, programs_per_sm=3),
                     ExpandTiling(16, 32, 16, num_warps=4, num_stages=2, programs_per_sm=3)),
    # prefill-style: 32-token tiles, one column block spanning the fused slices, no split-K
    "wide": one_row(ShrinkTiling(32, 64, 32, NO_SPLIT, num_warps=4, num_stages=2,
                                 programs_per_sm=2),
                    ExpandTiling(32, 64, 32, num_warps=4, num_stages=2, programs_per_sm=2)),
    # decode: one-token tiles (matrix-vector products), split-K over an uneven hidden size
    "token": one_row(ShrinkTiling(1, 16, 32, 64, num_warps=4, num_stages=2, programs_per_sm=3),
                     ExpandTiling(1, 16, 16, num_warps=4, num_stages=1, programs_per_sm=3)),
    # decode without split-K: a column block narrowed to the whole rows of A `max_a_block`
    # allows, weights streamed past the caches
    "unsplit": one_row(ShrinkTiling(1, 16, 64, NO_SPLIT, num_warps=4, num_stages=1,
                                    programs_per_sm=3, max_a_block=128, stream_weights=True),
                       ExpandTiling(1, 16, 16, num_warps=4, num_stages=1, programs_per_sm=3,
                                    stream_weights=True)),
}


def triton_backend(name: str):
    """The Triton backend under the default tuning ("default") or one of TILINGS."""
    if sgmv_triton is None:
        pytest.skip("triton is not importable")
    return get_backend("triton", DEFAULT_TUNING if name == "default" else TILINGS[name])


@pytest.fixture(params=["default", *TILINGS])
def sgmv(request):
    """The Triton backend under the default tuning, then under each of TILINGS."""
    return triton_backend(request.param)


def sweep() -> list[tuple[str, str, str]]:
    """(tuning, layout, batch) triples. Compiled on a GPU: every combination. In Triton's
    interpreter, where each costs seconds: each tuning over every batch with the layouts in turn,
    so that every pair of the three (tuning and layout, layout and batch, tuning and batch) is
    still run."""
    tunings, layouts, batches = ["default", *TILINGS], list(LAYOUTS), list(BATCHES)
    if torch.cuda.is_available():
        return [(t, lay, b) for t in tunings for lay in layouts for b in batches]
    return [(t, layouts[(i + j) % len(layouts)], b)
            for i, t in enumerate(tunings) for j, b in enumerate(batches)]


def make_batch(
    runs: list[tuple[int, int | None]], ranks: list[int], device=DEVICE, seed: int = 0
) -> SgmvBatch:
    """Base tokens before the first segment start seg_indptr past 0, those after the last are
    outside every segment, and those in between form a segment on the empty slot."""
    g = torch.Generator().manual_seed(seed + 1)
    scalings = (torch.rand(len(ranks), generator=g) * 2 + 0.25).tolist()
    while runs and runs[-1][1] is None:
        runs = runs[:-1]
    lead = runs[0][0] if runs and runs[0][1] is None else 0
    starts, ends, slots, pos = [], [], [], lead
    for n, slot in runs[1:] if lead else runs:
        starts.append(pos)
        pos += n
        ends.append(pos)
        slots.append(EMPTY_SLOT if slot is None else slot)
    return batch_from_tables(starts, ends, slots, ranks, scalings, device)


def batch_from_tables(starts, ends, slots, ranks, scalings, device=DEVICE, num_tokens=None):
    i32 = dict(dtype=torch.int32, device=device)
    return SgmvBatch(
        seg_starts=list(starts),
        seg_ends=list(ends),
        seg_slots_host=list(slots),
        seg_indptr=torch.tensor([starts[0] if starts else 0, *ends], **i32),
        seg_slots=torch.tensor(slots, **i32),
        slot_ranks=torch.tensor(ranks, **i32),
        slot_scalings=torch.tensor(scalings, dtype=torch.float32, device=device),
        slot_ranks_host=tuple(ranks),
        slot_scalings_host=tuple(scalings),
        num_tokens=num_tokens if num_tokens is not None else (ends[-1] if ends else 0),
    )


def make_weights(layout: Layout, ranks: list[int], max_rank: int, dtype=torch.float32, seed=0):
    """A [slots, n*R, hidden] and B [slots, R, sum(outs)], zero past each slot's rank."""
    g = torch.Generator().manual_seed(seed)
    n = len(layout.outs)
    a = torch.randn(len(ranks), n * max_rank, layout.hidden, generator=g) / layout.hidden**0.5
    b = torch.randn(len(ranks), max_rank, sum(layout.outs), generator=g) / max_rank**0.5
    for slot, r in enumerate(ranks):
        a.view(len(ranks), n, max_rank, -1)[slot, :, r:] = 0
        b[slot, r:] = 0
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def segment_rows(batch: SgmvBatch, num_tokens: int) -> torch.Tensor:
    inside = torch.zeros(num_tokens, dtype=torch.bool)
    for s, e in zip(batch.seg_starts, batch.seg_ends, strict=True):
        inside[s:e] = True
    return inside.to(DEVICE)


def poison_unread(h: torch.Tensor, batch: SgmvBatch, max_rank: int) -> torch.Tensor:
    """NaN wherever the expand must not read h: base-model rows and columns past a slot's
    rank."""
    h = h.clone()
    h[~segment_rows(batch, h.shape[0])] = float("nan")
    n = h.shape[1] // max_rank
    for s, e, slot in zip(batch.seg_starts, batch.seg_ends, batch.seg_slots_host, strict=True):
        h[s:e].view(e - s, n, max_rank)[:, :, batch.slot_ranks_host[slot] :] = float("nan")
    return h


def read_by_expand(batch: SgmvBatch, num_tokens: int, num_cols: int, max_rank: int):
    """The entries of h the expand reads (segment rows, columns below their slot's rank): all
    that the shrink promises."""
    return ~torch.isnan(poison_unread(torch.zeros(num_tokens, num_cols), batch, max_rank))


def poison_past_rank(a: torch.Tensor, b: torch.Tensor, ranks: list[int], n: int):
    """NaN in the weights past each slot's rank: the kernels must not read them (true-rank cost)."""
    a, b = a.clone(), b.clone()
    max_rank = b.shape[1]
    for slot, r in enumerate(ranks):
        a.view(a.shape[0], n, max_rank, -1)[slot, :, r:] = float("nan")
        b[slot, r:] = float("nan")
    return a, b


def run_case(layout: Layout, batch_name: str, extra_base_tokens: int = 2):
    runs, ranks, max_rank = BATCHES[batch_name]
    batch = make_batch(runs, ranks)
    num_tokens = batch.num_tokens + extra_base_tokens
    a, b = make_weights(layout, ranks, max_rank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, layout.hidden, generator=g).to(DEVICE)
    y = torch.randn(num_tokens, sum(layout.outs), generator=g).to(DEVICE)
    return batch, a, b, x, y, max_rank


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@needs_triton
class TestTritonMatchesReference:
    @pytest.mark.parametrize("tuning_name, layout_name, batch_name", sweep())
    def test_shrink_then_expand(self, tuning_name, layout_name, batch_name):
        sgmv = triton_backend(tuning_name)
        layout = LAYOUTS[layout_name]
        batch, a, b, x, y, max_rank = run_case(layout, batch_name)
        n = len(layout.outs)
        inside = segment_rows(batch, x.shape[0])

        a_poisoned, b_poisoned = poison_past_rank(a, b, BATCHES[batch_name][1], n)
        h = sgmv.shrink(x, a_poisoned, batch, n)
        h_ref = torch_shrink(x, a, batch, n)
        assert h.shape == h_ref.shape
        read = read_by_expand(batch, x.shape[0], h_ref.shape[1], max_rank)
        assert_close(h[read], h_ref[read])

        y_ref = y.clone()
        torch_expand(h_ref, b, batch, y_ref, layout.out_offsets)
        for h_in in (h_ref, h):  # the reference's h, then the kernel's own
            y_out = y.clone()
            sgmv.expand(poison_unread(h_in, batch, max_rank), b_poisoned, batch, y_out,
                        layout.out_offsets)
            assert_close(y_out, y_ref)
            assert torch.equal(y_out[~inside], y[~inside]), "base-model rows must be untouched"

    def test_apply_is_shrink_then_expand(self):
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, "decode_distinct")
        a_poisoned, b_poisoned = poison_past_rank(a, b, BATCHES["decode_distinct"][1], 3)
        y_ref, y_out = y.clone(), y.clone()
        get_backend("torch").apply(x, a, b, batch, y_ref, layout.out_offsets)
        TRITON.apply(x, a_poisoned, b_poisoned, batch, y_out, layout.out_offsets)
        assert_close(y_out, y_ref)
        inside = segment_rows(batch, x.shape[0])
        assert torch.equal(y_out[~inside], y[~inside]), "base-model rows must be untouched"

    def test_empty_batch_launches_nothing_and_leaves_y(self, sgmv):
        layout = LAYOUTS["qkv_gqa"]
        batch = batch_from_tables([], [], [], [0, 16], [1.0, 1.0])
        a, b = make_weights(layout, [0, 16], 16)
        x = torch.randn(3, layout.hidden, device=DEVICE)
        y = torch.randn(3, sum(layout.outs), device=DEVICE)
        h = sgmv.shrink(x, a, batch, 3)
        assert h.shape == (3, 48)
        y_out = y.clone()
        sgmv.expand(h, b, batch, y_out, layout.out_offsets)
        assert torch.equal(y_out, y)

    @pytest.mark.parametrize("tuning", ["small", "token"])  # the tunings that split K
    def test_split_k_is_deterministic(self, tuning):
        sgmv = triton_backend(tuning)
        layout = LAYOUTS["single"]
        batch, a, b, x, y, _ = run_case(layout, "long_segments")
        first = sgmv.shrink(x, a, batch, 1)
        read = read_by_expand(batch, x.shape[0], first.shape[-1], first.shape[-1])
        assert torch.equal(sgmv.shrink(x, a, batch, 1)[read], first[read])

    def test_graph_style_padded_segments(self, sgmv):
        """Decode graphs pass a fixed segment count; unused segments are empty (equal bounds) and
        point at slot 0, and the host lists are placeholders."""
        layout = LAYOUTS["qkv_gqa"]
        ranks = [16, 4, 16]
        a, b = make_weights(layout, ranks, 16)
        real = batch_from_tables([0, 3, 5], [3, 5, 6], [1, 2, 1], ranks, [0.5, 1.5, 2.0])
        bucket = 8
        padded = SgmvBatch(
            seg_starts=list(range(bucket)),
            seg_ends=list(range(1, bucket + 1)),
            seg_slots_host=[0] * bucket,
            seg_indptr=torch.tensor([0, 3, 5, 6] + [6] * (bucket - 3), dtype=torch.int32,
                                    device=DEVICE),
            seg_slots=torch.tensor([1, 2, 1] + [0] * (bucket - 3), dtype=torch.int32,
                                   device=DEVICE),
            slot_ranks=real.slot_ranks,
            slot_scalings=real.slot_scalings,
            slot_ranks_host=real.slot_ranks_host,
            slot_scalings_host=real.slot_scalings_host,
            num_tokens=bucket,
        )
        x = torch.randn(bucket, layout.hidden, device=DEVICE)
        y = torch.randn(bucket, sum(layout.outs), device=DEVICE)
        h = sgmv.shrink(x, a, padded, 3)
        h_ref = torch_shrink(x, a, real, 3)
        read = read_by_expand(real, bucket, h_ref.shape[1], 16)
        assert_close(h[read], h_ref[read])
        y_out, y_ref = y.clone(), y.clone()
        sgmv.expand(h, b, padded, y_out, layout.out_offsets)
        torch_expand(h_ref, b, real, y_ref, layout.out_offsets)
        assert_close(y_out, y_ref)
        assert torch.equal(y_out[6:], y[6:])

    @pytest.mark.parametrize("batch_name", ["decode_distinct", "base_interleaved"])
    def test_the_one_token_hint_never_changes_results(self, batch_name):
        # Told wrongly that every segment is one token, the launch still computes every token.
        tuning = SgmvTuning(
            shrink=(Row(TILINGS["unsplit"].shrink[0].tiling, None, one_token_segments=True),
                    *TILINGS["small"].shrink),
            expand=(Row(TILINGS["unsplit"].expand[0].tiling, None, one_token_segments=True),
                    *TILINGS["small"].expand),
        )
        sgmv = get_backend("triton", tuning)
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, batch_name)
        assert batch.one_token_segments == (batch_name == "decode_distinct")  # from the host lists
        assert tuning.one_token_variant_differs(batch.num_tokens, 16)
        inside = segment_rows(batch, x.shape[0])
        h_ref = torch_shrink(x, a, batch, 3)
        y_ref = y.clone()
        torch_expand(h_ref, b, batch, y_ref, layout.out_offsets)
        for hint in (True, False):
            hinted = replace(batch, one_token_segments=hint)
            h = sgmv.shrink(x, a, hinted, 3)
            assert_close(h[inside], h_ref[inside])
            y_out = y.clone()
            sgmv.expand(h_ref, b, hinted, y_out, layout.out_offsets)
            assert_close(y_out, y_ref)

    # A base token, then 17 one-token segments (the fewest the 17-128 rows serve) over ranks from
    # 1 to the pool's max rank 64, one past the edge of a column block (33), and a base token
    # between them (a segment on the empty slot).
    WIDE_DECODE = ([(1, None), *[(1, 1 + i % 6) for i in range(6)], (1, None),
                    *[(1, 1 + i % 6) for i in range(10)]], [0, 4, 8, 64, 16, 33, 1], 64)

    def test_wide_pool_decode_reads_only_below_each_slot_s_rank(self):
        """One-token segments in a pool of a wide max rank take the shrink's row whose items
        cover only the column blocks below each slot's rank (`live_items`); weights past a rank
        are NaN, so a read past it would show."""
        runs, ranks, max_rank = self.WIDE_DECODE
        layout = LAYOUTS["qkv_gqa"]
        n = len(layout.outs)
        batch = make_batch(runs, ranks)
        num_tokens = batch.num_tokens + 1
        assert batch.one_token_segments and batch.num_tokens > 16
        assert DEFAULT_TUNING.shrink_tiling(num_tokens, True, max_rank).live_items
        plan = shrink_plan(num_tokens, layout.hidden, n * max_rank, max_rank,
                           segments=batch.num_segments, one_token=True, slots=len(ranks))
        assert plan.constants["LIVE_ITEMS"]

        a, b = make_weights(layout, ranks, max_rank)
        a_poisoned, b_poisoned = poison_past_rank(a, b, ranks, n)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(num_tokens, layout.hidden, generator=g).to(DEVICE)
        y = torch.randn(num_tokens, sum(layout.outs), generator=g).to(DEVICE)
        h = TRITON.shrink(x, a_poisoned, batch, n)
        h_ref = torch_shrink(x, a, batch, n)
        read = read_by_expand(batch, num_tokens, n * max_rank, max_rank)
        assert_close(h[read], h_ref[read])
        y_out, y_ref = y.clone(), y.clone()
        TRITON.expand(poison_unread(h, batch, max_rank), b_poisoned, batch, y_out,
                      layout.out_offsets)
        torch_expand(h_ref, b, batch, y_ref, layout.out_offsets)
        assert_close(y_out, y_ref)

    def test_items_below_each_rank_serve_segments_of_several_tokens(self):
        # A row computes every batch, whatever the hint: live items over segments of 2-4 tokens.
        tiling = ShrinkTiling(1, 16, 128, NO_SPLIT, num_warps=4, num_stages=1,
                              programs_per_sm=3, live_items=True)
        sgmv = get_backend("triton", replace(TILINGS["unsplit"], shrink=(Row(tiling, None),)))
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, _, max_rank = run_case(layout, "slot_in_two_segments")
        plan = shrink_plan(x.shape[0], layout.hidden, 3 * max_rank, max_rank,
                           segments=batch.num_segments, tuning=sgmv.tuning, slots=3)
        assert plan.constants["LIVE_ITEMS"]
        a_poisoned, _ = poison_past_rank(a, b, BATCHES["slot_in_two_segments"][1], 3)
        h = sgmv.shrink(x, a_poisoned, batch, 3)
        h_ref = torch_shrink(x, a, batch, 3)
        read = read_by_expand(batch, x.shape[0], h_ref.shape[1], max_rank)
        assert_close(h[read], h_ref[read])

    def test_expand_reads_b_as_columns_of_a_wider_matrix(self):
        # The slot pool keeps every group's B as a column range of one [R, width] matrix per
        # slot: rows further apart than the group's width.
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, "long_segments")
        wide = torch.full((b.shape[0], b.shape[1], b.shape[2] + 40), float("nan"), device=DEVICE)
        view = wide[:, :, 24 : 24 + b.shape[2]]
        view.copy_(b)
        h = torch_shrink(x, a, batch, 3)
        y_ref = y.clone()
        torch_expand(h, b, batch, y_ref, layout.out_offsets)
        TRITON.expand(h, view, batch, y, layout.out_offsets)
        assert_close(y, y_ref)

    def test_rejects_mixed_dtypes(self):
        layout = LAYOUTS["single"]
        batch, a, b, x, y, _ = run_case(layout, "one_token")
        with pytest.raises(AssertionError):
            TRITON.shrink(x.double(), a, batch, 1)
        with pytest.raises(AssertionError):
            TRITON.expand(x[:, :16].half(), b, batch, y, layout.out_offsets)

    def test_rejects_strided_hidden_dimension(self):
        layout = LAYOUTS["single"]
        batch, a, _, x, _, _ = run_case(layout, "one_token")
        x_strided = torch.randn(x.shape[1], x.shape[0], device=DEVICE).t()
        with pytest.raises(AssertionError):
            TRITON.shrink(x_strided, a, batch, 1)

    def test_rejects_widths_that_do_not_add_up(self):
        layout = LAYOUTS["gate_up"]
        batch, a, b, x, y, _ = run_case(layout, "one_token")
        h = torch_shrink(x, a, batch, 2)
        with pytest.raises(AssertionError):
            TRITON.expand(h, b, batch, y, (0, 56, 100))


OFFSETS = (0, 4096, 5120, 6144)  # Llama-3-8B's q/k/v


def shrink_plan(tokens, hidden=4096, cols=48, max_rank=16, segments=None, one_token=False,
                tuning=DEFAULT_TUNING, pdl=False, slots=64):
    return sgmv_triton.shrink_plan(tuning, one_token, tokens, hidden, cols, max_rank,
                                   tokens if segments is None else segments, slots, False, 132,
                                   pdl)


def expand_plan(tokens, offsets=OFFSETS, max_rank=16, segments=None, one_token=False,
                tuning=DEFAULT_TUNING, pdl=False, slots=64):
    return sgmv_triton.expand_plan(tuning, one_token, tokens, offsets, max_rank,
                                   tokens if segments is None else segments, slots, False, 132,
                                   pdl)


@needs_triton
class TestLaunchPlans:
    def test_registered_as_the_triton_backend(self):
        backend = get_backend("triton")
        assert isinstance(backend, sgmv_triton.TritonSgmv)
        assert backend.tuning is DEFAULT_TUNING
        assert isinstance(get_backend("torch"), TorchSgmv)

    @pytest.mark.parametrize("block_m", [1, 2, 4, 16])
    def test_grid_bound_is_the_most_tiles_any_segmentation_owns(self, block_m):
        """Every way of cutting T tokens into at most S disjoint segments (padding segments
        empty) owns at most `_bound_tiles` tiles, and some way owns exactly that many: the grid
        covers every batch a CUDA graph may replay, with no program to spare."""
        def most_tiles(tokens_left, segments):
            if segments == 0 or tokens_left == 0:
                return 0
            return max(-(-n // block_m) + most_tiles(tokens_left - n, segments - 1)
                       for n in range(tokens_left + 1))

        for tokens in range(1, 11):
            for segments in range(1, 6):
                assert sgmv_triton._bound_tiles(tokens, block_m, segments) == most_tiles(
                    tokens, segments), (tokens, segments)

    def test_one_token_tiles_launch_a_program_per_item(self):
        for tokens in (1, 8):
            e = expand_plan(tokens, one_token=True)
            assert e.constants["BLOCK_M"] == 1
            assert e.grid == (tokens * e.constants["NUM_NB"],)
            for segments in (1, tokens):
                s = shrink_plan(tokens, segments=segments, one_token=True)
                assert s.grid == (tokens * s.constants["NUM_CB"],)

    def test_few_token_items_take_two_whole_rows_of_a(self):
        # Up to 16 tokens a one-token item holds two whole rows of A, the down projection's
        # 14,336-wide rows too, and reads them before the wait under PDL.
        for hidden, cols in ((4096, 48), (14336, 16)):
            for tokens in (1, 8, 16):
                for one_token in (False, True):
                    s = shrink_plan(tokens, hidden, cols, one_token=one_token, pdl=True)
                    assert (s.constants["BLOCK_M"], s.constants["BLOCK_N"]) == (1, 2)
                    assert s.split_k == 1 and s.constants["BLOCK_K"] >= hidden
                    assert s.constants["PRELOAD_A"]

    def test_pools_of_up_to_64_slots_share_compiled_kernels(self):
        # Compile-time constants must not follow the slot count below 64.
        shrinks = {shrink_plan(8, slots=n).constants["BLOCK_SLOTS"] for n in (1, 8, 32, 64)}
        expands = {expand_plan(8, slots=n).constants["BLOCK_SLOTS"] for n in (1, 8, 32, 64)}
        assert shrinks == expands == {64}
        assert sgmv_triton._slot_block(65) == 128

    def test_plans_follow_the_tuning_they_are_given(self):
        small = TILINGS["small"]
        default, swapped = shrink_plan(64), shrink_plan(64, tuning=small)
        assert swapped.constants["BLOCK_M"] == small.shrink[0].tiling.block_m
        assert swapped.constants != default.constants
        e_default, e_swapped = expand_plan(64), expand_plan(64, tuning=small)
        assert e_swapped.constants["BLOCK_M"] == small.expand[0].tiling.block_m
        assert e_swapped.constants != e_default.constants

    def test_plans_are_memoized_by_the_tuning_s_value(self):
        # An eager step launches each kernel once per layer with the same shapes: one plan per
        # shape, shared by equal tunings built apart, not by a tuning of other rows.
        rebuilt = replace(DEFAULT_TUNING, shrink=tuple(DEFAULT_TUNING.shrink))
        assert rebuilt is not DEFAULT_TUNING and rebuilt == DEFAULT_TUNING
        assert hash(rebuilt) == hash(DEFAULT_TUNING)
        assert shrink_plan(8, tuning=rebuilt) is shrink_plan(8)
        assert expand_plan(8, tuning=rebuilt) is expand_plan(8)
        assert shrink_plan(8, tuning=TILINGS["small"]) is not shrink_plan(8)
        x, a = torch.randn(8, 64, device=DEVICE), torch.randn(4, 3 * 16, 64, device=DEVICE)
        batch = batch_from_tables([0], [8], [1], [0, 16, 16, 16], [1.0] * 4)
        before = sgmv_triton.shrink_plan.cache_info()
        first = [TRITON.shrink(x, a, batch, 3) for _ in range(3)]
        after = sgmv_triton.shrink_plan.cache_info()
        assert after.misses - before.misses <= 1 and after.hits - before.hits >= 2
        torch.testing.assert_close(first[1], first[0])

    def test_pdl_travels_with_its_launch_option(self):
        for pdl in (False, True):
            for plan in (shrink_plan(8, pdl=pdl), expand_plan(8, pdl=pdl)):
                assert plan.constants["PDL"] is pdl
                assert plan.constants.get("launch_pdl", False) is pdl
        off = replace(DEFAULT_TUNING, pdl=False)
        assert not get_backend("triton", off)._pdl(torch.device("cpu"))

    def test_one_token_batches_pick_their_own_rows(self):
        one = shrink_plan(64, one_token=True)
        any_ = shrink_plan(64, segments=8)
        assert one.constants["BLOCK_M"] == 1 and any_.constants["BLOCK_M"] == 16
        e_one, e_any = expand_plan(64, one_token=True), expand_plan(64, segments=8)
        assert e_one.constants["BLOCK_M"] == 1 and e_any.constants["BLOCK_M"] == 16
        for max_rank in (16, WIDE_RANK):
            assert TRITON.graph_variants(64, max_rank) == (True, False)
            for tokens in (1, 8, 16, 1024):
                assert TRITON.graph_variants(tokens, max_rank) == (True,)
        assert TorchSgmv().graph_variants(64, 16) == (True,)

    def test_decode_rows_stream_their_weights(self):
        """Decode rows read each weight block once: their loads are marked first out of the
        caches; prefill rows, whose tiles share blocks, keep the default policy."""
        for one_token in (False, True):
            for max_rank in (16, WIDE_RANK):
                for tokens in (1, 8, 64, 128):
                    s = shrink_plan(tokens, cols=3 * max_rank, max_rank=max_rank,
                                    one_token=one_token)
                    e = expand_plan(tokens, max_rank=max_rank, one_token=one_token)
                    assert s.constants["WEIGHT_EVICT"] == "evict_first"
                    assert e.constants["WEIGHT_EVICT"] == "evict_first"
        for tokens in (512, 2048):
            s, e = shrink_plan(tokens, segments=4), expand_plan(tokens, segments=4)
            assert s.constants["WEIGHT_EVICT"] == e.constants["WEIGHT_EVICT"] == ""

    def test_segments_of_several_tokens_pick_their_rows(self):
        """17-128 tokens not all in one-token segments: in rank-16 pools one-token tiles up to
        32 tokens and 16-token tiles with K split 512 past them; in pools of a wide max rank the
        split is 512 up to 32 tokens and 1024 past; one-token batches keep their own rows."""
        t = DEFAULT_TUNING
        assert t.shrink_tiling(32, False, 16).block_m == 1
        for tokens in (33, 128):
            row = t.shrink_tiling(tokens, False, 16)
            assert (row.block_m, row.k_per_split) == (16, 512)
        for tokens, split in ((17, 512), (32, 512), (33, 1024), (128, 1024)):
            row = t.shrink_tiling(tokens, False, WIDE_RANK)
            assert (row.block_m, row.k_per_split) == (16, split)
        for tokens in (17, 32, 128):
            for max_rank in (16, WIDE_RANK):
                row = t.shrink_tiling(tokens, True, max_rank)
                assert (row.block_m, row.max_a_block) == (1, 32768)

    def test_items_below_each_rank_only_where_their_row_can_take_them(self):
        """The shrink's `live_items` row serves 17-128 one-token segments in wide pools, and its
        plan takes the path only without split-K and where the column block divides the max
        rank; rank-16 pools and segments of several tokens keep every block."""
        t = DEFAULT_TUNING
        for tokens in (17, 64, 128):
            assert t.shrink_tiling(tokens, True, WIDE_RANK).live_items
            for one_token, max_rank in ((True, 16), (False, WIDE_RANK)):
                assert not t.shrink_tiling(tokens, one_token, max_rank).live_items
        for tokens in (1, 16, 129):
            assert not t.shrink_tiling(tokens, True, WIDE_RANK).live_items
        for hidden, outs in ((4096, 3), (14336, 1)):  # qkv, down (narrower column blocks)
            live = shrink_plan(64, hidden, outs * 64, 64, one_token=True)
            assert live.constants["LIVE_ITEMS"] and live.split_k == 1
        uneven = shrink_plan(64, 4096, 3 * 100, 100, one_token=True)  # blocks of 8 columns
        assert uneven.constants["BLOCK_N"] == 8 and not uneven.constants["LIVE_ITEMS"]
        split = replace(t.shrink_tiling(64, True, 64), block_k=1024, k_per_split=1024)
        split_plan = shrink_plan(64, 4096, 192, 64, one_token=True,
                                 tuning=one_row(split, TILINGS["token"].expand[0].tiling))
        assert split_plan.split_k == 4 and not split_plan.constants["LIVE_ITEMS"]

    def test_wide_rank_pools_pick_their_rows(self):
        t = DEFAULT_TUNING
        for pick in (t.shrink_tiling, t.expand_tiling):
            # 2-16 tokens, every batch in a pool of a wide max rank
            for one_token in (False, True):
                assert pick(8, one_token, WIDE_RANK) != pick(8, one_token, 16)
                assert pick(16, one_token, 2 * WIDE_RANK) == pick(16, one_token, WIDE_RANK)
            # not below WIDE_RANK, not past 128 tokens
            assert pick(8, True, WIDE_RANK // 2) == pick(8, True, 16)
            assert pick(200, True, WIDE_RANK) == pick(200, True, 16)
        # a single token's shrink is the rank-16 pools' (two rows of A an item)
        assert t.shrink_tiling(1, True, WIDE_RANK) == t.shrink_tiling(1, True, 16)
        # the expand's 16-token tiles over 64 columns and whole 64-row rank steps, up to 128
        # tokens, but one-token batches past 16 take the one-token row
        for tokens in (1, 8, 64):
            row = t.expand_tiling(tokens, False, WIDE_RANK)
            assert (row.block_m, row.block_n, row.block_r) == (16, 64, 64)
        assert t.expand_tiling(64, True, WIDE_RANK) == t.expand_tiling(64, True, 16)


class TestTuning:
    def test_the_last_row_must_serve_every_batch(self):
        row = DEFAULT_TUNING.shrink[0]
        with pytest.raises(ValueError, match="last row"):
            SgmvTuning(shrink=(row,), expand=DEFAULT_TUNING.expand)
        with pytest.raises(ValueError, match="last row"):
            SgmvTuning(shrink=DEFAULT_TUNING.shrink, expand=())

    def test_rows_serve_by_token_count_segments_and_max_rank(self):
        row = Row(DEFAULT_TUNING.shrink[0].tiling, 16, one_token_segments=True, min_max_rank=64)
        assert row.serves(16, True, 64) and row.serves(1, True, 128)
        assert not row.serves(17, True, 64)
        assert not row.serves(8, False, 64)
        assert not row.serves(8, True, 32)

    def test_items_below_each_rank_take_one_token_tiles(self):
        with pytest.raises(ValueError, match="live_items"):
            ShrinkTiling(16, 16, 64, NO_SPLIT, 4, 1, 2, live_items=True)

    def test_a_tuning_is_frozen_and_hashable(self):
        with pytest.raises(AttributeError):
            DEFAULT_TUNING.pdl = False
        assert {DEFAULT_TUNING: 1}[replace(DEFAULT_TUNING)] == 1
        assert replace(DEFAULT_TUNING, pdl=False) != DEFAULT_TUNING


class TestFloat32Caps:
    """Compiled float32 tiles are capped; other dtypes and the interpreter keep the row's."""

    @pytest.mark.parametrize("kernel", ["shrink", "expand"])
    @pytest.mark.parametrize("one_token", [False, True])
    @pytest.mark.parametrize("num_tokens", [1, 16, 17, 200, 5000])
    def test_capped_fields_only(self, kernel, one_token, num_tokens):
        pick = getattr(DEFAULT_TUNING, f"{kernel}_tiling")
        row = pick(num_tokens, one_token, 16)
        capped = pick(num_tokens, one_token, 16, float32=True)
        assert type(capped) is type(row)
        for name, value in asdict(row).items():
            if name in FLOAT32_CAPS:
                assert getattr(capped, name) == min(value, FLOAT32_CAPS[name])
            else:
                assert getattr(capped, name) == value, name
        assert pick(num_tokens, one_token, 16, float32=False) is row

    @needs_triton
    def test_interpreter_float32_is_not_capped(self):
        assert not sgmv_triton._unrolled(torch.zeros(2, 2, dtype=torch.float32, device="cpu"))


def naive_delta(x, a, b, batch: SgmvBatch, out_offsets) -> torch.Tensor:
    """The LoRA delta one token at a time, straight from the formula in kernels/sgmv.py."""
    n = len(out_offsets) - 1
    max_rank = b.shape[1]
    delta = torch.zeros(x.shape[0], out_offsets[-1], dtype=torch.float64)
    for s, e, slot in zip(batch.seg_starts, batch.seg_ends, batch.seg_slots_host, strict=True):
        r, scale = batch.slot_ranks_host[slot], batch.slot_scalings_host[slot]
        for t in range(s, e):
            for i in range(n):
                for o in range(out_offsets[i], out_offsets[i + 1]):
                    acc = 0.0
                    for k in range(r):
                        h = sum(float(x[t, c]) * float(a[slot, i * max_rank + k, c])
                                for c in range(x.shape[1]))
                        acc += h * float(b[slot, k, o])
                    delta[t, o] = scale * acc
    return delta


class TestReferenceMatchesPerTokenLoop:
    @pytest.mark.parametrize("batch_name", ["base_interleaved", "ranks_1_3_8_16",
                                            "slot_in_two_segments"])
    def test_delta(self, batch_name):
        layout = Layout(6, (5, 3, 3))
        runs, ranks, _ = BATCHES[batch_name]
        max_rank = 16
        batch = make_batch(runs, ranks, device="cpu")
        g = torch.Generator().manual_seed(3)
        a = torch.randn(len(ranks), 3 * max_rank, layout.hidden, generator=g, dtype=torch.float64)
        b = torch.randn(len(ranks), max_rank, sum(layout.outs), generator=g, dtype=torch.float64)
        for slot, r in enumerate(ranks):  # the contract: zero past the rank
            a.view(len(ranks), 3, max_rank, -1)[slot, :, r:] = 0
            b[slot, r:] = 0
        x = torch.randn(batch.num_tokens + 1, layout.hidden, generator=g, dtype=torch.float64)
        y = torch.randn(x.shape[0], sum(layout.outs), generator=g, dtype=torch.float64)
        y_ref = y.clone()
        torch_expand(torch_shrink(x, a, batch, 3), b, batch, y_ref, layout.out_offsets)
        torch.testing.assert_close(y_ref - y, naive_delta(x, a, b, batch, layout.out_offsets))


LLAMA3_8B_QKV = Layout(4096, (4096, 1024, 1024))
LLAMA3_8B_DOWN = Layout(14336, (4096,))


@pytest.mark.gpu
@needs_triton
class TestOnGpu:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize(
        "seg_lens", [[1] * 64, [8] * 8, [1], [300, 17, 129, 2]], ids=["b64", "d8", "b1", "prefill"]
    )
    def test_llama3_widths_against_float32_reference(self, dtype, seg_lens):
        self.check_against_float32(LLAMA3_8B_QKV, [0, 8, 16, 32, 64, 16, 8, 64, 32], 64,
                                   seg_lens, dtype)

    @pytest.mark.parametrize("max_rank", [1, 2, 4, 8])
    @pytest.mark.parametrize("seg_lens", [[1] * 8, [3, 1, 4]], ids=["d8", "segments"])
    @pytest.mark.parametrize("layout", [LLAMA3_8B_QKV, LLAMA3_8B_DOWN], ids=["qkv", "down"])
    def test_pools_of_a_max_rank_below_16(self, max_rank, seg_lens, layout):
        ranks = [0, max_rank, max(1, max_rank // 2), max_rank]
        self.check_against_float32(layout, ranks, max_rank, seg_lens, torch.bfloat16)

    @pytest.mark.parametrize("tokens", [17, 128])
    @pytest.mark.parametrize("layout", [LLAMA3_8B_QKV, LLAMA3_8B_DOWN], ids=["qkv", "down"])
    def test_wide_pool_decode_over_mixed_ranks(self, tokens, layout):
        # items only below each slot's rank (`live_items`) over column blocks of 8 (qkv), 2 (down)
        ranks = [0, 4, 8, 64, 16, 33, 1, 64, 32]
        plan = shrink_plan(tokens, layout.hidden, len(layout.outs) * 64, 64, one_token=True)
        assert plan.constants["LIVE_ITEMS"]
        self.check_against_float32(layout, ranks, 64, [1] * tokens, torch.bfloat16)

    @staticmethod
    def check_against_float32(layout, ranks, max_rank, seg_lens, dtype):
        a, b = make_weights(layout, ranks, max_rank, dtype=dtype)
        slots = [1 + i % (len(ranks) - 1) for i in range(len(seg_lens))]
        ends = torch.tensor(seg_lens).cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        scalings = [0.5 + 0.25 * i for i in range(len(ranks))]
        batch = batch_from_tables(starts, ends, slots, ranks, scalings)
        num_tokens = ends[-1] + 3
        x = torch.randn(num_tokens, layout.hidden, device=DEVICE, dtype=dtype)
        y = torch.randn(num_tokens, sum(layout.outs), device=DEVICE, dtype=dtype)
        h = TRITON.shrink(x, a, batch, len(layout.outs))
        h_ref = torch_shrink(x.float(), a.float(), batch, len(layout.outs))
        read = read_by_expand(batch, num_tokens, h.shape[1], max_rank).to(DEVICE)
        torch.testing.assert_close(h[read].float(), h_ref[read], atol=2e-2, rtol=2e-2)
        inside = segment_rows(batch, num_tokens)
        y_out, y_ref = y.clone(), y.float()
        TRITON.expand(h, b, batch, y_out, layout.out_offsets)
        torch_expand(h.float(), b.float(), batch, y_ref, layout.out_offsets)
        torch.testing.assert_close(y_out.float(), y_ref, atol=3e-2, rtol=2e-2)
        assert torch.equal(y_out[~inside], y[~inside])

    def test_split_k_bitwise_stable_over_many_launches(self):
        layout = LLAMA3_8B_DOWN  # the longest split-K
        ranks = [0] + [16] * 64
        a, b = make_weights(layout, ranks, 16, dtype=torch.bfloat16)
        batch = batch_from_tables(list(range(64)), list(range(1, 65)), list(range(1, 65)), ranks,
                                  [1.0] * 65)
        x = torch.randn(64, layout.hidden, device=DEVICE, dtype=torch.bfloat16)
        first = TRITON.shrink(x, a, batch, 1)
        for _ in range(50):
            assert torch.equal(TRITON.shrink(x, a, batch, 1), first)

    def test_cuda_graph_replays_over_new_metadata(self):
        layout, bucket = LLAMA3_8B_QKV, 32
        ranks = [0, 16, 8, 16, 4]
        a, b = make_weights(layout, ranks, 16, dtype=torch.bfloat16)
        indptr = torch.zeros(bucket + 1, dtype=torch.int32, device=DEVICE)
        seg_slots = torch.zeros(bucket, dtype=torch.int32, device=DEVICE)
        x = torch.randn(bucket, layout.hidden, device=DEVICE, dtype=torch.bfloat16)
        y = torch.zeros(bucket, sum(layout.outs), device=DEVICE, dtype=torch.bfloat16)
        real = batch_from_tables([0], [1], [1], ranks, [1.0, 0.5, 2.0, 1.0, 3.0])
        static = SgmvBatch(
            list(range(bucket)), list(range(1, bucket + 1)), [0] * bucket, indptr, seg_slots,
            real.slot_ranks, real.slot_scalings, real.slot_ranks_host, real.slot_scalings_host,
            bucket,
        )

        def step():
            y.zero_()
            TRITON.apply(x, a, b, static, y, layout.out_offsets)

        step()  # compile and size the workspaces before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        steps = [([1] * 32, [1 + i % 4 for i in range(32)]), ([5, 20, 3], [2, 4, 1])]
        for seg_lens, slots in steps:
            ends = torch.tensor(seg_lens).cumsum(0).tolist()
            starts = [0, *ends[:-1]]
            bounds = [0, *ends] + [ends[-1]] * (bucket - len(ends))
            indptr.copy_(torch.tensor(bounds, dtype=torch.int32))
            seg_slots.copy_(torch.tensor(slots + [0] * (bucket - len(slots)), dtype=torch.int32))
            graph.replay()
            batch = batch_from_tables(starts, ends, slots, ranks, list(real.slot_scalings_host),
                                      num_tokens=bucket)
            y_ref = torch.zeros(bucket, sum(layout.outs), device=DEVICE)
            h_ref = torch_shrink(x.float(), a.float(), batch, 3)
            torch_expand(h_ref, b.float(), batch, y_ref, layout.out_offsets)
            torch.testing.assert_close(y.float(), y_ref, atol=3e-2, rtol=2e-2)
