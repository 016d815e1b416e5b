"""Triton paged attention against the torch reference.

Without a GPU the kernels run in Triton's interpreter (float32, tiny sizes); with one, the same
sweeps run compiled on the GPU, and the `gpu` tests add bf16 at Llama-3-8B head shapes and a
CUDA-graph replay of the decode kernel over changed metadata.
"""

import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from kernels import attention_triton  # noqa: E402
from kernels.attention import (  # noqa: E402
    AttentionBatch,
    get_attention_backend,
    torch_paged_attention,
)
from kernels.attention_triton import (  # noqa: E402
    DECODE_TILING,
    DecodeTiling,
    paged_decode_attention,
    paged_prefill_attention,
    triton_paged_attention,
)

HEAD_DIM = 32


def split_tiling(programs_per_sm: int) -> DecodeTiling:
    """Short contexts span several tiles, and the batch is cut into short pieces, so one launch
    has sequences read by one program (written directly) and sequences merged from several."""
    return DecodeTiling(block_n=16, programs_per_sm=programs_per_sm, min_split_tokens=16)


SPLITTING = split_tiling(64)


def make_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: int | None = None,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
    num_blocks: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch]:
    """seqs: (new tokens, context length) per sequence -> q [T, Hq, D], k/v caches and the batch.

    Blocks are handed out in a shuffled order, tables are wider than needed (zero-padded), and
    the cache holds spare blocks of noise that no sequence owns."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = num_blocks or sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(seqs), width or max(per_seq) + 2, dtype=torch.int32)
    tables, used = [], 0
    for i, n in enumerate(per_seq):
        tables.append(order[used : used + n])
        table[i, :n] = torch.tensor(tables[-1], dtype=torch.int32)
        used += n
    q_starts, slots = [0], []
    for (new, ctx), blocks in zip(seqs, tables, strict=True):
        q_starts.append(q_starts[-1] + new)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(ctx - new, ctx)]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(DEVICE, dtype)
    q = torch.randn(q_starts[-1], num_heads, head_dim, generator=g).to(DEVICE, dtype)
    ctx_lens = [ctx for _, ctx in seqs]
    batch = AttentionBatch(
        q_starts=q_starts,
        ctx_lens=ctx_lens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_table=table.to(DEVICE),
        ctx_lens_t=torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        q_starts_t=torch.tensor(q_starts, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        sliding_window=window,
    )
    return q, k_cache, v_cache, batch


def reference(q, k_cache, v_cache, batch) -> torch.Tensor:
    """torch_paged_attention in float32 (upcasting 16-bit inputs)."""
    return torch_paged_attention(
        q.float(), k_cache.float(), v_cache.float(), batch, q.shape[-1] ** -0.5
    )


def decode(q, k_cache, v_cache, batch, **kw) -> torch.Tensor:
    return paged_decode_attention(
        q, k_cache, v_cache, batch.block_table, batch.ctx_lens_t, q.shape[-1] ** -0.5,
        batch.sliding_window, **kw,
    )


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-4)


def decode_seqs(*ctx_lens: int) -> list[tuple[int, int]]:
    return [(1, ctx) for ctx in ctx_lens]


class TestDecodeMatchesReference:
    @pytest.mark.parametrize("block_size", [4, 16])
    @pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
    def test_gqa_ratios_and_block_sizes(self, num_heads, num_kv_heads, block_size):
        case = make_case(decode_seqs(1, 7, 33, 70), num_heads, num_kv_heads, block_size)
        assert_matches(decode(*case), reference(*case))

    def test_single_sequence(self):
        case = make_case(decode_seqs(50), 4, 1, 4)
        assert_matches(decode(*case), reference(*case))

    @pytest.mark.parametrize("head_dim", [64, 128])
    def test_wider_heads(self, head_dim):
        case = make_case(decode_seqs(2, 23), 4, 2, 16, head_dim=head_dim)
        assert_matches(decode(*case, tiling=SPLITTING), reference(*case))

    def test_group_that_is_not_a_power_of_two(self):
        case = make_case(decode_seqs(3, 21), 6, 2, 4)
        assert_matches(decode(*case), reference(*case))

    @pytest.mark.parametrize("programs_per_sm", [1, 8, 64])
    def test_split_k_merges_to_the_same_result(self, programs_per_sm):
        case = make_case(decode_seqs(1, 9, 40, 130), 4, 2, 4)
        tiling = split_tiling(programs_per_sm)
        out = decode(*case, tiling=tiling)
        assert_matches(out, reference(*case))
        assert torch.equal(out, decode(*case, tiling=tiling)), "the merge must be deterministic"

    @pytest.mark.parametrize("seed", range(4))
    def test_random_lengths_with_stragglers(self, seed):
        g = torch.Generator().manual_seed(seed)
        ctx_lens = torch.randint(1, 24, (6,), generator=g).tolist()
        ctx_lens[seed] = 150  # one sequence far longer than the rest
        case = make_case(decode_seqs(*ctx_lens), 4, 2, 4, seed=seed)
        tiling = split_tiling(programs_per_sm=[8, 16, 32, 64][seed])
        assert_matches(decode(*case, tiling=tiling), reference(*case))

    @pytest.mark.parametrize("window,tiling", [(8, DECODE_TILING), (24, SPLITTING)])
    def test_sliding_window(self, window, tiling):
        case = make_case(decode_seqs(1, 8, 30, 45), 4, 2, 4, window=window)
        assert_matches(decode(*case, tiling=tiling), reference(*case))

    def test_strided_query(self):
        q, k_cache, v_cache, batch = make_case(decode_seqs(5, 18), 4, 2, 4)
        wide = torch.zeros(q.shape[0], q.shape[1], 2 * HEAD_DIM, device=DEVICE)
        wide[..., :HEAD_DIM] = q
        strided = wide[..., :HEAD_DIM]
        assert not strided.is_contiguous()
        out = decode(strided, k_cache, v_cache, batch)
        assert_matches(out, reference(q, k_cache, v_cache, batch))

    @pytest.mark.parametrize("tiling", [DECODE_TILING, SPLITTING])
    def test_padding_rows_exit_without_writing(self, tiling):
        q, k_cache, v_cache, batch = make_case(decode_seqs(10, 25), 4, 2, 4)
        # Interleave padding rows: context 0 and a table row of block ids past the cache, which
        # the kernel must never dereference.
        rows = [None, 0, None, 1]
        pad_q = torch.randn(4, 4, HEAD_DIM, device=DEVICE)
        table = torch.full((4, batch.block_table.shape[1]), 10**6, dtype=torch.int32, device=DEVICE)
        ctx_lens = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        for i, src in enumerate(rows):
            if src is not None:
                pad_q[i] = q[src]
                table[i] = batch.block_table[src]
                ctx_lens[i] = batch.ctx_lens_t[src]
        out = torch.full_like(pad_q, 7.0)
        paged_decode_attention(pad_q, k_cache, v_cache, table, ctx_lens, HEAD_DIM**-0.5,
                               out=out, tiling=tiling)
        assert torch.all(out[[0, 2]] == 7.0), "padding rows must be left unwritten"
        assert_matches(out[[1, 3]], reference(q, k_cache, v_cache, batch))


class TestPrefillMatchesReference:
    @pytest.mark.parametrize("block_size", [4, 16])
    @pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
    def test_no_prefix(self, num_heads, num_kv_heads, block_size):
        case = make_case([(7, 7), (20, 20), (1, 1)], num_heads, num_kv_heads, block_size)
        assert_matches(paged_prefill_attention(*case, HEAD_DIM**-0.5), reference(*case))

    def test_cached_prefix(self):
        case = make_case([(5, 20), (3, 9), (12, 40)], 4, 2, 4)
        assert_matches(paged_prefill_attention(*case, HEAD_DIM**-0.5), reference(*case))

    def test_chunks_spanning_several_query_tiles(self):
        case = make_case([(70, 90), (33, 33)], 4, 2, 16)  # 32 tokens per tile at 2 heads/KV head
        assert_matches(paged_prefill_attention(*case, HEAD_DIM**-0.5), reference(*case))

    @pytest.mark.parametrize("head_dim", [64, 128])
    def test_wider_heads(self, head_dim):
        case = make_case([(4, 10), (9, 9)], 4, 2, 16, head_dim=head_dim)
        assert_matches(paged_prefill_attention(*case, head_dim**-0.5), reference(*case))

    def test_mixed_chunks_with_decode_rows(self):
        case = make_case([(1, 13), (6, 6), (1, 1), (10, 30), (1, 40)], 6, 2, 4)
        assert_matches(paged_prefill_attention(*case, HEAD_DIM**-0.5), reference(*case))

    def test_sliding_window(self):
        case = make_case([(9, 20), (1, 13), (5, 5)], 4, 2, 16, window=6)
        assert_matches(paged_prefill_attention(*case, HEAD_DIM**-0.5), reference(*case))


class TestDispatch:
    def test_one_token_per_sequence_runs_the_decode_kernel(self, monkeypatch):
        case = make_case(decode_seqs(4, 19), 4, 2, 4)
        monkeypatch.setattr(attention_triton, "paged_prefill_attention", _not_expected)
        assert_matches(triton_paged_attention(*case, HEAD_DIM**-0.5), reference(*case))

    def test_longer_chunks_run_the_prefill_kernel(self, monkeypatch):
        case = make_case([(1, 6), (3, 11)], 4, 2, 4)
        monkeypatch.setattr(attention_triton, "paged_decode_attention", _not_expected)
        assert_matches(triton_paged_attention(*case, HEAD_DIM**-0.5), reference(*case))

    def test_registered_as_the_triton_backend(self):
        assert get_attention_backend("triton") is triton_paged_attention


def _not_expected(*args, **kwargs):
    raise AssertionError("dispatched to the wrong kernel")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
class TestOnGpu:
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_16_bit_at_llama3_8b_head_shapes(self, dtype):
        decode_case = make_case(decode_seqs(1, 100, 1000, 3000), 32, 8, 16, head_dim=128,
                                dtype=dtype)
        prefill_case = make_case([(1, 500), (64, 64), (200, 1200)], 32, 8, 16, head_dim=128,
                                 dtype=dtype)
        for case in (decode_case, prefill_case):
            out = triton_paged_attention(*case, 128**-0.5)
            assert out.dtype == dtype
            assert relative_error(out, reference(*case)) < 1e-2

    def test_decode_replays_in_a_cuda_graph_over_new_metadata(self):
        shape = dict(num_heads=32, num_kv_heads=8, block_size=16, head_dim=128,
                     dtype=torch.bfloat16, width=128, num_blocks=300)
        q, k_cache, v_cache, first = make_case(decode_seqs(1, 300, 17, 2000), **shape)
        table = first.block_table.clone()
        ctx_lens = first.ctx_lens_t.clone()
        out = torch.empty_like(q)
        call = lambda: paged_decode_attention(q, k_cache, v_cache, table, ctx_lens, 128**-0.5,
                                              out=out)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()

        # New lengths (one row becomes padding) and a reshuffled table, written in place.
        *_, second = make_case(decode_seqs(1500, 1, 64, 999), **shape, seed=1)
        table.copy_(second.block_table)
        ctx_lens.copy_(second.ctx_lens_t)
        ctx_lens[2] = 0
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q, k_cache, v_cache, second)
        live = [0, 1, 3]
        assert relative_error(out[live], ref[live]) < 1e-2
        assert torch.all(out[2] == 7.0)
