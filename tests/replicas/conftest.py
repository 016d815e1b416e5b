import time

import pytest
import torch

from kernels.attention import AttentionBatch
from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.models.llama import StepContext
from replicas.request import Request, SamplingParams


def make_engine(model_dir, **overrides) -> Engine:
    args = {"model": str(model_dir), "num_kv_blocks": 128, "block_size": 4, "max_lora_rank": 16}
    args.update(overrides)
    return Engine(EngineConfig(**args))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_completion(engine: Engine, requests: list[Request], timeout_s: float = 300.0):
    """Add all requests, step until idle; returns request_id -> (tokens, finish_reason)."""
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str | None] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_work and time.monotonic() < deadline:
        outputs = engine.step()
        if engine.stalled:
            time.sleep(0.001)  # only adapter reads are in flight
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not engine.has_work, "engine did not drain"
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def forward_logits(engine: Engine, chunks: list[list[int]]) -> torch.Tensor:
    """Feed one sequence to the model chunk by chunk through the paged KV cache (block ids
    0..n) and return the logits of every token of every chunk, [T, vocab]."""
    runner = engine.runner
    bs = engine.config.block_size
    total = sum(len(c) for c in chunks)
    table = list(range(-(-total // bs)))
    dev = runner.device
    out, start = [], 0
    for chunk in chunks:
        end = start + len(chunk)
        attn = AttentionBatch(
            q_starts=[0, len(chunk)],
            ctx_lens=[end],
            slot_mapping=torch.tensor(
                [table[p // bs] * bs + p % bs for p in range(start, end)], device=dev
            ),
            block_table=torch.tensor([table], dtype=torch.int32, device=dev),
            ctx_lens_t=torch.tensor([end], dtype=torch.int32, device=dev),
            q_starts_t=torch.tensor([0, len(chunk)], dtype=torch.int32, device=dev),
            block_size=bs,
            sliding_window=engine.spec.sliding_window,
        )
        ctx = StepContext(
            attn,
            runner.lora_pool.make_batch([], [], len(chunk)),
            runner.kv_caches,
            runner.lora_pool,
        )
        with torch.inference_mode():
            hidden = runner.model(
                torch.tensor(chunk, device=dev), torch.arange(start, end, device=dev), ctx
            )
            out.append(runner.model.logits(hidden))
        start = end
    return torch.cat(out)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """One small model per supported architecture, built once per test session."""
    from tests.factories import make_model

    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(root / "llama", arch="llama"),
        "mistral": make_model(root / "mistral", arch="mistral"),
        "qwen2": make_model(root / "qwen2", arch="qwen2"),
        "qwen3": make_model(root / "qwen3", arch="qwen3"),
        "llama-tied": make_model(root / "llama-tied", arch="llama", tie_word_embeddings=True),
    }


def adapter_logits(engine: Engine, adapter: str, tokens: list[int]) -> torch.Tensor:
    """The logits of one prefill of `tokens` with `adapter` in its slot (blocks 0..n of the
    paged cache), [T, vocab]: the LoRA delta itself, not only the argmax of greedy outputs."""
    engine.preload_adapter(adapter, into_slot=True)
    slot = engine.adapters.slots.slot_of(adapter)
    runner, bs, n = engine.runner, engine.config.block_size, len(tokens)
    dev = runner.device
    attn = AttentionBatch(
        q_starts=[0, n],
        ctx_lens=[n],
        slot_mapping=torch.arange(n, device=dev),
        block_table=torch.arange(-(-n // bs), dtype=torch.int32, device=dev).unsqueeze(0),
        ctx_lens_t=torch.tensor([n], dtype=torch.int32, device=dev),
        q_starts_t=torch.tensor([0, n], dtype=torch.int32, device=dev),
        block_size=bs,
        sliding_window=engine.spec.sliding_window,
    )
    ctx = StepContext(
        attn, runner.lora_pool.make_batch([n], [slot], n), runner.kv_caches, runner.lora_pool
    )
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(tokens, device=dev), torch.arange(n, device=dev), ctx)
        return runner.model.logits(hidden)


def write_adapters(model_dir, root, specs: dict[str, dict], first_seed: int) -> dict:
    """PEFT adapters for `model_dir` under `root`, one per `specs` entry (make_adapter's
    arguments), seeded from `first_seed` in order: name -> folder."""
    from tests.factories import make_adapter

    return {
        name: make_adapter(model_dir, root / name, seed=first_seed + i, **kw)
        for i, (name, kw) in enumerate(specs.items())
    }


def peft_greedy_table(model_dir, adapters: dict, prompts, max_tokens: int) -> dict:
    """(adapter name or None, prompt index) -> PEFT's greedy tokens, one model load each."""
    from tests.factories import hf_greedy_many

    out = {}
    for name, path in [(None, None), *adapters.items()]:
        for i, tokens in enumerate(hf_greedy_many(model_dir, prompts, max_tokens, path)):
            out[name, i] = tokens
    return out
