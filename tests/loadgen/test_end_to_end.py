"""The client and the whole command against a fake OpenAI-compatible server on 127.0.0.1, and
the client's timings exactly, against the same fake on a virtual clock."""

from __future__ import annotations

import json
import socket

import pytest

from loadgen.__main__ import amain, build_parser, main
from loadgen.client import OpenAIClient
from loadgen.records import Outcome
from tests.loadgen.fake_server import ADAPTERS, BASE, BROKEN, FakeConfig, FakeTransport, serve
from workloads.requests import RequestSpec

FIRST_TOKEN_DELAY_S = FakeConfig().first_token_delay_s
TOKEN_DELAY_S = FakeConfig().token_delay_s


def spec(model: str = "ad-0", output_len: int = 12, prompt=(5, 6, 7)) -> RequestSpec:
    return RequestSpec(
        index=0, model=model, is_base=False, prompt=prompt, input_len=len(prompt),
        output_len=output_len,
    )  # fmt: skip


async def send_one(url: str, s: RequestSpec, **client_options):
    async with OpenAIClient(url, **client_options) as client:
        return await client.send(s, 0.0, 0.0)


async def run_cli(*argv: str) -> dict:
    args = build_parser().parse_args([*argv, "--no-progress"])
    return await amain(args, "python -m loadgen " + " ".join(argv))


def send_timed(virtual, config: FakeConfig, s: RequestSpec):
    """Send `s` to the fake through `FakeTransport` on the virtual clock: timings are exact."""
    return virtual.run_until_complete(send_one("http://fake", s, transport=FakeTransport(config)))


