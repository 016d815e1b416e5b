"""Prefill steps replayed from per-layer CUDA graphs give the tokens the eager steps give, with
adapters churning through fewer slots than there are adapters (so steps wait per layer on
adapter copies between the graphs)."""

import pytest
import torch

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request, SamplingParams
from tests.factories import make_adapter, make_model
from tests.replicas.conftest import run_to_completion

pytestmark = pytest.mark.gpu
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_graph_replayed_prefills_give_the_eager_tokens(tmp_path):
    model_dir = make_model(
        tmp_path / "m", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    adapters = tuple(
        (
            f"a{i}",
            str(
                make_adapter(
                    model_dir, tmp_path / f"a{i}", rank=4 * (i + 1), target_modules=ALL, seed=i
                )
            ),
        )
        for i in range(4)
    )

    def engine(graph_tokens: int) -> Engine:
        return Engine(
            EngineConfig(
                model=str(model_dir),
                device="cuda",
                dtype="float32",
                num_kv_blocks=256,
                max_loras_per_batch=2,
                max_lora_rank=16,
                adapters=adapters,
                max_num_batched_tokens=96,  # the longest prompt splits into chunks
                max_prefill_graph_tokens=graph_tokens,
            )
        )

    gen = torch.Generator().manual_seed(0)
    lengths = [3, 17, 40, 100, 150, 9, 64, 33]
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def requests():
        return [
            Request(f"r{i}", p, params, None if i % 4 == 3 else f"a{i % 4}")
            for i, p in enumerate(prompts)
        ]

    eager = engine(0)
    assert eager.runner.prefill_graphs is None
    want = run_to_completion(eager, requests())
    del eager
    graphed = engine(64)
    graphs = graphed.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16, 32, 48, 64]
    replays = []
    replay = graphs.replay
    graphs.replay = lambda b, n, waits=None: replays.append((b, n)) or replay(b, n, waits)
    got = run_to_completion(graphed, requests())
    assert got == want
    assert replays and all(n <= b for b, n in replays)
    assert len({b for b, _ in replays}) > 1  # several buckets replayed
