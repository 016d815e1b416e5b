"""Transformers + PEFT on the GPU as the reference for the engine's greedy tokens.

The comparison is teacher-forced on the engine's own tokens: one forward pass of the reference
over prompt + ours gives, at every step, how far our token's logit sits below the best one. In
float32 that gap must be 0 everywhere (our tokens are the reference's greedy tokens). In bf16 the
two sides round differently (our fused kernels round once where transformers rounds after every
op), so a gap within BF16_TIE is a tie either side of which is correct; small random models have
such near-ties often. EOS is neither special nor masked, as under `ignore_eos`.
"""

import torch

# Two bf16 logits closer than this are a tie.
BF16_TIE = 0.05


def hf_model(model_dir, adapter_dir=None, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return model


@torch.no_grad()
def greedy_gaps(model, prompt: list[int], ours: list[int]) -> list[float]:
    """Per generated token: the reference's best logit minus the logit of our token."""
    logits = model(torch.tensor([prompt + ours]).cuda()).logits[0].float()
    steps = logits[len(prompt) - 1 : -1]
    best = steps.max(dim=-1).values
    chosen = steps[torch.arange(len(ours)), torch.tensor(ours).cuda()]
    return (best - chosen).tolist()


def assert_greedy_agrees(model, prompt: list[int], ours: list[int], label) -> None:
    """bf16: every step within a tie of the reference's choice and most steps its choice."""
    gaps = greedy_gaps(model, prompt, ours)
    assert max(gaps) <= BF16_TIE, (label, gaps)
    assert sum(g == 0.0 for g in gaps) >= len(ours) - 2, (label, gaps)
