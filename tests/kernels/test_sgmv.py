"""Triton SGMV against the torch reference, and the torch reference against a per-token loop.

Without a GPU the kernels run in Triton's interpreter (float32, tiny sizes); with one, the same
sweeps run compiled, and the `gpu` tests add bf16 at Llama-3-8B widths, CUDA-graph replay over new
metadata, and repeated split-K launches that must agree bit for bit. The float32 caps on the
tuning tables' tilings are checked as data.
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
    get_backend,
    torch_expand,
    torch_shrink,
)
from kernels.sgmv_tuning import (  # noqa: E402
    EXPAND_ONE_TOKEN_TABLE,
    EXPAND_TABLE,
    FLOAT32_CAPS,
    NO_SPLIT,
    SHRINK_ONE_TOKEN_TABLE,
    SHRINK_TABLE,
    TABLE_NAMES,
    ExpandTiling,
    ShrinkTiling,
    pick,
)

try:
    from kernels import sgmv_triton
except ImportError:  # no triton: only the reference and tuning-table tests run
    sgmv_triton = None

needs_triton = pytest.mark.skipif(sgmv_triton is None, reason="triton is not importable")

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
    # a pool of max rank 8: matrix-vector products step over the rank 8 at a time
    "pool_of_rank_8": ([(1, 1), (2, 2), (1, 3), (3, 1)], [0, 8, 3, 5], 8),
    # one-token segments in a pool of max rank WIDE_RANK: the wide-rank rows by default
    "decode_wide_rank": ([(1, 1 + i % 4) for i in range(6)], [0, 64, 8, 33, 1], 64),
    # one-token segments after a base token, one of them on the empty slot (rank 0)
    "decode_base_and_empty": ([(1, None), (1, 1), (1, 2), (1, None), (1, 3), (1, 1), (1, 4)],
                              [0, 16, 3, 8, 1], 16),
}


def small_tiles() -> tuple:
    """Forces split-K over an uneven hidden size, several column blocks per slice, a rank loop
    of several steps and tiles of several tokens stepping over a block's columns, on the small
    shapes above."""
    return (
        ((None, ShrinkTiling(16, 16, 16, 48, num_warps=4, num_stages=2, programs_per_sm=3)),),
        ((None, ExpandTiling(16, 32, 16, num_warps=4, num_stages=2, programs_per_sm=3,
                             tile_n=16)),),
    )


def wide_tiles() -> tuple:
    """Prefill-style: 32-token tiles, one column block spanning the fused slices, no split-K."""
    return (
        ((None, ShrinkTiling(32, 64, 32, NO_SPLIT, num_warps=4, num_stages=2, programs_per_sm=2)),),
        ((None, ExpandTiling(32, 64, 32, num_warps=4, num_stages=2, programs_per_sm=2)),),
    )


def vector_tiles() -> tuple:
    """Decode-style tiles of one and two tokens (matrix-vector products, no tensor cores), narrow
    column blocks, and split-K."""
    return (
        ((None, ShrinkTiling(1, 4, 32, 64, num_warps=4, num_stages=1, programs_per_sm=3)),),
        ((None, ExpandTiling(2, 32, 16, num_warps=4, num_stages=1, programs_per_sm=3)),),
    )


def token_tiles() -> tuple:
    """Decode tiles of one token: the one-dimensional matrix-vector paths of both kernels, with
    split-K over an uneven hidden size and a rank loop of several steps (narrower steps in a
    pool of a max rank below 16)."""
    return (
        ((None, ShrinkTiling(1, 16, 32, 64, num_warps=4, num_stages=2, programs_per_sm=3)),),
        ((None, ExpandTiling(1, 16, 16, num_warps=4, num_stages=1, programs_per_sm=3,
                             narrow_rank_steps=True)),),
    )


def unsplit_tiles() -> tuple:
    """Decode tiles of one token without split-K: a column block narrowed to the few whole rows
    of A that `max_a_block` allows (fewer for a wider hidden size), each item writing h itself;
    weights loaded with the streaming cache policy, the shrink's registers capped."""
    return (
        ((None, ShrinkTiling(1, 16, 64, NO_SPLIT, num_warps=4, num_stages=1, programs_per_sm=3,
                             max_a_block=128, stream_weights=True, max_registers=128)),),
        ((None, ExpandTiling(1, 16, 16, num_warps=4, num_stages=1, programs_per_sm=3,
                             stream_weights=True)),),
    )


def live_tiles() -> tuple:
    """Decode tiles of one token without split-K whose items cover only the column blocks
    below each slot's rank (one or two rows of A per item, so a slot takes several)."""
    _, expand = unsplit_tiles()
    return (
        ((None, ShrinkTiling(1, 16, 64, NO_SPLIT, num_warps=4, num_stages=1, programs_per_sm=3,
                             max_a_block=128, live_items=True)),),
        expand,
    )


def sums_row(k_per_split: int) -> ShrinkTiling:
    """Decode tiles of one token whose expand sums the shrink's partials, over chunks of
    `k_per_split` hidden elements and 8 columns (`max_a_block`) per item."""
    return ShrinkTiling(1, 16, 64, k_per_split, num_warps=4, num_stages=1, programs_per_sm=3,
                        max_a_block=8 * k_per_split, expand_sums=True)


def sums_tiles() -> tuple:
    """Up to 16 tokens the shrink's partials summed by the expand, in chunks of 32 (no layout's
    hidden size a multiple of it); past 16, split-K with its reducer. The expand's 16-token
    tiles take tile products for segments of several tokens and one-token products for the
    others, summing the partials in both, over a rank loop of several steps."""
    shrink, expand = small_tiles()
    return ((16, sums_row(32)), *shrink), expand


