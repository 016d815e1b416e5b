"""Triton layer ops (RMSNorm, add + RMSNorm, SiLU-and-mul, rotary) against the torch reference.

Without a GPU the kernels run in Triton's interpreter; with one, compiled, in bfloat16 too.
Inputs are fresh random values and outputs are poisoned first, so an unwritten element shows.
"""

import os

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from kernels import layer_ops_triton as tri  # noqa: E402
from kernels.layer_ops import (  # noqa: E402
    get_layer_ops,
    torch_add_rms_norm,
    torch_rms_norm,
    torch_rotary,
    torch_silu_and_mul,
)

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rand(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def close(got, want, dtype):
    assert not got.isnan().any()
    err = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
    assert err < TOL[dtype], err.item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 16), (5, 96), (3, 100), (17, 256)])
def test_rms_norm(rows, dim, dtype):
    x, w = rand(rows, dim, dtype=dtype), rand(dim, dtype=dtype)
    close(tri.triton_rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 16), (7, 100), (16, 128)])
def test_add_rms_norm_returns_the_norm_and_the_sum(rows, dim, dtype):
    x, delta, w = rand(rows, dim, dtype=dtype), rand(rows, dim, dtype=dtype), rand(dim, dtype=dtype)
    before = x.clone()
    out, total = tri.triton_add_rms_norm(x, delta, w, 1e-6)
    want_out, want_total = torch_add_rms_norm(x, delta, w, 1e-6)
    close(out, want_out, dtype)
    close(total, want_total, dtype)
    assert torch.equal(x, before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 8), (4, 100), (3, 1500)])
def test_silu_and_mul(rows, inter, dtype):
    gate_up = rand(rows, 2 * inter, dtype=dtype) * 3
    close(tri.triton_silu_and_mul(gate_up), torch_silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 2, 1, 8), (5, 4, 2, 16), (9, 6, 2, 24)])
def test_rotary_in_place_on_views_of_a_fused_buffer(tokens, hq, hk, dim, dtype):
    qkv = rand(tokens, (hq + 2 * hk) * dim, dtype=dtype)
    q = qkv[:, : hq * dim].reshape(tokens, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].reshape(tokens, hk, dim)
    v_before = qkv[:, (hq + hk) * dim :].clone()
    positions = torch.randint(0, 50, (tokens,), device=DEVICE)
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(dim // 2) + 0.01)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    want_q, want_k = torch_rotary(q.clone(), k.clone(), positions, cos, sin)
    got_q, got_k = tri.triton_rotary(q, k, positions, cos, sin)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)
    assert torch.equal(qkv[:, (hq + hk) * dim :], v_before)  # v untouched


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 32, device=DEVICE)
    assert tri.triton_rms_norm(x, torch.ones(32, device=DEVICE), 1e-5).shape == (0, 32)
    assert tri.triton_silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


def test_registry_serves_both_backends():
    assert get_layer_ops("triton").rms_norm is tri.triton_rms_norm
    assert get_layer_ops("torch").rms_norm is torch_rms_norm
    with pytest.raises(ValueError, match="unknown layer-ops backend"):
        get_layer_ops("cuda")
