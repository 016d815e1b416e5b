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
        to_device=None,
    ) -> torch.Tensor:
        """logits: [N, V] float32 -> token ids [N] int64 on the device. `to_device(values,
        dtype)` moves per-row parameters to the device without a blocking copy."""
        if to_device is None:
            to_device = lambda values, dtype: torch.tensor(values, dtype=dtype).to(self.device)
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy
        # Greedy rows get temperature 1 here and are taken from `greedy` at the end.
        temps = to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        probs = _truncate(probs, params, to_device)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:  # a seeded request draws from its own generator
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = to_device([p.greedy for p in params], torch.bool)
        return torch.where(is_greedy, greedy, sampled)


def _truncate(probs: torch.Tensor, params: list[SamplingParams], to_device) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p nucleus."""
    if all(p.top_k is None and p.top_p >= 1.0 for p in params):
        return probs
    vocab = probs.shape[1]
    ks = to_device([min(p.top_k or vocab, vocab) for p in params], torch.int64)
    ps = to_device([p.top_p for p in params], torch.float32)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
    keep_sorted = (rank < ks.unsqueeze(1)) & (before < ps.unsqueeze(1))
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * keep
