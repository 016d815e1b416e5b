"""The requests of a run: which model each names, its prompt and how many tokens it asks for.

The workload depends only on `WorkloadConfig` (seed included), never on the arrival rate or the
server, so two runs against two servers, or the points of a rate sweep, send the same requests.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from workloads.popularity import check_popularity, pick_adapters

PromptKind = Literal["tokens", "text"]

# Short common words: most are a single token in BPE vocabularies, so `input_len` words make
# roughly `input_len` prompt tokens (the server's `usage.prompt_tokens` gives the exact count).
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "has had one new first not but after also have they her who their been its time two more "
    "year other can all some when over most into them only used about may these three many "
    "such made where city through during under part world state while well both then work "
    "school water name war north south east west early small large light river house music"
).split()


def rng_for(seed: int, stream: str) -> np.random.Generator:
    """A generator for one aspect of the run (`"lengths"`, `"arrivals"`, ...): seeded by
    `seed` and independent of the other aspects, so changing one knob leaves the rest alone."""
    return np.random.default_rng([seed, zlib.crc32(stream.encode())])


@dataclass(frozen=True)
class LengthRange:
    """Token counts drawn uniformly from `low` to `high`, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """`"200:1000"` or `"512"` (a fixed length)."""
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as e:
            raise ValueError(f"bad length range {text!r} (want N or LOW:HIGH): {e}") from None

    def draw(self, count: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=count)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadConfig:
    num_prompts: int
    input_len: LengthRange
    output_len: LengthRange
    adapters: tuple[str, ...] = ()  # ranked by popularity under `skewed` and `zipf`
    base_model: str | None = None  # the name that selects the base model
    popularity: str = "uniform"
    alpha: float = 0.7  # `skewed`: each adapter is alpha times as popular as the previous one
    zipf_s: float = 1.0  # `zipf`: the exponent
    base_fraction: float = 0.0  # share of requests for the base model (all of them if no adapters)
    prompt_kind: PromptKind = "tokens"
    vocab_size: int = 256  # token-id prompts draw from [0, vocab_size)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        check_popularity(self.popularity, alpha=self.alpha, zipf_s=self.zipf_s)
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be in [0, 1], got {self.base_fraction}")
        if self.needs_base_model and not self.base_model:
            raise ValueError("base-model requests need the base model's name")
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("adapter names must be distinct")
        if self.prompt_kind not in ("tokens", "text"):
            raise ValueError(f"prompt_kind must be 'tokens' or 'text', got {self.prompt_kind!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def needs_base_model(self) -> bool:
        return not self.adapters or self.base_fraction > 0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "adapters": list(self.adapters),
            "input_len": str(self.input_len),
            "output_len": str(self.output_len),
        }


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt` is token ids or text of `input_len` words; `output_len` is
    sent as `max_tokens`."""

    index: int
    model: str
    is_base: bool
    prompt: tuple[int, ...] | str
    input_len: int
    output_len: int


def build_workload(config: WorkloadConfig) -> list[RequestSpec]:
    n = config.num_prompts
    is_base = rng_for(config.seed, "base").random(n) < config.base_fraction
    if not config.adapters:
        is_base[:] = True
    picks = iter(
        pick_adapters(
            config.popularity,
            max(len(config.adapters), 1),
            int((~is_base).sum()),
            rng_for(config.seed, "adapters"),
            alpha=config.alpha,
            zipf_s=config.zipf_s,
        )
    )
    input_lens = config.input_len.draw(n, rng_for(config.seed, "input_len"))
    output_lens = config.output_len.draw(n, rng_for(config.seed, "output_len"))
    prompt_rng = rng_for(config.seed, "prompts")
    specs = []
    for i in range(n):
        model = config.base_model if is_base[i] else config.adapters[next(picks)]
        specs.append(
            RequestSpec(
                index=i,
                model=model,
                is_base=bool(is_base[i]),
                prompt=_prompt(config, int(input_lens[i]), prompt_rng),
                input_len=int(input_lens[i]),
                output_len=int(output_lens[i]),
            )
        )
    return specs


def _prompt(config: WorkloadConfig, length: int, rng: np.random.Generator) -> tuple[int, ...] | str:
    if config.prompt_kind == "tokens":
        return tuple(rng.integers(0, config.vocab_size, size=length).tolist())
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=length))


def workload_digest(specs: list[RequestSpec]) -> str:
    """A SHA-256 over every request's model, prompt and lengths: equal digests mean two runs sent
    the same workload."""
    h = hashlib.sha256()
    for s in specs:
        prompt = list(s.prompt) if isinstance(s.prompt, tuple) else s.prompt
        h.update(json.dumps([s.model, prompt, s.input_len, s.output_len]).encode())
    return h.hexdigest()
