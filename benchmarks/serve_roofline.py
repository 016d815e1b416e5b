"""The roofline of a serving workload: the least time the hardware needs for its requests, from
two ceilings measured in the same run.

    prefill_s = 2 * P * sum(prompt tokens) / GEMM rate
    decode_s  = (steps * W + sum over decode tokens of their context * K) / HBM bandwidth
    roofline_s = (prefill_s + decode_s) / replicas,  roofline tok/s = output tokens / roofline_s

P: the parameters of the model's matrix products (every layer's q/k/v/o/gate/up/down and the LM
head; the embedding is a lookup), W = P * dtype bytes (the weights one decode step reads),
K = 2 * layers * kv_heads * head_dim * dtype bytes (a token's keys and values). A request's first
output token comes from its prefill; each later one is a decode token whose context is its
prompt plus the tokens before it. Decode runs at full batch: steps = ceil(decode tokens /
max_num_seqs), each reading the weights once and every running request's KV cache once.
Attention's own FLOPs, LoRA deltas (rank 16: 0.4% of the base FLOPs) and activations are left
out, so the floor is a little low; replicas are taken as perfectly balanced.

The ceilings: a bf16 matrix product of the model's widest shape ([tokens, hidden] x [hidden,
intermediate]) timed with CUDA events, and a 1 GiB device-to-device copy counting read + write
(`benchmarks.common.hbm_bandwidth`). On CPU (`--smoke`) the same is timed with a host clock in
float32, to exercise the code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import hbm_bandwidth, time_cuda
from replicas.models.spec import ModelSpec

FORMULA = (
    "roofline_s = (2 * P * prompt tokens / GEMM rate + (decode steps * P * dtype bytes + KV bytes "
    "read) / HBM bandwidth) / replicas; decode steps = ceil(sum(outputs - 1) / max_num_seqs); KV "
    "bytes read = sum over decode tokens of context * 2 * layers * kv_heads * head_dim * dtype "
    "bytes; P = layer projections + LM head"
)


@dataclass(frozen=True)
class Ceilings:
    gemm_flops: float  # FLOP/s of a matrix product of the model's shapes
    hbm_bytes_s: float  # device memory bandwidth, read + write

    def to_json(self) -> dict:
        return {"gemm_tflops": self.gemm_flops / 1e12, "hbm_tb_s": self.hbm_bytes_s / 1e12}


def matmul_params(spec: ModelSpec) -> int:
    """Parameters of the matrix products one token goes through: the layers' projections and
    the LM head."""
    h, i = spec.hidden_size, spec.intermediate_size
    attention = h * spec.q_size + 2 * h * spec.kv_size + spec.q_size * h
    mlp = 3 * h * i
    return spec.num_layers * (attention + mlp) + spec.vocab_size * h


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int) -> int:
    return 2 * spec.num_layers * spec.kv_size * dtype_bytes


@dataclass(frozen=True)
class Roofline:
    prefill_s: float
    decode_s: float
    seconds: float  # (prefill + decode) / replicas
    output_tokens: int
    decode_steps: int
    params: int
    weight_bytes: int
    kv_bytes_read: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.inf

    def to_json(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s}


def roofline(
    spec: ModelSpec,
    prompts: Sequence[int],
    outputs: Sequence[int],
    ceilings: Ceilings,
    max_num_seqs: int,
    *,
    dtype_bytes: int = 2,
    replicas: int = 1,
) -> Roofline:
    """The floor for requests of `prompts[i]` prompt tokens and `outputs[i]` output tokens, as
    the module docstring states it."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompt lengths but {len(outputs)} output lengths")
    if max_num_seqs < 1 or replicas < 1:
        raise ValueError("max_num_seqs and replicas must be >= 1")
    params = matmul_params(spec)
    weight_bytes = params * dtype_bytes
    prefill_flops = 2 * params * sum(prompts)
    decode_tokens = sum(max(n - 1, 0) for n in outputs)
    # A request's decode token j (1..n-1) reads the context of its prompt and the j tokens
    # before it: sum over j of (p + j) = (n - 1) * p + n * (n - 1) / 2.
    pairs = zip(prompts, outputs, strict=True)
    context_tokens = sum((n - 1) * p + n * (n - 1) // 2 for p, n in pairs if n > 1)
    kv_read = context_tokens * kv_bytes_per_token(spec, dtype_bytes)
    steps = math.ceil(decode_tokens / max_num_seqs)
    prefill_s = prefill_flops / ceilings.gemm_flops
    decode_s = (steps * weight_bytes + kv_read) / ceilings.hbm_bytes_s
    return Roofline(
        prefill_s=prefill_s,
        decode_s=decode_s,
        seconds=(prefill_s + decode_s) / replicas,
        output_tokens=sum(outputs),
        decode_steps=steps,
        params=params,
        weight_bytes=weight_bytes,
        kv_bytes_read=kv_read,
    )


def measure_ceilings(spec: ModelSpec, device: str, tokens: int = 4096) -> Ceilings:
    """The GEMM rate on the model's widest product and the device's copy bandwidth. On CUDA in
    bf16 with events; on CPU in float32 on smaller sizes with a host clock."""
    if device == "cuda":
        a = torch.randn(tokens, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(spec.hidden_size, spec.intermediate_size, device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
        us = time_cuda(lambda: a @ b, iters=20, repeats=7)
        flops = 2 * tokens * spec.hidden_size * spec.intermediate_size / (us * 1e-6)
        del a, b
        bandwidth = hbm_bandwidth()
        torch.cuda.empty_cache()  # leave the memory to the engines that follow
        return Ceilings(gemm_flops=flops, hbm_bytes_s=bandwidth)
    rows = min(tokens, 256)
    a = torch.randn(rows, spec.hidden_size)
    b = torch.randn(spec.hidden_size, spec.intermediate_size)
    flops = 2 * rows * spec.hidden_size * spec.intermediate_size / _host_seconds(lambda: a @ b)
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / _host_seconds(lambda: dst.copy_(src))
    return Ceilings(gemm_flops=flops, hbm_bytes_s=bandwidth)


def _host_seconds(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]
