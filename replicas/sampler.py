"""Token sampling for a batch of sequences with per-sequence parameters.

Greedy rows take the argmax. Other rows are scaled by temperature, truncated by top-k and top-p,
and sampled with the exponential-race trick (argmax of p / E with E ~ Exp(1)), which needs no
host sync. A request with a seed owns a generator, so its tokens do not depend on what else
shares the batch.
"""

from __future__ import annotations

import torch

from replicas.request import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """logits: [N, V] float32 -> token ids [N] int64 on the device."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype)
        probs = torch.softmax(sub / temps.to(sub.device).unsqueeze(1), dim=-1)
        probs = _truncate(probs, [params[i] for i in rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=generators[i] or self.generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus."""
    if all(p.top_k is None and p.top_p >= 1.0 for p in params):
        return probs
    vocab = probs.shape[1]
    ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=probs.device)
    ps = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    keep_sorted = (rank < ks.unsqueeze(1)) & (before < ps.unsqueeze(1))
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * keep