def tile_products_tiles() -> tuple:
    """`small_tiles` with the expand's one-token tiles in tile products too (15 rows masked)."""
    shrink, ((_, expand),) = small_tiles()
    return shrink, ((None, replace(expand, token_products=False)),)


TILINGS = {"small": small_tiles, "wide": wide_tiles, "vector": vector_tiles,
           "token": token_tiles, "unsplit": unsplit_tiles, "live": live_tiles,
           "sums": sums_tiles, "tile_products": tile_products_tiles}


def swap_tables(monkeypatch, shrink: tuple, expand: tuple) -> None:
    """`shrink` and `expand` as the kernels' general tables, their other tables empty."""
    for kernel, rows in (("SHRINK", shrink), ("EXPAND", expand)):
        for name in TABLE_NAMES:
            monkeypatch.setattr(sgmv_triton, f"{kernel}_{name}", rows if name == "TABLE" else ())


@pytest.fixture(params=["default", *TILINGS])
def tiling(request, monkeypatch):
    if sgmv_triton is None:
        pytest.skip("triton is not importable")
    if request.param != "default":
        swap_tables(monkeypatch, *TILINGS[request.param]())
    return request.param


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
    """NaN wherever the expand must not read h (or each of its partials [S, T, n*R]): base-model
    rows and columns past a slot's rank."""
    if h.dim() == 3:
        return torch.stack([poison_unread(part, batch, max_rank) for part in h])
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


def summed(h: torch.Tensor) -> torch.Tensor:
    """h itself, or the sum of the partials an `expand_sums` shrink returns in its place."""
    return h.sum(dim=0) if h.dim() == 3 else h


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
    @pytest.mark.parametrize("batch_name", list(BATCHES))
    @pytest.mark.parametrize("layout_name", list(LAYOUTS))
    def test_shrink_then_expand(self, layout_name, batch_name, tiling):
        layout = LAYOUTS[layout_name]
        batch, a, b, x, y, max_rank = run_case(layout, batch_name)
        n = len(layout.outs)
        inside = segment_rows(batch, x.shape[0])

        a_poisoned, b_poisoned = poison_past_rank(a, b, BATCHES[batch_name][1], n)
        h = sgmv_triton.triton_shrink(x, a_poisoned, batch, n)
        h_ref = torch_shrink(x, a, batch, n)
        assert summed(h).shape == h_ref.shape
        read = read_by_expand(batch, x.shape[0], h_ref.shape[1], max_rank)
        assert_close(summed(h)[read], h_ref[read])

        y_ref = y.clone()
        torch_expand(h_ref, b, batch, y_ref, layout.out_offsets)
        for h_in in (h_ref, h):  # the reference's h, then the kernel's own (h or partials)
            y_out = y.clone()
            sgmv_triton.triton_expand(poison_unread(h_in, batch, max_rank), b_poisoned, batch,
                                      y_out, layout.out_offsets)
            assert_close(y_out, y_ref)
            assert torch.equal(y_out[~inside], y[~inside]), "base-model rows must be untouched"

    def test_apply_is_shrink_then_expand(self):
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, "decode_distinct")
        a_poisoned, b_poisoned = poison_past_rank(a, b, BATCHES["decode_distinct"][1], 3)
        y_ref, y_out = y.clone(), y.clone()
        get_backend("torch").apply(x, a, b, batch, y_ref, layout.out_offsets)
        get_backend("triton").apply(x, a_poisoned, b_poisoned, batch, y_out, layout.out_offsets)
        assert_close(y_out, y_ref)
        inside = segment_rows(batch, x.shape[0])
        assert torch.equal(y_out[~inside], y[~inside]), "base-model rows must be untouched"

        empty = batch_from_tables([], [], [], [0, 16], [1.0, 1.0], num_tokens=x.shape[0])
        a, b = make_weights(layout, [0, 16], 16)
        y_out = y.clone()
        get_backend("triton").apply(x, a, b, empty, y_out, layout.out_offsets)
        assert torch.equal(y_out, y)

    def test_empty_batch_launches_nothing_and_leaves_y(self, tiling):
        layout = LAYOUTS["qkv_gqa"]
        batch = batch_from_tables([], [], [], [0, 16], [1.0, 1.0])
        a, b = make_weights(layout, [0, 16], 16)
        x = torch.randn(3, layout.hidden, device=DEVICE)
        y = torch.randn(3, sum(layout.outs), device=DEVICE)
        h = sgmv_triton.triton_shrink(x, a, batch, 3)
        assert h.shape == (3, 48)
        y_out = y.clone()
        sgmv_triton.triton_expand(h, b, batch, y_out, layout.out_offsets)
        assert torch.equal(y_out, y)

    def test_split_k_is_deterministic(self, tiling):
        layout = LAYOUTS["single"]
        batch, a, b, x, y, _ = run_case(layout, "decode_distinct")
        first = sgmv_triton.triton_shrink(x, a, batch, 1)
        read = read_by_expand(batch, x.shape[0], first.shape[-1], first.shape[-1])
        for _ in range(3):  # (each of the partials, where the expand sums them)
            again = sgmv_triton.triton_shrink(x, a, batch, 1)
            assert torch.equal(again[..., read], first[..., read])

    def test_graph_style_padded_segments(self, tiling):
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
        h = sgmv_triton.triton_shrink(x, a, padded, 3)
        h_ref = torch_shrink(x, a, real, 3)
        read = read_by_expand(real, bucket, h_ref.shape[1], 16)
        assert_close(summed(h)[read], h_ref[read])
        y_out, y_ref = y.clone(), y.clone()
        sgmv_triton.triton_expand(h, b, padded, y_out, layout.out_offsets)
        torch_expand(h_ref, b, real, y_ref, layout.out_offsets)
        assert_close(y_out, y_ref)
        assert torch.equal(y_out[6:], y[6:])


