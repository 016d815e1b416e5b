"""SGMV launches that skip Triton's dispatch (`kernels.launch.CachedLaunch`): a repeated launch
reuses the compiled kernel and gives what the reference gives; an argument that Triton would
specialize differently (an unaligned tensor, another dtype) goes through Triton again."""

import pytest
import torch

from kernels.sgmv import SgmvBatch, torch_expand, torch_shrink
from tests.factories import sgmv_batch

pytestmark = pytest.mark.gpu

HIDDEN, RANK, OUTS = 256, 16, (256, 64, 64)


def make_batch(lens: list[int], device) -> SgmvBatch:
    slots = [i % 3 for i in range(len(lens))]
    return sgmv_batch(lens, slots, (16, 8, 4), (0.5, 2.0, 1.0), device)


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values at an address 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [5, 1, 19, 3]], ids=["decode", "mixed"])
def test_cached_launches_match_the_reference(lens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernels import sgmv_triton  # here: see tests/gpu/test_sgmv_pdl.py

    device = torch.device("cuda")
    sgmv = sgmv_triton.TritonSgmv()
    g = torch.Generator(device=device).manual_seed(0)
    batch = make_batch(lens, device)
    offsets = (0, OUTS[0], OUTS[0] + OUTS[1], sum(OUTS))
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(3, 3 * RANK, HIDDEN, device=device, generator=g).to(dtype) / 8
        b = torch.randn(3, RANK, sum(OUTS), device=device, generator=g).to(dtype) / 4
        x = torch.randn(batch.num_tokens, HIDDEN, device=device, generator=g).to(dtype)
        y0 = torch.randn(batch.num_tokens, sum(OUTS), device=device, generator=g).to(dtype)
        h_ref = torch_shrink(x.float(), a.float(), batch, 3)
        y_ref = y0.float().clone()
        torch_expand(h_ref, b.float(), batch, y_ref, offsets)
        before = (sgmv_triton._SHRINK.fast_launches, sgmv_triton._EXPAND.fast_launches)
        for x_in in (x, x, unaligned(x), unaligned(x), x):
            y = y0.clone()
            h = sgmv.shrink(x_in, a, batch, 3)
            sgmv.expand(h, b, batch, y, offsets)
            torch.testing.assert_close(y.float(), y_ref, atol=3e-2, rtol=3e-2)
        # five launches each: the first aligned and the first unaligned went through Triton
        assert sgmv_triton._SHRINK.fast_launches - before[0] == 3
        assert sgmv_triton._EXPAND.fast_launches - before[1] == 4  # h is always aligned
