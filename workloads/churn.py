"""The request stream of the single-engine churn benchmark (`benchmarks/bench_churn.py`).

Its own seeded law, older than `requests.py`'s and kept so its recorded results stay comparable:
one `random.Random(seed)` draws, request by request, the Poisson gap, the prompt and the output
length; adapters are drawn up front.
"""

from __future__ import annotations

import random

SKEWED_RATIO = 0.7  # `skewed`: each adapter this many times as popular as the one before it


def churn_popularity(kind: str, n: int, count: int, rng: random.Random) -> list[int]:
    """Indices into `n` adapters for `count` requests: `distinct` round robin, `uniform`, or
    `skewed` (geometric over the adapters' order)."""
    if kind == "distinct":
        return [i % n for i in range(count)]
    if kind == "uniform":
        return [rng.randrange(n) for _ in range(count)]
    if kind == "skewed":
        weights = [SKEWED_RATIO**i for i in range(n)]
        return rng.choices(range(n), weights=weights, k=count)
    raise ValueError(kind)


def churn_requests(
    names: list[str],
    kind: str,
    *,
    num_requests: int,
    rate: float,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[tuple[float, str, list[int], int]]:
    """(send time in s, adapter, prompt token ids, max tokens) per request, in time order.
    Prompt ids are drawn from [2, vocab_size)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    picks = churn_popularity(kind, len(names), num_requests, rng)
    for i in range(num_requests):
        t += rng.expovariate(rate)
        n_in = rng.randint(*input_len)
        prompt = [rng.randrange(2, vocab_size) for _ in range(n_in)]
        out.append((t, names[picks[i]], prompt, rng.randint(*output_len)))
    return out
