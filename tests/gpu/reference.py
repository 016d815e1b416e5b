"""Transformers + PEFT as the reference for the engine's greedy tokens.

Float32 (`full_float32`: TF32 off, so cuBLAS rounds as the engine's float32 kernels do, which
run their dots in IEEE float32): the engine's greedy tokens must be the reference's greedy
tokens, every one (`reference_greedy`).

Bfloat16 (`bf16_agreement`): the engine in bf16 against the reference in float32 over the same
weights (the factories round every weight to a bf16 value), so the reference is the exact
computation and the gap is the engine's rounding alone; a step whose top two logits sit closer
than that rounding may go either way. The bound is measured, not assumed: one teacher-forced
pass of each side over prompt + our tokens gives both sides' logits at every position, and
`err` is their largest difference (0.04-0.06 for the 2-layer, 256-wide test model on CPU).
The engine's own steps run other kernels (decode attention, CUDA graphs, other SGMV tilings)
whose rounding differs from its prefill pass's, so each of its logits may stand BF16_MARGIN *
err from the reference's; a step is decided when the reference's top-1 logit leads its top-2
by more than twice that. Every decided step must pick the reference's token, and enough steps
must be decided for the check to mean something. Teacher forcing on our tokens means a flip at
an undecided step changes no later comparison. EOS is neither special nor masked, as under
`ignore_eos`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# How far the engine's decode-path logits may sit from the reference's, in units of the error
# measured between its prefill-path logits and the reference's (see the module docstring).
BF16_MARGIN = 1.5


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for matmuls and convolutions while inside: float32 products round as float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_model(model_dir, adapter_dir=None, dtype: torch.dtype = torch.bfloat16, device="cuda"):
    """transformers (eager attention: plain softmax(QK^T)V) with the PEFT adapter when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    model = model.to(device).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return model


@torch.no_grad()
def teacher_forced_logits(model, tokens: list[int]) -> torch.Tensor:
    """One forward pass over `tokens`: the logits at every position, [len(tokens), vocab] fp32."""
    device = next(model.parameters()).device
    return model(torch.tensor([tokens], device=device)).logits[0].float()


@torch.no_grad()
def reference_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` greedy tokens after `prompt`, each the argmax of a full forward pass."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(teacher_forced_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


@dataclass(frozen=True)
class Bf16Agreement:
    """One request's bf16 comparison: `err` the measured logit error, `decided` the steps whose
    reference lead exceeds 2 * BF16_MARGIN * err, `wrong` those of them where we picked another
    token than the reference (step, ours, the reference's, its lead)."""

    err: float
    steps: int
    decided: int
    wrong: tuple[tuple[int, int, int, float], ...]


def bf16_agreement(
    ref_logits: torch.Tensor, our_logits: torch.Tensor, num_prompt: int, ours: list[int]
) -> Bf16Agreement:
    """Compare our greedy tokens with the reference at its decided steps. `ref_logits` and
    `our_logits`: both sides' teacher-forced logits over prompt + ours, [num_prompt +
    len(ours), vocab] (the last row predicts nothing and is used only to measure the error)."""
    assert ref_logits.shape == our_logits.shape == (num_prompt + len(ours), ref_logits.shape[1])
    err = (our_logits.float() - ref_logits.float()).abs().max().item()
    steps = ref_logits[num_prompt - 1 : -1].float()
    top = steps.topk(2, dim=-1)
    leads = (top.values[:, 0] - top.values[:, 1]).tolist()
    best = top.indices[:, 0].tolist()
    bound = 2 * BF16_MARGIN * err
    decided = [i for i, lead in enumerate(leads) if lead > bound]
    wrong = tuple((i, ours[i], best[i], leads[i]) for i in decided if ours[i] != best[i])
    return Bf16Agreement(err, len(ours), len(decided), wrong)


def assert_bf16_greedy_agrees(
    agreements: dict[object, Bf16Agreement], min_decided: float = 0.2
) -> None:
    """Every decided step of every request picked the reference's token, and the comparison is
    not empty: at least `min_decided` of all steps were decided (a broken kernel inflates the
    measured error until nothing is decided)."""
    wrong = {label: a.wrong for label, a in agreements.items() if a.wrong}
    assert not wrong, f"decided steps where we left the reference: {wrong}"
    steps = sum(a.steps for a in agreements.values())
    decided = sum(a.decided for a in agreements.values())
    errs = {label: round(a.err, 4) for label, a in agreements.items()}
    assert decided >= min_decided * steps, f"{decided} of {steps} steps decided; errors {errs}"


def engine_logits(engine, adapter: str | None, tokens: list[int]) -> torch.Tensor:
    """The engine's logits over `tokens` in one eager prefill pass (KV blocks 0..n: call it on
    an idle engine), with `adapter`'s slot, or the base model for None; [len(tokens), vocab]."""
    from tests.replicas.conftest import adapter_logits, forward_logits

    if adapter is None:
        return forward_logits(engine, [tokens])
    engine.preload_adapter(adapter, into_slot=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a copy the preload started has landed
    return adapter_logits(engine, adapter, tokens)
