"""The simulator's calibration: the step-cost fit, the JSON it is kept in, and the command that
measures it, run on CPU with a tiny model so its code path is exercised."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sim.calibrate import main as calibrate_main
from sim.calibration import DEFAULT, REUSED_READS, Calibration, StepCost, StepSample


def samples_of(cost: StepCost) -> list[StepSample]:
    return [
        StepSample(seqs, adapters, prefill, cost.step_s(seqs, adapters, prefill))
        for seqs, adapters, prefill in [
            (1, 1, 0), (8, 1, 0), (8, 4, 0), (32, 8, 0), (64, 8, 0), (1, 1, 512), (1, 1, 1024),
        ]
    ]  # fmt: skip


class TestFit:
    def test_recovers_the_terms_of_exact_samples(self):
        truth = StepCost(base_s=0.011, per_seq_s=2e-4, per_adapter_s=3e-4, prefill_token_s=5e-5)
        fitted = StepCost.fit(samples_of(truth))
        for name in ("base_s", "per_seq_s", "per_adapter_s", "prefill_token_s"):
            assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)

    def test_negative_terms_are_clipped_to_zero(self):
        # Steps that get faster with more sequences (noise) must not make a negative cost.
        samples = [StepSample(s, 1, 0, 0.02 - 1e-4 * s) for s in (1, 8, 16, 32)]
        samples += [StepSample(1, 1, 256, 0.03), StepSample(1, 1, 512, 0.04)]
        assert StepCost.fit(samples).per_seq_s == 0.0

    def test_needs_enough_samples(self):
        with pytest.raises(ValueError, match="at least 4"):
            StepCost.fit(samples_of(DEFAULT.step)[:3])


class TestJson:
    def test_round_trip(self, tmp_path):
        cal = Calibration(
            step=DEFAULT.step, copy_s=0.002, read_s=0.03, adapter_bytes=1 << 20,
            source={"device": "x"}, samples=tuple(samples_of(DEFAULT.step)),
            reused_reads=((16, 0.01), (64, 0.02)),
        )  # fmt: skip
        cal.save(tmp_path / "c.json")
        assert Calibration.load(tmp_path / "c.json") == cal

    def test_a_file_without_reused_reads_takes_the_recorded_ones(self, tmp_path):
        data = DEFAULT.to_json()
        del data["reused_reads"]
        (tmp_path / "c.json").write_text(json.dumps(data))
        assert Calibration.load(tmp_path / "c.json").reused_reads == REUSED_READS

    def test_a_file_missing_a_cost_is_refused(self, tmp_path):
        data = DEFAULT.to_json()
        del data["copy_s"]
        (tmp_path / "c.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="not a simulator calibration"):
            Calibration.load(tmp_path / "c.json")


def test_the_command_measures_the_real_engine_on_cpu(tmp_path):
    out = tmp_path / "sim_calibration.json"
    args = ["--smoke", "--out", str(out), "--batches", "1,2", "--adapters", "1", "--reads", "1"]
    assert calibrate_main([*args, "--prefills", "16,32", "--decode-steps", "2"]) == 0
    cal = Calibration.load(out)
    assert cal.source["device"] == "cpu" and cal.source["model"] == "tiny (smoke)"
    assert cal.copy_s > 0 and cal.read_s > 0 and cal.adapter_bytes > 0
    decode = {(s.seqs, s.adapters) for s in cal.samples if s.prefill_tokens == 0}
    assert decode == {(1, 1), (2, 1)}
    assert sorted({s.prefill_tokens for s in cal.samples} - {0}) == [16, 32]
    assert all(s.seconds > 0 for s in cal.samples)
    assert cal.step_s(2, 1, 16) > 0


class TestRank:
    def test_adapter_costs_grow_with_the_rank_and_the_base_model_does_not(self):
        r16 = Calibration.from_json({**DEFAULT.to_json(), "source": {"rank": 16}})
        r64 = r16.for_rank(64)
        assert r64.rank == 64 and r64.source["scaled_from_rank"] == 16
        assert r64.copy_s == pytest.approx(4 * r16.copy_s)
        assert r64.read_s == pytest.approx(4 * r16.read_s)
        assert r64.adapter_bytes == 4 * r16.adapter_bytes
        assert r64.copy_bytes_per_s == pytest.approx(r16.copy_bytes_per_s)
        assert r64.step.per_adapter_s == pytest.approx(4 * r16.step.per_adapter_s)
        assert (r64.step.base_s, r64.step.per_seq_s) == (r16.step.base_s, r16.step.per_seq_s)
        assert r16.for_rank(16) is r16

    def test_a_read_into_reused_buffers_lies_on_the_line_through_the_recorded_ranks(self):
        assert REUSED_READS == ((16, 0.04074), (128, 0.15244))  # the H100 churn runs
        r16 = Calibration.from_json({**DEFAULT.to_json(), "source": {"rank": 16}})
        assert r16.reuse_read_s == pytest.approx(0.04074)
        assert r16.for_rank(128).reuse_read_s == pytest.approx(0.15244)
        assert r16.for_rank(64).reuse_read_s == pytest.approx(0.04074 + 0.1117 * 48 / 112)
        assert r16.for_rank(256).reuse_read_s == pytest.approx(0.15244 + 0.1117 * 128 / 112)
        # Allocating is per byte: a read that must allocate scales with the rank.
        assert r16.for_rank(64).read_s == pytest.approx(4 * r16.read_s)

    def test_the_nearest_recorded_ranks_set_the_line(self):
        cal = replace(DEFAULT, reused_reads=((128, 0.3), (16, 0.1), (64, 0.2)))
        assert cal.reuse_read_s == pytest.approx(0.1)
        assert cal.for_rank(32).reuse_read_s == pytest.approx(0.1 + 0.1 * 16 / 48)
        assert cal.for_rank(96).reuse_read_s == pytest.approx(0.2 + 0.1 * 32 / 64)
        assert cal.for_rank(1).reuse_read_s == pytest.approx(0.1 - 0.1 * 15 / 48)

    def test_one_recorded_rank_scales_in_proportion(self):
        cal = replace(DEFAULT, reused_reads=((32, 0.08),))
        assert cal.reuse_read_s == pytest.approx(0.04)
        assert cal.for_rank(64).reuse_read_s == pytest.approx(0.16)

    def test_reused_reads_need_distinct_ranks(self):
        with pytest.raises(ValueError, match="distinct ranks"):
            replace(DEFAULT, reused_reads=((16, 0.1), (16, 0.2)))
        with pytest.raises(ValueError, match="distinct ranks"):
            replace(DEFAULT, reused_reads=())

    def test_a_source_without_a_rank_is_rank_16(self):
        assert DEFAULT.rank == 16
        with pytest.raises(ValueError):
            DEFAULT.for_rank(0)