class TestClient:
    async def test_streamed_completion_is_timed(self, fake_url):
        record = await send_one(fake_url, spec(output_len=12))
        assert record.ok and record.status == 200
        assert record.output_tokens == 12 and record.num_chunks == 12
        assert len(record.itl_s) == 11 and record.prompt_tokens == 3
        # Over a socket only bounds hold (no token is read before it is sent; a loaded machine
        # may read several at once, or late); exact timings are the next test's.
        assert record.ttft_s >= FIRST_TOKEN_DELAY_S
        assert record.e2e_s >= FIRST_TOKEN_DELAY_S + 11 * TOKEN_DELAY_S
        assert record.e2e_s - record.ttft_s - sum(record.itl_s) >= -1e-9  # the gaps end in it
        assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 11)

    async def test_the_request_is_timed_onto_the_wire_before_its_first_token(self, fake_url):
        record = await send_one(fake_url, spec(output_len=2))
        assert record.ok and record.written_s is not None
        assert 0.0 < record.written_s <= record.ttft_s  # the body went out before the answer

    def test_the_timings_are_the_servers(self, virtual):
        record = send_timed(virtual, FakeConfig(), spec(output_len=12))
        assert record.ok and record.num_chunks == 12
        assert record.ttft_s == pytest.approx(FIRST_TOKEN_DELAY_S)
        assert record.itl_s == pytest.approx([TOKEN_DELAY_S] * 11)
        # the gaps span first token to last; the stream's end (usage, [DONE]) follows at once
        assert record.e2e_s == pytest.approx(FIRST_TOKEN_DELAY_S + 11 * TOKEN_DELAY_S)
        assert record.tpot_s == pytest.approx(TOKEN_DELAY_S)

    async def test_payload_forces_the_output_length(self):
        with serve() as (url, state):
            await send_one(url, spec(output_len=7))
        (body,) = state.bodies
        assert body["prompt"] == [5, 6, 7]
        assert body["max_tokens"] == 7 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["model"] == "ad-0" and body["temperature"] == 0.0

    async def test_chat_endpoint_sends_messages(self):
        with serve() as (url, state):
            record = await send_one(url, spec(prompt="hello there"), endpoint="chat")
        assert record.ok and record.output_tokens == 12
        assert state.bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]

    def test_multi_token_chunks_spread_itl_with_usage_counts(self, virtual):
        record = send_timed(virtual, FakeConfig(tokens_per_chunk=4), spec(output_len=13))
        assert record.ok
        assert record.num_chunks == 4  # 1 + 4 + 4 + 4
        assert record.output_tokens == 13  # from usage, not from the chunk count
        # a chunk's gap (the server's 4 token delays) spread over its 4 tokens
        assert record.itl_s == pytest.approx([TOKEN_DELAY_S] * 12)

    def test_per_chunk_usage_gives_exact_counts(self, virtual):
        delay = 0.01
        config = FakeConfig(tokens_per_chunk=3, usage_every_chunk=True, token_delay_s=delay)
        record = send_timed(virtual, config, spec(output_len=8))  # chunks of 1, 3, 3, 1 tokens
        assert record.ok and record.num_chunks == 4 and len(record.itl_s) == 7
        # The server spends `delay` per token. Spread by the true counts, every ITL is `delay`;
        # an estimate (1, 2, 2, 3 tokens) would cut the last one-token gap in three.
        assert record.itl_s == pytest.approx([delay] * 7)

    async def test_unknown_adapter_is_an_http_error(self, fake_url):
        record = await send_one(fake_url, spec(model="missing"))
        assert record.outcome is Outcome.HTTP_ERROR and record.status == 404
        assert "not found" in record.error

    async def test_error_event_mid_stream_fails_the_request(self, fake_url):
        record = await send_one(fake_url, spec(model=BROKEN))
        assert record.outcome is Outcome.STREAM_ERROR and "engine failed" in record.error

    async def test_per_request_timeout(self, fake_url):
        record = await send_one(fake_url, spec(), request_timeout_s=FIRST_TOKEN_DELAY_S / 3)
        assert record.outcome is Outcome.TIMEOUT

    async def test_refused_connection_is_a_transport_error(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens here once closed
        record = await send_one(f"http://127.0.0.1:{port}", spec())
        assert record.outcome is Outcome.TRANSPORT_ERROR and record.error

    async def test_adapter_stats_absent_is_none(self):
        with serve(FakeConfig(with_adapters_route=False)) as (url, _):
            async with OpenAIClient(url) as client:
                assert await client.adapter_stats() is None


class TestCommand:
    async def test_run_writes_json_and_markdown(self, tmp_path):
        out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
        # An SLO every request meets however busy the machine: TTFT is 30 ms here, but a loaded
        # test machine has taken 8.6 s (P99) to read it.
        with serve() as (url, state):
            report = await run_cli(
                "--base-url", url, "--adapters-from-server", "--popularity", "distinct",
                "--base-fraction", "0.2", "--num-prompts", "30", "--input-len", "4:16",
                "--output-len", "3:8", "--warmup", "2", "--slo-ttft-ms", "600000",
                "--output-json", str(out_json), "--output-md", str(out_md), "--save-requests",
            )  # fmt: skip
        assert json.loads(out_json.read_text()) == report
        assert report["schema"] == "lorafleet.loadgen/1"
        assert report["workload"]["adapters"] == list(ADAPTERS)
        assert report["workload"]["base_model"] == BASE
        assert report["server"]["models"] == [BASE, *ADAPTERS]
        assert report["warmup"] == {"requests": 2, "failed": 0}
        (run,) = report["runs"]
        s = run["summary"]
        assert (s["num_requests"], s["completed"], s["failed"]) == (30, 30, 0)
        assert s["ttft_ms"]["p50"] >= FIRST_TOKEN_DELAY_S * 1000
        assert s["goodput"] == pytest.approx(s["request_throughput"])
        assert sum(a["count"] for a in run["per_adapter"].values()) == 30
        assert run["per_adapter"][BASE]["is_base"]
        requests = run["requests"]
        assert len(requests) == 30
        assert all(3 <= r["output_tokens"] <= 8 for r in requests)
        assert all(r["output_tokens"] == r["output_len"] for r in requests)
        # The server counted the run's requests (not the warm-up's) in /v1/adapters.
        diff = run["adapter_stats"]["diff"]["adapters"]
        for adapter in ADAPTERS:
            assert diff[adapter]["requests"] == run["per_adapter"][adapter]["count"]
        assert sum(state.requests_by_model.values()) == 32  # run + warm-up
        md = out_md.read_text()
        assert md.startswith(f"# Load test: {url} (completions)")
        assert "| rate |" in md and "goodput" in md and "ad-0" in md

    async def test_without_adapter_stats_route(self):
        with serve(FakeConfig(with_adapters_route=False)) as (url, _):
            report = await run_cli("--base-url", url, "--adapters", "ad-1", "--num-prompts", "5",
                                   "--output-len", "2")  # fmt: skip
        assert report["runs"][0]["adapter_stats"] is None
        assert report["runs"][0]["summary"]["completed"] == 5

    async def test_errors_are_counted(self, fake_url):
        report = await run_cli(
            "--base-url", fake_url, "--adapters", "ad-0,missing", "--popularity", "distinct",
            "--num-prompts", "10", "--output-len", "2", "--warmup", "0",
        )  # fmt: skip
        s = report["runs"][0]["summary"]
        assert (s["completed"], s["failed"]) == (5, 5)
        assert s["outcomes"] == {"http_error": 5, "ok": 5}
        (error,) = s["errors"]
        assert error["status"] == 404 and error["count"] == 5 and "missing" in error["error"]
        assert report["runs"][0]["per_adapter"]["missing"]["failed"] == 5

    async def test_same_seed_sends_the_same_workload_to_two_servers(self):
        argv = [
            "--adapters",
            "ad-0,ad-1,ad-2",
            "--popularity",
            "zipf",
            "--num-prompts",
            "12",
            "--output-len",
            "2:4",
            "--request-rate",
            "200",
            "--seed",
            "5",
            "--warmup",
            "0",
        ]
        bodies, digests = [], []
        for _ in range(2):
            with serve() as (url, state):
                report = await run_cli("--base-url", url, *argv)
            bodies.append(sorted(json.dumps(b, sort_keys=True) for b in state.bodies))
            digests.append(report["workload"]["digest"])
        assert bodies[0] == bodies[1] and digests[0] == digests[1]

    async def test_sweep_runs_each_rate_and_plots_if_it_can(self, fake_url, tmp_path, capsys):
        plot = tmp_path / "sweep.png"
        report = await run_cli(
            "--base-url", fake_url, "--adapters", "ad-0,ad-1", "--num-prompts", "8",
            "--output-len", "2", "--sweep-rates", "50,inf", "--plot", str(plot),
        )  # fmt: skip
        assert [r["load"]["request_rate"] for r in report["runs"]] == [50.0, "inf"]
        assert all(r["summary"]["completed"] == 8 for r in report["runs"])
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert not plot.exists()
            assert "matplotlib is not installed" in capsys.readouterr().err
        else:
            assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    async def test_server_without_adapters_cannot_supply_them(self):
        with serve(FakeConfig(adapters=())) as (url, _):
            with pytest.raises(ValueError, match="lists no adapter"):
                await run_cli("--base-url", url, "--adapters-from-server")

    async def test_chat_refuses_token_id_prompts(self, fake_url):
        with pytest.raises(ValueError, match="chat takes text"):
            await run_cli("--base-url", fake_url, "--endpoint", "chat", "--prompt-kind", "tokens")

    def test_main_fails_when_every_warmup_request_fails(self, fake_url, capsys):
        code = main(["--base-url", fake_url, "--adapters", "missing", "--num-prompts", "3",
                     "--no-progress"])  # fmt: skip
        assert code == 1
        assert "warm-up requests failed" in capsys.readouterr().err
