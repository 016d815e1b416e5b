"""The serving benchmark's parts that need neither Ray nor a GPU: the roofline's arithmetic, the
goodput search (alone and against a fake server whose latency grows with load), the in-process
driver on a tiny CPU model fed the same request stream as the HTTP side, and the report's
figures and ratios. The whole benchmark runs on a GPU (`python -m benchmarks.bench_serve`) and
end to end on CPU with `--smoke`."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch

from benchmarks.bench_serve import app_args, parse_args
from benchmarks.serve_engine import drive
from benchmarks.serve_goodput import Objectives, search
from benchmarks.serve_report import (
    Measured,
    fleet_figures,
    ratios,
    replica_timeline,
    row,
    save,
    slowest_steps_of,
    step_figures,
)
from benchmarks.serve_roofline import (
    Ceilings,
    kv_bytes_per_token,
    matmul_params,
    roofline,
)
from benchmarks.serve_workloads import Stream, streams
from loadgen import LengthRange, LoadConfig, OpenAIClient, run_load, summarize
from replicas.engine import Engine
from replicas.models.spec import ModelSpec
from synthetic.adapters import write_fleet
from synthetic.models import write_model
from synthetic.presets import LLAMA3_8B, TINY
from tests.loadgen.fake_server import FakeConfig, FakeTransport, serve


def summary_of(ttft_p99_ms: float, itl_p99_ms: float, failed: int = 0) -> dict:
    return {
        "failed": failed,
        "completed": 10 - failed,
        "request_throughput": 1.0,
        "output_token_throughput": 10.0,
        "ttft_ms": {"p50": ttft_p99_ms / 2, "p99": ttft_p99_ms},
        "itl_ms": {"p50": itl_p99_ms / 2, "p99": itl_p99_ms},
    }


class TestRoofline:
    def test_matmul_params_are_the_linear_weights_of_the_transformers_model(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "model_type"})
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        spec = ModelSpec.from_dict(LLAMA3_8B)
        assert matmul_params(spec) == linear
        # with the embedding and the norms: Llama-3-8B's published 8.03 B parameters
        assert sum(p.numel() for p in model.parameters()) == 8_030_261_248

    def test_kv_bytes_per_token_of_llama3_8b_in_bf16(self):
        # 32 layers x (K and V) x 8 heads x 128 dims x 2 bytes
        assert kv_bytes_per_token(ModelSpec.from_dict(LLAMA3_8B), 2) == 131_072

    def test_prefill_at_the_gemm_rate_and_decode_steps_reading_weights_and_kv(self):
        spec = ModelSpec.from_dict(LLAMA3_8B)
        params, kv = matmul_params(spec), kv_bytes_per_token(spec, 2)
        ceilings = Ceilings(gemm_flops=800e12, hbm_bytes_s=3e12)
        # two requests: 100 prompt tokens and 3 outputs, 300 prompt tokens and 1 output
        roof = roofline(spec, [100, 300], [3, 1], ceilings, max_num_seqs=2)
        # decode tokens: the first request's 2nd and 3rd, reading contexts of 101 and 102
        assert roof.decode_steps == 1
        assert roof.kv_bytes_read == (101 + 102) * kv
        assert roof.prefill_s == pytest.approx(2 * params * 400 / 800e12)
        assert roof.decode_s == pytest.approx((2 * params + 203 * kv) / 3e12)
        assert roof.tok_s == pytest.approx(4 / (roof.prefill_s + roof.decode_s))
        two = roofline(spec, [100, 300], [3, 1], ceilings, max_num_seqs=2, replicas=2)
        assert two.tok_s == pytest.approx(2 * roof.tok_s)

    def test_kv_read_equals_a_token_by_token_count(self):
        spec = ModelSpec.from_dict(TINY)
        prompts, outputs = [7, 30, 12, 5], [1, 9, 4, 16]
        contexts = sum(p + j for p, n in zip(prompts, outputs, strict=True) for j in range(1, n))
        steps = math.ceil(sum(n - 1 for n in outputs) / 3)
        roof = roofline(spec, prompts, outputs, Ceilings(1e9, 1e9), max_num_seqs=3)
        assert roof.kv_bytes_read == contexts * kv_bytes_per_token(spec, 2)
        assert roof.decode_steps == steps


class TestGoodputSearch:
    def test_bisects_to_the_threshold_rate(self):
        threshold = 7.3

        async def measure(rate: float) -> dict:
            return summary_of(500.0 if rate <= threshold else 1500.0, 20.0)

        found = asyncio.run(search(measure, 1.0, 64.0, steps=6))
        low, high = found.bracket
        assert low <= threshold < high and found.rate == low
        assert high / low < 64 ** (1 / 2**6) * 1.001  # each step halves the log-width
        assert [p.rate for p in found.points][:2] == [64.0, 1.0] and len(found.points) == 8
        assert all(p.passed == (p.rate <= threshold) for p in found.points)

    def test_edges_and_objectives(self):
        async def good(rate: float) -> dict:
            return summary_of(10.0, 10.0)

        async def slow_tokens(rate: float) -> dict:
            return summary_of(10.0, 150.0)  # TTFT fine, ITL P99 over 100 ms

        async def failing(rate: float) -> dict:
            return summary_of(10.0, 10.0, failed=1)

        above = asyncio.run(search(good, 1.0, 8.0, steps=3))
        assert above.rate == 8.0 and above.bracket == (8.0, None) and len(above.points) == 1
        for measure in (slow_tokens, failing):
            below = asyncio.run(search(measure, 1.0, 8.0, steps=3))
            assert below.rate is None and below.bracket == (0.0, 1.0)

    def test_against_a_server_that_queues_beyond_its_capacity(self, virtual):
        # One request at a time, 0.3 s each (8 tokens): about 3 req/s at most. On the virtual
        # clock the fake's times are exact: sent all at once, the 8th waits 7 x 0.3 s, over the
        # 2 s objective; at 3 req/s these arrivals' TTFT P99 is about 0.7 s.
        fake = FakeConfig(first_token_delay_s=0.25, token_delay_s=0.007, capacity=1)
        specs = streams(parse_args(["--smoke"]).spec, ["ad-0", "ad-1"], 0, 30.0)[0].specs[:8]
        stream = Stream("fake", specs, LoadConfig(timeout_s=30.0))
        objectives = Objectives(ttft_p99_ms=2000.0, itl_p99_ms=2000.0)

        async def run() -> object:
            async with OpenAIClient("http://fake", transport=FakeTransport(fake)) as client:

                async def measure(rate: float) -> dict:
                    result = await run_load(client, stream.specs, stream.at(rate).load)
                    return summarize(result.records, result.duration_s)

                return await search(measure, 3.0, 1000.0, steps=0, objectives=objectives)

        found = virtual.run_until_complete(run())
        high, low = found.points
        assert high.rate == 1000.0 and not high.passed
        assert high.summary["ttft_ms"]["p99"] > 2000.0 and high.summary["failed"] == 0
        assert low.rate == 3.0
        assert low.passed, (low.summary["ttft_ms"], low.summary["itl_ms"])
        assert found.rate == 3.0 and found.bracket == (3.0, 1000.0)


class TestInProcessDriver:
    def test_the_engine_sees_the_requests_and_arrivals_the_http_side_sends(self, tmp_path):
        args = parse_args(["--smoke", "--num-requests", "5"])
        model_dir = write_model(tmp_path, TINY)
        names = ["lora-0", "lora-1"]
        fleet = write_fleet(tmp_path, ModelSpec.from_dir(model_dir), names, rank=4)
        # The run's timeout only turns a hang into a failure (5 requests over ~0.1 s): generous.
        work = streams(args.spec, names, seed=3, timeout_s=600.0)[0]
        work = work.at(40.0)  # Poisson: arrivals spread over ~0.1 s
        with serve(FakeConfig(adapters=tuple(names))) as (url, state):

            async def over_http():
                async with OpenAIClient(url) as client:
                    return await run_load(client, work.specs, work.load)

            http = asyncio.run(over_http())
            bodies = sorted(state.bodies, key=lambda b: b["prompt"])
        app = app_args(args, args.spec, model_dir, fleet)
        engine = Engine(app.to_engine_config(model_dir, "cpu"))
        seen = []
        add = engine.add_request
        engine.add_request = lambda r: (seen.append((time.monotonic(), r)), add(r))[1]
        try:
            local = drive(engine, work.specs, work.offsets().tolist())
        finally:
            engine.shutdown()
        key = lambda r: (r.index, r.model, r.input_len, r.output_len, round(r.scheduled_s, 9))
        assert [key(r) for r in local.records] == [key(r) for r in http.records]
        sent = sorted(
            ({"model": b["model"], "prompt": b["prompt"], "max_tokens": b["max_tokens"]}
             for b in bodies), key=lambda b: b["prompt"])  # fmt: skip
        taken = sorted(
            ({"model": r.adapter, "prompt": r.prompt_token_ids, "max_tokens": r.sampling.max_tokens}
             for _, r in seen), key=lambda b: b["prompt"])  # fmt: skip
        assert taken == sent
        for record, spec in zip(local.records, work.specs, strict=True):
            assert record.ok and record.output_tokens == spec.output_len
            assert len(record.itl_s) == spec.output_len - 1
            assert 0 < record.ttft_s <= record.e2e_s
        # each request was queued once its arrival time had come, not before
        assert all(added >= r.arrival_time for added, r in seen)
        starts = sorted(r.arrival_time for _, r in seen)
        offsets = sorted(work.offsets().tolist())
        assert [b - starts[0] for b in starts] == pytest.approx(offsets, abs=1e-6)
        assert 0 < local.busy_s <= local.duration_s and local.steps > 0
        steps = step_figures({"e": local.stats[0]}, {"e": local.stats[1]})
        assert steps["step_ms"] == pytest.approx(1e3 * local.busy_s / local.steps)
        assert 0 < steps["launch_ms"] <= steps["step_ms"] and steps["seqs_per_step"] >= 1


class TestStreams:
    def test_adapter_counts_share_prompts_lengths_and_arrivals(self):
        wl = parse_args(["--smoke", "--workload", "saturated"]).spec
        names = [f"lora-{i}" for i in range(4)]
        many, one = streams(wl, names, seed=5, timeout_s=30.0)
        assert (many.label, one.label) == ("4 adapters", "1 adapter")
        shape = lambda s: [(r.prompt, r.input_len, r.output_len) for r in s.specs]
        assert shape(many) == shape(one) and len(many.specs) == wl.num_requests
        assert {r.model for r in one.specs} == {"lora-0"}
        assert {r.model for r in many.specs} == set(names)
        assert list(many.at(4.0).offsets()) == list(one.at(4.0).offsets())
        assert all(wl.input_len.low <= r.input_len <= wl.input_len.high for r in many.specs)


class TestReport:
    def rows(self) -> list[dict]:
        def measured(tok_s: float, ttft: float) -> Measured:
            s = summary_of(ttft, 30.0)
            s.update(
                output_token_throughput=tok_s,
                duration_s=2.0,
                ttft_ms={"p50": ttft, "p90": ttft, "p99": ttft},
                itl_ms={"p50": 20.0, "p90": 25.0, "p99": 30.0},
                e2e_ms={"p50": 1500.0, "p90": 1800.0, "p99": 1900.0},
            )
            return Measured(s, [0.5, 0.7], [30, 34])

        rows = []
        for label, http, local, roof in (("32 adapters", 600.0, 500.0, 2000.0),
                                         ("1 adapter", 900.0, 600.0, 2000.0)):  # fmt: skip
            rows.append(row(label, "http", measured(http, 80.0)))
            rows.append(row(label, "in-process", measured(local, 40.0)))
            rows.append({"stream": label, "path": "roofline", "throughput_tok_s": roof})
        return rows

    def test_rows_carry_percentiles_in_their_units_and_fleet_means(self):
        r = self.rows()[0]
        assert r["e2e_p90_s"] == pytest.approx(1.8) and r["itl_p99_ms"] == 30.0
        assert r["busy_share"] == pytest.approx(0.6) and r["requests_per_replica"] == [30, 34]

    def test_ratios_within_and_across_streams(self):
        table = {
            e["ratio"]: e["value"]
            for e in ratios(self.rows(), replicas=2, published=("X", {"ttft_p50_ms": 50.0}))
        }
        assert table["32 adapters: HTTP / in-process"] == pytest.approx(600 / (2 * 500))
        assert table["32 adapters: in-process / roofline"] == pytest.approx(2 * 500 / 2000)
        assert table["1 adapter: HTTP / roofline"] == pytest.approx(900 / 2000)
        assert table["http tok/s: 32 adapters / 1 adapter"] == pytest.approx(600 / 900)
        assert table["in-process tok/s: 32 adapters / 1 adapter"] == pytest.approx(500 / 600)
        assert table["1 adapter: http ttft_p50_ms / X"] == pytest.approx(80 / 50)
        assert table["1 adapter: in-process ttft_p50_ms / X"] == pytest.approx(40 / 50)

    def test_fleet_figures_from_replica_stats_before_and_after(self):
        before = {"b": {"num_finished": 10, "busy_s": 1.0}, "a": {"num_finished": 4, "busy_s": 2}}
        after = {
            "a": {"num_finished": 9, "busy_s": 4.0},
            "b": {"num_finished": 30, "busy_s": 3.0},
            "c": {"num_finished": 3, "busy_s": 1.0},  # came up during the run
        }
        requests, busy = fleet_figures(before, after, duration_s=4.0)
        assert requests == [5, 20, 3] and busy == pytest.approx([0.5, 0.5, 0.25])

    def test_step_figures_sum_the_replicas_steps(self):
        before = {"a": {"num_steps": 10, "busy_s": 1.0, "launch_s": 0.2, "step_seqs": 40}}
        after = {
            "a": {"num_steps": 30, "busy_s": 1.5, "launch_s": 0.3, "step_seqs": 140},
            "b": {"num_steps": 20, "busy_s": 0.5, "launch_s": 0.1, "step_seqs": 60},  # new
        }
        steps = step_figures(before, after)
        assert steps == pytest.approx({"step_ms": 25.0, "launch_ms": 5.0, "seqs_per_step": 4.0})
        assert step_figures(after, after) is None  # no step ran

    def test_replica_timeline_says_when_each_replica_ran_out_of_work(self):
        samples = [  # (t, replica, running, waiting)
            (0.0, "b", 0, 0), (0.0, "a", 0, 0),
            (0.5, "a", 4, 6), (0.5, "b", 2, 0),
            (1.0, "a", 4, 2), (1.0, "b", 1, 0),
            (1.5, "a", 2, 0), (1.5, "b", 0, 0),
            (2.0, "a", 0, 0), (2.0, "b", 0, 0),
        ]  # fmt: skip
        t = replica_timeline(samples)
        assert t["replica_busy_until_s"] == [1.5, 1.0]  # replicas in id order
        assert t["replica_mean_running"] == [2.5, 1.0]  # over samples up to the last work
        assert t["replica_mean_waiting"] == [2.0, 0.0]
        assert t["replica_none_waiting_share"] == [0.5, 1.0]
        assert len(t["samples"]) == len(samples)
        idle = replica_timeline([(0.0, "a", 0, 0), (0.5, "a", 0, 0)])
        assert idle["replica_busy_until_s"] == [0.0] and idle["replica_mean_running"] == [0.0]
        # in a row: the stream (2 s) ended 0.5 s after its last replica ran out of work
        pcts = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
        summary = summary_of(50.0, 30.0) | {"duration_s": 2.0}
        summary |= {"ttft_ms": pcts, "itl_ms": pcts, "e2e_ms": pcts, "write_ms": pcts}
        m = Measured(summary, [0.5, 0.7], [30, 34])
        m.timeline = t
        m.tcp = {"ListenOverflows": 3, "TCPSynRetrans": 5}
        r = row("32 adapters", "http", m)
        assert r["delivery_tail_s"] == pytest.approx(0.5)
        assert r["write_p50_ms"] == 1.0 and r["write_p99_ms"] == 3.0
        assert r["tcp_counters"] == {"ListenOverflows": 3, "TCPSynRetrans": 5}
        assert r["replica_busy_until_s"] == [1.5, 1.0] and "samples" not in r
        assert len(r["replica_samples"]) == len(samples)

    def test_slowest_steps_of_every_replica_slowest_first_from_the_runs_start(self):
        def step(started: float, ms: float) -> dict:
            return {"started": started, "num_tokens": 9, "num_seqs": 3, "gated": False,
                    "launch_ms": 1.0, "step_ms": ms}  # fmt: skip

        answers = [
            {"replica_id": "a", "steps": [step(100.5, 30.0), step(101.0, 9.0)]},
            {"replica_id": "b", "steps": [step(102.25, 700.0), step(100.1, 12.0)]},
        ]
        slow = slowest_steps_of(answers, t0=100.0, count=3)
        assert [(s["replica"], s["at_s"], s["step_ms"]) for s in slow] == [
            ("b", 2.25, 700.0), ("a", 0.5, 30.0), ("b", 0.1, 12.0),
        ]  # fmt: skip
        assert "started" not in slow[0] and slow[0]["num_tokens"] == 9
        pcts = {"p50": 1.0, "p90": 2.0, "p99": 3.0}
        summary = summary_of(50.0, 30.0) | {"duration_s": 2.0}
        summary |= {"ttft_ms": pcts, "itl_ms": pcts, "e2e_ms": pcts}
        with_steps = Measured(summary, slowest_steps=slow)
        assert row("1 adapter", "http", with_steps)["slowest_steps"] == slow
        assert "slowest_steps" not in row("1 adapter", "http", Measured(summary))

    def test_results_files_hold_the_rows_and_the_ratios(self, tmp_path):
        args = parse_args(["--smoke", "--out", str(tmp_path)])
        rows = self.rows()
        meta = {"ratios": ratios(rows, 1), "replicas": 1}
        path = save(args, args.spec, rows, meta)
        data = json.loads(path.with_suffix(".json").read_text())
        assert data["rows"] == rows and data["ratios"] == meta["ratios"]
        text = path.read_text()
        assert "## Ratios" in text and "| 1 adapter | roofline |" in text
        assert path.name == "bench_serve_saturated_smoke.md"

    def test_set_overrides_app_args_and_workload_defaults(self, tmp_path):
        args = parse_args(["--smoke", "--set", "max_num_seqs=3", "--set", "router=pow2"])
        app = app_args(args, args.spec, tmp_path, {})
        assert app.max_num_seqs == 3 and app.router == "pow2"
        assert app.max_loras_per_batch == args.spec.slots and app.load_format == "dummy"
        assert LengthRange(8, 32) == args.spec.input_len

    def test_the_sweep_section_says_where_goodput_lies(self, tmp_path):
        args = parse_args(["--smoke", "--workload", "poisson", "--out", str(tmp_path)])
        rows = self.rows()
        for bracket, rate, said in (
            ([2.0, 4.0], 2.0, "2 req/s (fails at 4)"),
            ([8.0, None], 8.0, "at least 8 req/s"),
            ([0.0, 1.0], None, "below every rate tried"),
        ):
            goodput = {
                "rate": rate,
                "bracket": bracket,
                "capacity_req_s": 8.0,
                "objectives": {"ttft_p99_ms": 1000.0, "itl_p99_ms": 100.0},
                "points": [{"rate": 8.0, "passed": rate == 8.0}],
            }
            path = save(args, args.spec, rows, {"ratios": [], "goodput": goodput})
            assert f"## Goodput sweep: {said} (TTFT P99 <= 1000 ms" in path.read_text()
            assert json.loads(path.with_suffix(".json").read_text())["goodput"] == goodput


class TestOutputLength:
    def test_overrides_the_workloads_outputs(self):
        spec = parse_args(["--workload", "saturated", "--output-len", "16"]).spec
        assert (spec.output_len.low, spec.output_len.high) == (16, 16)
        spec = parse_args(["--workload", "seeds", "--output-len", "8:32"]).spec
        assert (spec.output_len.low, spec.output_len.high) == (8, 32)

    @pytest.mark.parametrize("bad", ["0", "a", "4:2"])
    def test_a_bad_length_is_refused(self, bad, capsys):
        with pytest.raises(SystemExit):
            parse_args(["--smoke", "--output-len", bad])
        assert "--output-len: bad length range" in capsys.readouterr().err


class TestLoadGeneratorProcesses:
    def test_one_an_engine_replica_by_default(self):
        assert parse_args(["--smoke"]).clients == 1
        assert parse_args(["--smoke", "--replicas", "4"]).clients == 4
        assert parse_args(["--smoke", "--replicas", "4", "--clients", "2"]).clients == 2

    def test_fewer_than_one_is_refused(self, capsys):
        with pytest.raises(SystemExit):
            parse_args(["--smoke", "--clients", "0"])
        assert "--clients must be at least 1" in capsys.readouterr().err


def test_profilers_sample_each_process_for_the_seconds_asked(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks import serve_http

    calls = []
    monkeypatch.setattr(serve_http.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(serve_http.subprocess, "Popen", lambda argv, **_: calls.append(argv))
    processes = [SimpleNamespace(role="proxy", pid=11), SimpleNamespace(role="ingress", pid=12)]
    serve_http.start_profilers(processes, str(tmp_path / "prof"), 2.6)
    assert [argv[argv.index("--pid") + 1] for argv in calls] == ["11", "12"]
    assert {argv[argv.index("--duration") + 1] for argv in calls} == {"3"}
    assert calls[0][-1] == str(tmp_path / "prof" / "proxy-11.txt")
    serve_http.start_profilers(processes[:1], str(tmp_path / "prof"))
    assert calls[-1][calls[-1].index("--duration") + 1] == "15"