@needs_triton
class TestExpandSumsPartials:
    """A shrink row with `expand_sums`: the shrink returns a float32 partial per hidden chunk,
    and the expand sums them as it reads h."""

    @pytest.mark.parametrize("hidden, chunk, splits", [(100, 32, 4), (96, 32, 3), (72, 16, 5)])
    def test_shrink_returns_each_chunks_partial(self, monkeypatch, hidden, chunk, splits):
        swap_tables(monkeypatch, ((None, sums_row(chunk)),), token_tiles()[1])
        layout = Layout(hidden, (24, 8))
        batch, a, b, x, _, max_rank = run_case(layout, "decode_distinct")
        a_poisoned, _ = poison_past_rank(a, b, BATCHES["decode_distinct"][1], 2)
        part = sgmv_triton.triton_shrink(x, a_poisoned, batch, 2)
        assert part.shape == (splits, x.shape[0], 2 * max_rank) and part.dtype == torch.float32
        read = read_by_expand(batch, x.shape[0], 2 * max_rank, max_rank)
        for s in range(splits):  # partial s: the product over hidden chunk s alone
            k = slice(s * chunk, (s + 1) * chunk)
            chunk_ref = torch_shrink(x[:, k].contiguous(), a[:, :, k].contiguous(), batch, 2)
            assert_close(part[s][read], chunk_ref[read])

    def test_a_chunk_covering_the_hidden_size_returns_h_as_without_the_mode(self, monkeypatch):
        layout = LAYOUTS["qkv_gqa"]  # hidden 72 in one chunk of 128
        batch, a, _, x, _, max_rank = run_case(layout, "decode_distinct")
        read = read_by_expand(batch, x.shape[0], a.shape[1], max_rank)
        hs = []
        for row in (sums_row(128), replace(sums_row(128), expand_sums=False)):
            swap_tables(monkeypatch, ((None, row),), token_tiles()[1])
            hs.append(sgmv_triton.triton_shrink(x, a, batch, 3))
        assert hs[0].shape == (x.shape[0], a.shape[1]) and hs[0].dtype == x.dtype
        assert torch.equal(hs[0][read], hs[1][read])

    @pytest.mark.parametrize("batch_name", ["decode_base_and_empty", "base_interleaved",
                                            "rank_loop_r32"])
    def test_expand_of_partials_is_expand_of_their_sum(self, monkeypatch, batch_name):
        # one-token segments take the expand's one-token products, longer ones its tile products
        swap_tables(monkeypatch, *sums_tiles())
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, max_rank = run_case(layout, batch_name)
        part = poison_unread(sgmv_triton.triton_shrink(x, a, batch, 3), batch, max_rank)
        assert part.dim() == 3
        y_part, y_sum = y.clone(), y.clone()
        sgmv_triton.triton_expand(part, b, batch, y_part, layout.out_offsets)
        sgmv_triton.triton_expand(part.sum(dim=0).to(y.dtype), b, batch, y_sum,
                                  layout.out_offsets)
        assert_close(y_part, y_sum)

    def test_shrink_then_expand_is_bit_identical_across_launches(self, monkeypatch):
        swap_tables(monkeypatch, *sums_tiles())
        layout = LAYOUTS["gate_up"]
        batch, a, b, x, y, max_rank = run_case(layout, "base_interleaved")
        read = read_by_expand(batch, x.shape[0], a.shape[1], max_rank)

        def launch() -> tuple[torch.Tensor, torch.Tensor]:
            part, y_out = sgmv_triton.triton_shrink(x, a, batch, 2), y.clone()
            sgmv_triton.triton_expand(part, b, batch, y_out, layout.out_offsets)
            return part[..., read], y_out

        first = launch()
        assert first[0].dim() == 2  # [splits, entries read]: partials
        for _ in range(2):
            again = launch()
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@needs_triton
class TestLaunchers:
    def test_registered_as_the_triton_backend(self):
        assert get_backend("triton") == (sgmv_triton.triton_shrink, sgmv_triton.triton_expand)

    @pytest.mark.parametrize("max_rank, block_n, block_r", [(16, 512, 16), (32, 256, 32),
                                                            (64, 128, 64), (128, 128, 64)])
    def test_expand_tile_narrows_as_the_rank_step_widens(self, max_rank, block_n, block_r):
        table = ((None, ExpandTiling(16, 512, 64, num_warps=4, num_stages=2, programs_per_sm=16,
                                     max_tile=8192)),)
        offsets = (0, 4096, 5120, 6144)
        plan = sgmv_triton._expand_plan(table, 64, offsets, max_rank, 64, 64, False, 132)
        assert (plan.constants["BLOCK_N"], plan.constants["BLOCK_R"]) == (block_n, block_r)
        assert plan.constants["NUM_NB"] == sum(-(-w // block_n) for w in (4096, 1024, 1024))

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

    def test_one_token_tiles_launch_a_program_per_item_and_the_rows_spare_tiles(self):
        # one-token tiles: a program per (token, column block) plus the row's spare tiles'
        # worth, however many segments the batch holds (at most one per token)
        offsets = (0, 4096, 5120, 6144)
        for tokens in (1, 8):
            spare = pick(sgmv_triton._expand_table(True, 16), tokens).spare_tiles
            e = sgmv_triton._expand_plan(sgmv_triton._expand_table(True, 16), tokens, offsets,
                                         16, tokens, 64, False, 132)
            assert e.constants["BLOCK_M"] == 1
            assert e.grid == ((tokens + spare) * e.constants["NUM_NB"],)
            for segments in (1, tokens):
                spare = pick(sgmv_triton._shrink_table(True, 16), tokens).spare_tiles
                s = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(True, 16), tokens, 4096,
                                             48, 16, segments, 64, False, 132)
                assert s.grid == ((tokens + spare) * s.constants["NUM_CB"],)

    def test_a_single_token_keeps_a_spare_tile_only_in_rank_16_pools(self):
        # up to 16 tokens of one-token segments (any decode batch of distinct adapters)
        wide = sgmv_triton.WIDE_RANK
        for kernel in ("shrink", "expand"):
            table = sgmv_triton.TABLES[kernel]
            assert pick(table(True, 16), 1).spare_tiles == 1
            assert pick(table(True, wide), 1).spare_tiles == 0
            for tokens in (2, 8, 16):
                for max_rank in (16, wide):
                    assert pick(table(True, max_rank), tokens).spare_tiles == 0
            assert pick(table(True, 16), 64).spare_tiles == 1
        # the shrink's few-token rows serve segments of several tokens too
        assert pick(sgmv_triton._shrink_table(False, 16), 8).spare_tiles == 0

    def test_a_register_cap_travels_as_a_launch_option(self):
        """Wide pools' several-token segments up to 16 tokens: the compiler's registers capped
        (`maxnreg`); one-token batches, rank-16 pools and wider batches: its own choice."""
        wide = sgmv_triton.WIDE_RANK

        def cap(one_token, max_rank, tokens):
            plan = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(one_token, max_rank),
                                            tokens, 14336, max_rank, max_rank, tokens, 64,
                                            False, 132)
            return plan.constants.get("maxnreg")

        for tokens in (2, 8, 16):
            assert cap(False, wide, tokens) == 128
            assert cap(True, wide, tokens) is None
            assert cap(False, 16, tokens) is None
        for tokens in (1, 17, 128):
            assert cap(False, wide, tokens) is None
        row = ExpandTiling(1, 1024, 16, num_warps=4, num_stages=1, programs_per_sm=2,
                           max_registers=96)
        plan = sgmv_triton._expand_plan(((None, row),), 1, (0, 4096), 16, 1, 64, False, 132)
        assert plan.constants["maxnreg"] == 96

    def test_few_token_items_take_two_rows_of_a_at_every_hidden_size(self):
        # Up to 16 tokens a one-token item holds two rows of A, the down projection's 14,336-wide
        # rows too (one row an item would read each token's x row twice as often): whole rows
        # from 2 tokens, and for a single token in two chunks whose sum the expand takes.
        for hidden, cols in ((4096, 48), (14336, 16)):
            for tokens in (1, 8, 16):
                for one_token in (False, True):
                    s = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(one_token, 16),
                                                 tokens, hidden, cols, 16, tokens, 64, False, 132)
                    assert s.constants["BLOCK_M"] == 1
                    assert s.constants["BLOCK_N"] == 2, (hidden, tokens)
                    chunks = 2 if tokens == 1 and hidden > 8192 else 1
                    assert s.split_k == chunks and s.expand_sums == (chunks > 1)
                    assert s.constants["BLOCK_K"] * chunks >= hidden

    def test_wide_pools_sum_chunks_in_the_expand_for_one_token_segments_only(self):
        wide = sgmv_triton.WIDE_RANK
        for tokens in (2, 8, 16):
            one = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(True, wide), tokens, 14336,
                                           wide, wide, tokens, 64, False, 132)
            assert one.expand_sums and one.split_k == 2 and one.constants["BLOCK_N"] == 2
            several = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(False, wide), tokens,
                                               14336, wide, wide, 1, 64, False, 132)
            assert not several.expand_sums and several.split_k == 1
        single = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(True, wide), 1, 14336, wide,
                                          wide, 1, 64, False, 132)
        assert not single.expand_sums

    @pytest.mark.parametrize("hidden, cols", [(4096, 48), (14336, 16)])
    def test_expand_sums_items_are_one_chunk_each_without_counters(self, hidden, cols):
        # The few-token row over 2048-wide chunks: an item per (token, column block, chunk), its
        # whole chunk one step (A read before the wait), the partials the shrink's result.
        row = replace(pick(sgmv_triton.SHRINK_TABLE, 8), expand_sums=True, k_per_split=2048)
        plan = sgmv_triton._shrink_plan(((None, row),), 8, hidden, cols, 16, 8, 64, False, 132,
                                        True)
        c = plan.constants
        assert plan.expand_sums and c["EXPAND_SUMS"] and plan.num_locks == 0
        assert plan.split_k == hidden // 2048 and c["BLOCK_K"] == c["K_PER_SPLIT"] == 2048
        assert c["PRELOAD_A"]
        items = (8 + row.spare_tiles) * c["NUM_CB"] * plan.split_k
        assert plan.grid == (min(items, 132 * row.programs_per_sm),)
        # a chunk covering the hidden size: the plain row's plan, writing h
        whole = replace(row, k_per_split=NO_SPLIT)
        assert sgmv_triton._shrink_plan(((None, whole),), 8, hidden, cols, 16, 8, 64, False,
                                        132, True) == sgmv_triton._shrink_plan(
            ((None, replace(whole, expand_sums=False)),), 8, hidden, cols, 16, 8, 64, False, 132,
            True)

    def test_wide_pools_expand_up_to_8_tokens_in_tile_products_only(self):
        # segments of several tokens: every tile (one-token ones too) in tile products over 128
        # columns, no spare tile; one-token batches keep their one-token products
        wide, offsets = sgmv_triton.WIDE_RANK, (0, 14336, 28672)
        several = [sgmv_triton._expand_plan(sgmv_triton._expand_table(False, wide), tokens,
                                            offsets, wide, 2, 64, False, 132, True)
                   for tokens in (2, 8, 9)]
        for plan in several[:2]:
            c = plan.constants
            assert (c["BLOCK_M"], c["BLOCK_N"], c["TOKEN_PRODUCTS"]) == (16, 128, False)
            assert plan.grid == (2 * 28672 // 128,)  # two segments: at most two tiles
        assert several[2].constants["TOKEN_PRODUCTS"] and several[2].constants["BLOCK_N"] == 64
        one = sgmv_triton._expand_plan(sgmv_triton._expand_table(True, wide), 8, offsets, wide,
                                       8, 64, False, 132, True)
        assert one.constants["BLOCK_M"] == 1 and one.constants["TOKEN_PRODUCTS"]

    def test_rank_steps_follow_a_low_max_rank_up_to_16_tokens(self):
        offsets = (0, 14336, 28672)
        for one_token, tokens, block_r in ((True, 8, 8), (False, 16, 8), (True, 64, 16),
                                           (False, 64, 16)):
            plan = sgmv_triton._expand_plan(sgmv_triton._expand_table(one_token, 8), tokens,
                                            offsets, 8, 2, 64, False, 132, True)
            assert plan.constants["BLOCK_R"] == block_r, (one_token, tokens)
            assert not plan.constants["MULTI_R"]

    def test_expand_takes_the_partials_count_as_a_constant(self):
        offsets = (0, 4096, 5120, 6144)
        table = sgmv_triton._expand_table(True, 16)
        plain = sgmv_triton._expand_plan(table, 8, offsets, 16, 8, 64, False, 132, True)
        summing = sgmv_triton._expand_plan(table, 8, offsets, 16, 8, 64, False, 132, True, 7)
        assert (plain.constants["H_SPLITS"], summing.constants["H_SPLITS"]) == (1, 7)
        assert plain.grid == summing.grid

    def test_pools_of_up_to_64_slots_share_compiled_kernels(self):
        # Compile-time constants must not follow the slot count below 64.
        offsets = (0, 4096, 5120, 6144)
        shrinks = {sgmv_triton._shrink_plan(sgmv_triton.SHRINK_TABLE, 8, 4096, 48, 16, 8, n,
                                            False, 132).constants["BLOCK_SLOTS"]
                   for n in (1, 8, 32, 64)}
        expands = {sgmv_triton._expand_plan(sgmv_triton.EXPAND_TABLE, 8, offsets, 16, 8, n,
                                            False, 132).constants["BLOCK_SLOTS"]
                   for n in (1, 8, 32, 64)}
        assert shrinks == expands == {64}
        assert sgmv_triton._slot_block(65) == 128

    def test_a_swapped_tuning_table_takes_effect(self, monkeypatch):
        # Launch plans are cached per shape: the table in force must be part of the key.
        args = (64, 4096, 48, 16, 8, 8, False, 132)
        default = sgmv_triton._shrink_plan(sgmv_triton.SHRINK_TABLE, *args)
        shrink, expand = small_tiles()
        monkeypatch.setattr(sgmv_triton, "SHRINK_TABLE", shrink)
        swapped = sgmv_triton._shrink_plan(sgmv_triton.SHRINK_TABLE, *args)
        assert swapped.constants["BLOCK_M"] == shrink[0][1].block_m
        assert swapped.constants != default.constants
        offsets = (0, 4096, 5120, 6144)
        e_default = sgmv_triton._expand_plan(sgmv_triton.EXPAND_TABLE, 64, offsets, 16, 8, 8,
                                             False, 132)
        e_swapped = sgmv_triton._expand_plan(expand, 64, offsets, 16, 8, 8, False, 132)
        assert e_swapped.constants["BLOCK_M"] == expand[0][1].block_m
        assert e_swapped.constants != e_default.constants

    def test_launch_plans_are_made_once_per_shape_and_tables_in_force(self, monkeypatch):
        # An eager step launches each kernel once per layer with the same shapes: the plan is
        # made once, and again when a table is swapped.
        monkeypatch.setattr(sgmv_triton, "_plans", {})
        made = []
        real = sgmv_triton._shrink_plan

        def counting(*args):
            made.append(args[1:])
            return real(*args)

        monkeypatch.setattr(sgmv_triton, "_shrink_plan", counting)
        x = torch.randn(8, 64)
        a = torch.randn(4, 3 * 16, 64)
        batch = batch_from_tables([0], [8], [1], [0, 16, 16, 16], [1.0] * 4)
        first = [sgmv_triton.triton_shrink(x, a, batch, 3) for _ in range(3)]
        assert len(made) == 1
        torch.testing.assert_close(first[1], first[0])
        shrink, _ = small_tiles()
        monkeypatch.setattr(sgmv_triton, "SHRINK_TABLE", shrink)
        monkeypatch.setattr(sgmv_triton, "SHRINK_ONE_TOKEN_TABLE", ())
        monkeypatch.setattr(sgmv_triton, "SHRINK_NARROW_RANK_TABLE", ())
        sgmv_triton.triton_shrink(x, a, batch, 3)
        assert len(made) == 2  # the swapped tables' plan
        ((key, (plan, tables)),) = [e for e in sgmv_triton._plans.items() if e[1][1][0] is shrink]
        assert plan.constants["BLOCK_M"] == shrink[0][1].block_m and id(shrink) in key

    def test_narrow_rank_pools_take_one_row_of_a_down_items_over_16_warps(self):
        # Pools of max rank 8 and below, 2-8 tokens, every batch: the down projection's items
        # one row of A each, the 4,096-wide groups' two, over 16 warps; a single token, more
        # tokens and rank-16 pools keep the rows before.
        narrow = sgmv_triton.NARROW_RANK
        for max_rank in (1, 4, narrow):
            for tokens in (2, 8):
                for one_token in (False, True):
                    table = sgmv_triton._shrink_table(one_token, max_rank)
                    for hidden, rows in ((4096, 2), (14336, 1)):
                        s = sgmv_triton._shrink_plan(table, tokens, hidden, max_rank, max_rank,
                                                     tokens, 64, False, 132)
                        c = s.constants
                        assert (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]) == (1, rows, 16)
                        assert s.split_k == 1
            assert not sgmv_triton.one_token_variant_differs(8, max_rank)
        before = sgmv_triton._shrink_table(True, 16)
        for max_rank, tokens in ((narrow, 1), (narrow, 16), (16, 8), (2 * narrow, 2)):
            row = pick(sgmv_triton._shrink_table(True, max_rank), tokens)
            assert row == pick(before, tokens) and row.num_warps == 8, (max_rank, tokens)
        assert pick(sgmv_triton._shrink_table(False, narrow), 16) == pick(
            sgmv_triton._shrink_table(False, 16), 16)
        # the expand's rows are the rank-16 pools' (their rank steps narrow by themselves)
        for tokens in (1, 8, 64):
            for one_token in (False, True):
                assert pick(sgmv_triton._expand_table(one_token, narrow), tokens) == pick(
                    sgmv_triton._expand_table(one_token, 16), tokens)

    def test_one_token_batches_pick_their_own_rows(self):
        args = (64, 4096, 48, 16, 64, 64, False, 132)
        one = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(True, 16), *args)
        any_ = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(False, 16), *args)
        assert one.constants["BLOCK_M"] == 1 and one.split_k == 1
        assert any_.constants["BLOCK_M"] == 16 and any_.split_k > 1
        offsets = (0, 4096, 5120, 6144)
        e_one = sgmv_triton._expand_plan(sgmv_triton._expand_table(True, 16), 64, offsets, 16,
                                         64, 64, False, 132)
        e_any = sgmv_triton._expand_plan(sgmv_triton._expand_table(False, 16), 64, offsets, 16,
                                         64, 64, False, 132)
        assert e_one.constants["BLOCK_M"] == 1 and e_any.constants["BLOCK_M"] == 16
        # a CUDA graph needs a variant only where the rows differ
        assert sgmv_triton.one_token_variant_differs(64, 16)
        assert not sgmv_triton.one_token_variant_differs(1, 16)
        assert not sgmv_triton.one_token_variant_differs(8, 16)
        assert not sgmv_triton.one_token_variant_differs(1024, 16)

    def test_decode_rows_stream_their_weights(self):
        """Decode rows read each weight block once: their loads are marked first out of the
        caches; prefill rows, whose tiles share blocks, keep the default policy."""
        for one_token in (False, True):
            for max_rank in (16, sgmv_triton.WIDE_RANK):
                for tokens in (1, 8, 64, 128):
                    s = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(one_token, max_rank),
                                                 tokens, 4096, 3 * max_rank, max_rank, tokens,
                                                 64, False, 132)
                    e = sgmv_triton._expand_plan(sgmv_triton._expand_table(one_token, max_rank),
                                                 tokens, (0, 4096, 5120, 6144), max_rank, tokens,
                                                 64, False, 132)
                    assert s.constants["WEIGHT_EVICT"] == "evict_first"
                    assert e.constants["WEIGHT_EVICT"] == "evict_first"
        for tokens in (512, 2048):
            s = sgmv_triton._shrink_plan(sgmv_triton._shrink_table(False, 16), tokens, 4096, 48,
                                         16, 4, 64, False, 132)
            e = sgmv_triton._expand_plan(sgmv_triton._expand_table(False, 16), tokens,
                                         (0, 4096, 5120, 6144), 16, 4, 64, False, 132)
            assert s.constants["WEIGHT_EVICT"] == e.constants["WEIGHT_EVICT"] == ""

    def test_only_the_few_token_expand_row_settles_its_weights(self):
        """The one-token expand's blocks of B land before the wait up to 16 tokens in rank-16
        pools, under programmatic dependent launch only; every other row leaves them in flight."""
        offsets = (0, 4096, 5120, 6144)

        def settle(one_token, max_rank, tokens, pdl):
            return sgmv_triton._expand_plan(sgmv_triton._expand_table(one_token, max_rank),
                                            tokens, offsets, max_rank, tokens, 64, False, 132,
                                            pdl).constants["SETTLE"]

        for one_token in (False, True):
            for tokens in (1, 8, 16):
                assert settle(one_token, 16, tokens, True)
                assert not settle(one_token, 16, tokens, False)
                assert not settle(one_token, sgmv_triton.WIDE_RANK, tokens, True)
            for tokens in (64, 128, 2048):
                assert not settle(one_token, 16, tokens, True)

    def test_segments_of_several_tokens_pick_their_rows(self):
        """17-128 tokens not all in one-token segments: in rank-16 pools one-token tiles up to
        32 tokens and 16-token tiles with K split 512 past them; in pools of a wide max rank the
        split is 512 up to 32 tokens and 1024 past; one-token batches keep their own rows."""
        wide = sgmv_triton.WIDE_RANK
        assert pick(sgmv_triton._shrink_table(False, 16), 32).block_m == 1
        for tokens in (33, 128):
            row = pick(sgmv_triton._shrink_table(False, 16), tokens)
            assert (row.block_m, row.k_per_split) == (16, 512)
        for tokens, split in ((17, 512), (32, 512), (33, 1024), (128, 1024)):
            row = pick(sgmv_triton._shrink_table(False, wide), tokens)
            assert (row.block_m, row.k_per_split) == (16, split)
        for tokens in (17, 32, 128):
            assert pick(sgmv_triton._shrink_table(True, wide), tokens).live_items
            assert pick(sgmv_triton._shrink_table(True, 16), tokens).max_a_block == 32768

    def test_wide_rank_pools_pick_their_rows(self):
        wide = sgmv_triton.WIDE_RANK
        for table, wide_rows in (
            (sgmv_triton._shrink_table, sgmv_triton.SHRINK_WIDE_RANK_TABLE),
            (sgmv_triton._expand_table, sgmv_triton.EXPAND_WIDE_RANK_TABLE),
        ):
            # up to 16 tokens, for every batch in a pool of a wide max rank
            assert pick(table(False, wide), 8) == pick(wide_rows, 8) != pick(table(False, 16), 8)
            assert pick(table(False, 2 * wide), 16) == pick(wide_rows, 16)
            assert pick(table(True, wide), 8) != pick(table(True, 16), 8)
            # not below WIDE_RANK, not past the rows' bound
            assert pick(table(True, wide // 2), 8) == pick(table(True, 16), 8)
            assert pick(table(True, wide), 200) == pick(table(True, 16), 200)
        # the expand's row takes 16-token tiles (a segment of several tokens reads B once), but
        # one-token tiles where every segment is one token
        assert pick(sgmv_triton._expand_table(False, wide), 8).block_m == 16
        assert pick(sgmv_triton._expand_table(True, wide), 8).block_m == 1
        # the shrink's, alike for a single token; 2-16 one-token segments sum chunks in the expand
        assert pick(sgmv_triton._shrink_table(True, wide), 1) == pick(
            sgmv_triton._shrink_table(False, wide), 1)
        assert pick(sgmv_triton._shrink_table(True, wide), 8).expand_sums
        # 17-128 one-token tokens: the shrink's items only below each rank, in wide pools alone
        assert pick(sgmv_triton._shrink_table(True, wide), 64).live_items
        assert not pick(sgmv_triton._shrink_table(False, wide), 64).live_items
        assert not pick(sgmv_triton._shrink_table(True, 16), 64).live_items
        assert pick(sgmv_triton._expand_table(True, wide), 64) == pick(
            sgmv_triton._expand_table(True, 16), 64)
        # so a pool of a wide rank captures both graph variants, the shrink's alike to 16 tokens
        for tokens in (1, 8, 64):
            assert sgmv_triton.one_token_variant_differs(tokens, wide)
        assert not sgmv_triton.kernel_variant_differs("shrink", 1, wide)
        assert sgmv_triton.kernel_variant_differs("shrink", 8, wide)
        assert sgmv_triton.kernel_variant_differs("shrink", 64, wide)

    @pytest.mark.parametrize("batch_name", ["decode_distinct", "long_segments",
                                            "slot_in_two_segments"])
    def test_the_one_token_hint_never_changes_results(self, monkeypatch, batch_name):
        # Told wrongly that every segment is one token, the launch still computes every token.
        shrink, expand = small_tiles()
        one_shrink, one_expand = unsplit_tiles()
        monkeypatch.setattr(sgmv_triton, "SHRINK_TABLE", shrink)
        monkeypatch.setattr(sgmv_triton, "SHRINK_ONE_TOKEN_TABLE", one_shrink)
        monkeypatch.setattr(sgmv_triton, "EXPAND_TABLE", expand)
        monkeypatch.setattr(sgmv_triton, "EXPAND_ONE_TOKEN_TABLE", one_expand)
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, batch_name)
        assert batch.one_token_segments == (batch_name == "decode_distinct")  # from the host lists
        assert sgmv_triton.one_token_variant_differs(batch.num_tokens, 16)
        inside = segment_rows(batch, x.shape[0])
        h_ref = torch_shrink(x, a, batch, 3)
        y_ref = y.clone()
        torch_expand(h_ref, b, batch, y_ref, layout.out_offsets)
        for hint in (True, False):
            hinted = replace(batch, one_token_segments=hint)
            h = sgmv_triton.triton_shrink(x, a, hinted, 3)
            assert_close(h[inside], h_ref[inside])
            y_out = y.clone()
            sgmv_triton.triton_expand(h_ref, b, hinted, y_out, layout.out_offsets)
            assert_close(y_out, y_ref)

    @pytest.mark.parametrize("batch_name", ["decode_distinct", "long_segments"])
    def test_expand_reads_b_as_columns_of_a_wider_matrix(self, batch_name):
        # The slot pool keeps every group's B as a column range of one [R, width] matrix per
        # slot: rows further apart than the group's width.
        layout = LAYOUTS["qkv_gqa"]
        batch, a, b, x, y, _ = run_case(layout, batch_name)
        wide = torch.full((b.shape[0], b.shape[1], b.shape[2] + 40), float("nan"), device=DEVICE)
        view = wide[:, :, 24 : 24 + b.shape[2]]
        view.copy_(b)
        h = torch_shrink(x, a, batch, 3)
        y_ref = y.clone()
        torch_expand(h, b, batch, y_ref, layout.out_offsets)
        sgmv_triton.triton_expand(h, view, batch, y, layout.out_offsets)
        assert_close(y, y_ref)

    def test_rejects_mixed_dtypes(self):
        layout = LAYOUTS["single"]
        batch, a, b, x, y, _ = run_case(layout, "one_token")
        with pytest.raises(AssertionError):
            sgmv_triton.triton_shrink(x.double(), a, batch, 1)
        with pytest.raises(AssertionError):
            sgmv_triton.triton_expand(x[:, :16].half(), b, batch, y, layout.out_offsets)

    def test_rejects_strided_hidden_dimension(self):
        layout = LAYOUTS["single"]
        batch, a, _, x, _, _ = run_case(layout, "one_token")
        x_strided = torch.randn(x.shape[1], x.shape[0], device=DEVICE).t()
        with pytest.raises(AssertionError):
            sgmv_triton.triton_shrink(x_strided, a, batch, 1)

    def test_rejects_widths_that_do_not_add_up(self):
        layout = LAYOUTS["gate_up"]
        batch, a, b, x, y, _ = run_case(layout, "one_token")
        h = torch_shrink(x, a, batch, 2)
        with pytest.raises(AssertionError):
            sgmv_triton.triton_expand(h, b, batch, y, (0, 56, 100))


class TestTilingRows:
    @pytest.mark.parametrize("step", [8, 48, 0])
    def test_tile_steps_must_be_powers_of_two_from_16(self, step):
        with pytest.raises(ValueError, match="power of two"):
            ShrinkTiling(16, 32, 256, 1024, num_warps=4, num_stages=3, programs_per_sm=8,
                         tile_k=step)
        with pytest.raises(ValueError, match="power of two"):
            ExpandTiling(16, 512, 16, num_warps=4, num_stages=1, programs_per_sm=16,
                         tile_n=step)

    def test_narrow_rank_steps_only_for_matrix_vector_products(self):
        ExpandTiling(1, 64, 16, num_warps=1, num_stages=1, programs_per_sm=4,
                     narrow_rank_steps=True)
        with pytest.raises(ValueError, match="narrow_rank_steps"):
            ExpandTiling(16, 64, 16, num_warps=1, num_stages=1, programs_per_sm=4,
                         narrow_rank_steps=True)

    def test_live_items_only_for_one_token_tiles(self):
        with pytest.raises(ValueError, match="live_items"):
            ShrinkTiling(16, 32, 256, NO_SPLIT, num_warps=4, num_stages=1, programs_per_sm=4,
                         live_items=True)

    @pytest.mark.parametrize("change", [dict(block_m=16), dict(live_items=True),
                                        dict(k_per_split=48)])
    def test_expand_sums_takes_one_token_tiles_over_whole_chunks(self, change):
        row = dict(block_m=1, block_n=16, block_k=64, k_per_split=32, num_warps=4, num_stages=1,
                   programs_per_sm=4, expand_sums=True)
        ShrinkTiling(**row)
        with pytest.raises(ValueError, match="expand_sums"):
            ShrinkTiling(**{**row, **change})

    def test_spare_tiles_cannot_be_negative(self):
        with pytest.raises(ValueError, match="spare_tiles"):
            ShrinkTiling(1, 2, 4096, NO_SPLIT, num_warps=8, num_stages=1, programs_per_sm=8,
                         spare_tiles=-1)
        with pytest.raises(ValueError, match="spare_tiles"):
            ExpandTiling(1, 1024, 16, num_warps=4, num_stages=1, programs_per_sm=2,
                         spare_tiles=-1)

    @pytest.mark.parametrize("cap", [0, 15, 256])
    def test_register_caps_within_what_a_thread_holds(self, cap):
        ShrinkTiling(1, 2, 4096, NO_SPLIT, num_warps=8, num_stages=1, programs_per_sm=8,
                     max_registers=255)
        ExpandTiling(1, 1024, 16, num_warps=4, num_stages=1, programs_per_sm=2, max_registers=16)
        with pytest.raises(ValueError, match="max_registers"):
            ShrinkTiling(1, 2, 4096, NO_SPLIT, num_warps=8, num_stages=1, programs_per_sm=8,
                         max_registers=cap)
        with pytest.raises(ValueError, match="max_registers"):
            ExpandTiling(1, 1024, 16, num_warps=4, num_stages=1, programs_per_sm=2,
                         max_registers=cap)

    def test_whole_row_items_only_for_one_token_tiles(self):
        with pytest.raises(ValueError, match="max_a_block"):
            ShrinkTiling(16, 32, 256, NO_SPLIT, num_warps=4, num_stages=1, programs_per_sm=8,
                         max_a_block=4096)


class TestFloat32Caps:
    """Compiled float32 tiles are capped; other dtypes and the interpreter keep the table's."""

    @pytest.mark.parametrize("table", [SHRINK_TABLE, SHRINK_ONE_TOKEN_TABLE + SHRINK_TABLE,
                                       EXPAND_TABLE, EXPAND_ONE_TOKEN_TABLE + EXPAND_TABLE],
                             ids=["shrink", "shrink_one_token", "expand", "expand_one_token"])
    @pytest.mark.parametrize("num_tokens", [1, 16, 17, 200, 5000])
    def test_capped_fields_only(self, table, num_tokens):
        row = pick(table, num_tokens)
        capped = pick(table, num_tokens, float32=True)
        assert type(capped) is type(row)
        for name, value in asdict(row).items():
            if name in FLOAT32_CAPS:
                assert getattr(capped, name) == min(value, FLOAT32_CAPS[name])
                assert getattr(capped, name) <= FLOAT32_CAPS[name]
            else:
                assert getattr(capped, name) == value, name
        assert pick(table, num_tokens, float32=False) is row

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
    def test_pools_of_a_max_rank_below_16_step_their_own_rank(self, max_rank, seg_lens, layout):
        # (and, up to 8 tokens, take their own shrink rows: the down projection's items one row
        # of A each, over 16 warps)
        ranks = [0, max_rank, max(1, max_rank // 2), max_rank]
        self.check_against_float32(layout, ranks, max_rank, seg_lens, torch.bfloat16)

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
        h = sgmv_triton.triton_shrink(x, a, batch, len(layout.outs))
        h_ref = torch_shrink(x.float(), a.float(), batch, len(layout.outs))
        read = read_by_expand(batch, num_tokens, h.shape[1], max_rank).to(DEVICE)
        torch.testing.assert_close(h[read].float(), h_ref[read], atol=2e-2, rtol=2e-2)
        inside = segment_rows(batch, num_tokens)
        y_out, y_ref = y.clone(), y.float()
        sgmv_triton.triton_expand(h, b, batch, y_out, layout.out_offsets)
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
        first = sgmv_triton.triton_shrink(x, a, batch, 1)
        for _ in range(50):
            assert torch.equal(sgmv_triton.triton_shrink(x, a, batch, 1), first)

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
            get_backend("triton").apply(x, a, b, static, y, layout.out_offsets)

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
