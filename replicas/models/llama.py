"""A compact Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache,
with batched multi-adapter LoRA on every projection.

The forward pass takes one flat batch of tokens from many sequences (prefill chunks and decodes
mixed); `StepContext` says where each sequence's tokens are, where its KV lives and which adapter
slot each token uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionBatch, AttentionFn, store_kv, torch_paged_attention
from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps, torch_rms_norm
from kernels.sgmv import SgmvBatch
from replicas.lora import LoraWeightPool
from replicas.models.rope import RotaryEmbedding
from replicas.models.spec import ModelSpec


@dataclass(frozen=True)
class StepContext:
    attn: AttentionBatch
    lora: SgmvBatch
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    lora_pool: LoraWeightPool | None
    attention: AttentionFn = torch_paged_attention
    # Per layer, adapter-load events (on the load stream) to wait on before that layer runs.
    layer_waits: list[list[torch.cuda.Event]] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_rms_norm(x, self.weight, self.eps)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index
        self.spec = spec
        h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
        eps, i = spec.rms_norm_eps, spec.intermediate_size
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.qkv_proj = _weight(q + 2 * kv, h, dtype=dtype)
        self.qkv_bias = _weight(q + 2 * kv, dtype=dtype) if spec.attention_bias else None
        self.o_proj = _weight(h, q, dtype=dtype)
        self.gate_up_proj = _weight(2 * i, h, dtype=dtype)
        self.down_proj = _weight(h, i, dtype=dtype)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, eps, dtype)
            self.k_norm = RMSNorm(spec.head_dim, eps, dtype)
        self.scale = spec.head_dim**-0.5

    def _project(self, x, weight, group, ctx: StepContext, bias=None) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        if ctx.lora_pool is not None:
            ctx.lora_pool.apply(self.index, group, x, y, ctx.lora)
        return y

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        ctx: StepContext,
        ops: LayerOps,
    ) -> torch.Tensor:
        spec = self.spec
        T = x.shape[0]
        if ctx.layer_waits is not None:  # device-side waits: this layer's adapter weights landed
            stream = torch.cuda.current_stream(x.device)
            for event in ctx.layer_waits[self.index]:
                stream.wait_event(event)
        h = ops.rms_norm(x, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = self._project(h, self.qkv_proj, "qkv", ctx, self.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.reshape(T, spec.num_heads, spec.head_dim)
        k = k.reshape(T, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(T, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, positions, rope.cos, rope.sin)
        k_cache, v_cache = ctx.kv_caches[self.index]
        store_kv(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        attn = ctx.attention(q, k_cache, v_cache, ctx.attn, self.scale)
        o = self._project(attn.reshape(T, spec.q_size), self.o_proj, "o", ctx)
        norm = self.post_attention_layernorm
        h, x = ops.add_rms_norm(x, o, norm.weight, norm.eps)
        act = ops.silu_and_mul(self._project(h, self.gate_up_proj, "gate_up", ctx))
        return x + self._project(act, self.down_proj, "down", ctx)


class LlamaModel(nn.Module):
    """`ops` does the elementwise work between the matrix products (kernels/layer_ops.py)."""

    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        dtype: torch.dtype,
        ops: LayerOps = TORCH_LAYER_OPS,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.ops = ops
        v, h = spec.vocab_size, spec.hidden_size
        self.embed_tokens = _weight(v, h, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps, dtype)
        self.lm_head = None if spec.tie_word_embeddings else _weight(v, h, dtype=dtype)
        self.rope = RotaryEmbedding(spec.rope, spec.head_dim, max_positions)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, ctx, self.ops)
        return self.final_norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.norm.weight, self.norm.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()
