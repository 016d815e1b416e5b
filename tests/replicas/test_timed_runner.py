"""Timed steps (replicas/timed_runner.py): the real engine around a runner that takes the
calibrated GPU time per step and samples fixed tokens, so the serving path can be measured
without a GPU. It must serve like a model would: every request its tokens, none an end of
sequence, the same tokens every run, and no step shorter than its modelled time."""

from __future__ import annotations

import json

import pytest

from replicas.config import EngineConfig
from replicas.engine import Engine
from replicas.request import Request
from replicas.step_cost import StepCost, load_step_cost
from replicas.timed_runner import TimedRunner
from tests.replicas.conftest import greedy, run_to_completion

COST = {"base_s": 0.004, "per_seq_s": 0.0005, "per_adapter_s": 0.001, "prefill_token_s": 1e-5}


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"step": COST, "copy_s": 0.001, "read_s": 0.01}))
    return path


def timed_engine(model_dir, calibration, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), timed_steps=str(calibration),
                               num_kv_blocks=256, block_size=4, **overrides))  # fmt: skip


def requests() -> list[Request]:
    prompts = [[5, 17, 200, 33], [61, 150, 7], [100, 2, 77, 13, 250, 9, 9]]
    return [Request(f"r{i}", p, greedy(6 + i)) for i, p in enumerate(prompts)]


def test_every_request_gets_its_tokens_none_an_eos_and_the_same_every_run(models, calibration):
    runs = []
    for _ in range(2):
        engine = timed_engine(models["llama"], calibration)
        assert isinstance(engine.runner, TimedRunner)
        runs.append(run_to_completion(engine, requests()))
        engine.shutdown()
    first, second = runs
    assert first == second
    for i, (tokens, reason) in enumerate(first.values()):
        assert len(tokens) == 6 + i and reason == "length"
        assert not set(tokens) & engine.eos_token_ids
        assert all(0 <= t < engine.spec.vocab_size for t in tokens)


def test_no_step_is_shorter_than_its_modelled_time(models, calibration):
    engine = timed_engine(models["llama"], calibration)
    run_to_completion(engine, requests())
    cost = StepCost(**COST)
    timings = engine.step_timings()
    assert timings
    for t in timings:
        prefill = t.num_tokens - t.num_seqs if t.num_tokens > t.num_seqs else 0
        # a lower bound: a step's prefill tokens are at least its tokens beyond one a sequence
        assert t.total_s >= cost.step_s(t.num_seqs, 0, prefill) - 1e-4, t
    engine.shutdown()


def test_a_steps_host_share_is_spent_before_its_last_launch(models, tmp_path):
    """The launches take `host_share` of the modelled step (running Python, so holding the
    GIL as a GPU step's launches do): a step's host part lasts at least that long."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"step": {**COST, "host_share": 0.5}}))
    engine = timed_engine(models["llama"], path)
    run_to_completion(engine, requests())
    cost = StepCost(**COST)
    for t in engine.step_timings():
        prefill = t.num_tokens - t.num_seqs if t.num_tokens > t.num_seqs else 0
        assert t.launch_s >= 0.5 * cost.step_s(t.num_seqs, 0, prefill) - 1e-4, t
        assert t.total_s >= cost.step_s(t.num_seqs, 0, prefill) - 1e-4, t
    engine.shutdown()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("not json", "not a step calibration"),
        (json.dumps({"copy_s": 1}), "not a step calibration"),
        (json.dumps({"step": {**COST, "base_s": -1.0}}), "negative"),
        (json.dumps({"step": {**COST, "host_share": 1.5}}), "share of a step"),
    ],
)
def test_a_bad_calibration_is_refused_with_its_path(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words) as raised:
        load_step_cost(path)
    assert str(path) in str(raised.value)
    with pytest.raises(ValueError, match="not a step calibration"):
        load_step_cost(tmp_path / "missing.json")


def test_timed_steps_stand_in_for_a_gpu_only_on_cpu(models, calibration):
    with pytest.raises(ValueError, match="device must be cpu"):
        timed_engine(models["llama"], calibration, device="cuda")
