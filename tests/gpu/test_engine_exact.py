"""The engine in float32 on a GPU gives exactly the greedy tokens of transformers + PEFT in
float32 (TF32 off on both sides), for every request of a batch that mixes nine adapters of ranks
4 to 64 (rsLoRA, partial targets, per-module ranks and alphas) with base-model requests, prompts
of several prefill chunks each: with decode steps replayed from CUDA graphs (counted), with
prefill steps replayed from per-layer graphs or run eagerly, and with every step eager."""

from types import SimpleNamespace

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.gpu.reference import full_float32, hf_model, reference_greedy, teacher_forced_logits
from tests.replicas.conftest import run_to_completion

pytestmark = pytest.mark.gpu

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> make_adapter arguments (all seven projections and alpha = rank unless given)
ADAPTERS = {
    "r4": dict(rank=4),
    "r8-qv": dict(rank=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "r16-rslora": dict(rank=16, lora_alpha=8, use_rslora=True),
    "r32-attention": dict(rank=32, lora_alpha=64, target_modules=ATTENTION),
    "r64-mlp-rslora": dict(rank=64, lora_alpha=16, use_rslora=True, target_modules=MLP),
    "r8-patterns": dict(
        rank=8,
        rank_pattern={"q_proj": 32, "layers.1.mlp.down_proj": 4},
        alpha_pattern={"v_proj": 4},
    ),
    "r24-partial": dict(rank=24, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj"]),
    "r12-rslora-pattern": dict(
        rank=12, use_rslora=True, rank_pattern={"layers.0.self_attn.o_proj": 48}
    ),
    "r64": dict(rank=64, lora_alpha=32),
}
# Prompt lengths: with 64 tokens a step, most prompts take several chunks.
LENGTHS = [70, 23, 130, 5, 100, 41, 150, 64, 9, 33, 17, 90]
MAX_TOKENS = 12


def adapter_of(i: int) -> str | None:
    """Requests 3, 7 and 11 run the base model; the others one adapter each."""
    names = list(ADAPTERS)
    return None if i % 4 == 3 else names[i - (i + 1) // 4]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The model, its adapters, the prompts and, per request, the reference's greedy tokens and
    the lead of its top-1 logit over its top-2 at each step (to tell a near-tie from a bug)."""
    root = tmp_path_factory.mktemp("exact")
    model_dir = make_model(
        root / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapters = {
        name: make_adapter(model_dir, root / name, seed=i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in LENGTHS]
    assert {adapter_of(i) for i in range(len(LENGTHS))} == {*ADAPTERS, None}
    want, leads = {}, {}
    with full_float32():
        for adapter in [*ADAPTERS, None]:
            model = hf_model(model_dir, adapters.get(adapter), torch.float32)
            for i, prompt in enumerate(prompts):
                if adapter_of(i) != adapter:
                    continue
                want[f"r{i}"] = reference_greedy(model, prompt, MAX_TOKENS)
                logits = teacher_forced_logits(model, prompt + want[f"r{i}"])
                top = logits[len(prompt) - 1 : -1].topk(2, dim=-1).values
                leads[f"r{i}"] = (top[:, 0] - top[:, 1]).tolist()
            del model
    return SimpleNamespace(
        model_dir=model_dir, adapters=adapters, prompts=prompts, want=want, leads=leads
    )


def requests(prompts: list[list[int]]) -> list[Request]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [Request(f"r{i}", p, params, adapter_of(i)) for i, p in enumerate(prompts)]


def mismatches(got: dict, want: dict, leads: dict) -> dict:
    """Per differing request: the first step that differs, both tokens and the reference's lead
    there (a lead near 1e-6 would be a float32 tie, anything larger a bug)."""
    out = {}
    for rid, tokens in want.items():
        ours = got[rid][0]
        if ours != tokens:
            k = next(k for k, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b)
            out[rid] = dict(step=k, ours=ours[k], reference=tokens[k], lead=leads[rid][k])
    return out


@pytest.mark.parametrize(
    "steps",
    [
        dict(max_prefill_graph_tokens=64),  # decode graphs, per-layer prefill graphs
        dict(max_prefill_graph_tokens=0),  # decode graphs, eager prefills
        dict(enforce_eager=True),  # no graphs at all
    ],
    ids=["graphs", "decode-graphs", "eager"],
)
def test_fp32_greedy_equals_peft_over_many_adapters(served, steps):
    config = EngineConfig(
        model=str(served.model_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_loras_per_batch=len(ADAPTERS),  # every adapter fits: all of them decode together
        max_lora_rank=64,
        # Reads on the step thread: every adapter is in its slot when its request is first
        # scheduled, so base and adapter rows decode together however fast the disk is (with
        # background reads the base requests could finish before the adapters arrive).
        adapter_loading="blocking",
        adapters=tuple((name, str(path)) for name, path in served.adapters.items()),
        **steps,
    )
    with full_float32():
        engine = Engine(config)
        runner = engine.runner
        decode_steps = []  # (sequences, LoRA tokens, adapters) of each graph-replayed decode
        if config.enforce_eager:
            assert runner.graphs is None and runner.prefill_graphs is None
        else:
            graphs = runner.graphs
            run = graphs.run

            def spy(stage, step):
                decode_steps.append((step.num_tokens, sum(step.seg_lens), len(step.seg_slots)))
                return run(stage, step)

            graphs.run = spy
        got = run_to_completion(engine, requests(served.prompts))
        torch.cuda.synchronize()

    assert not mismatches(got, served.want, served.leads), mismatches(
        got, served.want, served.leads
    )
    if config.enforce_eager:
        return
    # Decode steps were replayed from graphs, and the counter saw each replay.
    assert sum(graphs.replays.values()) == len(decode_steps) >= MAX_TOKENS - 1
    # Among them, steps batching several adapters beside base-model rows.
    mixed = [(n, lora, k) for n, lora, k in decode_steps if k >= 3 and n > lora]
    assert mixed, decode_steps
    prefill = runner.prefill_graphs
    if steps.get("max_prefill_graph_tokens"):
        assert sum(prefill.replays.values()) > 0  # and every step of prefill chunks fits one
    else:
        assert prefill is None
