"""A load generator for OpenAI-compatible servers serving many LoRA adapters.

    # 200 requests, Poisson at 4 req/s, zipf popularity over the server's adapters, 10% base
    python -m loadgen --base-url http://127.0.0.1:8000 --adapters-from-server \\
        --popularity zipf --zipf-s 1.1 --base-fraction 0.1 --num-prompts 200 \\
        --request-rate 4 --input-len 200:1000 --output-len 100:400 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --output-json results/zipf.json

    # A closed loop of 16 clients over 32 named adapters, round robin, chat endpoint
    python -m loadgen --endpoint chat --num-adapters 32 --adapter-prefix demo- \\
        --popularity distinct --max-concurrency 16 --num-prompts 500

    # A rate sweep with a plot (pip install -e '.[bench]' for matplotlib)
    python -m loadgen --adapters a,b,c --sweep-rates 1,2,4,8 --num-prompts 300 \\
        --output-json sweep.json --output-md sweep.md --plot sweep.png

The workload (models, prompts, lengths) and the arrival pattern are seeded (`--seed`), so two
servers, or two points of a sweep, see the same requests.

The requests and their send times come from the `workloads` package (`workloads/requests.py`:
`WorkloadConfig` -> `RequestSpec`s, `popularity.py` picks each adapter, `arrivals.py` says when
each is sent), which the fleet simulator reads too. The files here, in the order a request meets
them:
  runner.py        `LoadConfig`: sends specs at their times, caps in-flight, total timeout
  client.py        `OpenAIClient.send`: one streamed request -> one `RequestRecord` (records.py)
  metrics.py       records -> TTFT / ITL / TPOT / E2E, throughput, goodput, per adapter
  benchmark.py     warm-up, then each load, with GET /v1/adapters read around every run
  server_stats.py  the numeric difference of those adapter stats
  report.py        JSON, markdown, sweep plot
  progress.py      the progress bar
"""

from loadgen.benchmark import BenchmarkResult, RunReport, run_benchmark
from loadgen.client import OpenAIClient
from loadgen.metrics import SLO, per_adapter, summarize
from loadgen.records import Outcome, RequestRecord
from loadgen.runner import LoadConfig, run_load
from workloads.requests import LengthRange, RequestSpec, WorkloadConfig, build_workload

__all__ = [
    "SLO",
    "BenchmarkResult",
    "LengthRange",
    "LoadConfig",
    "OpenAIClient",
    "Outcome",
    "RequestRecord",
    "RequestSpec",
    "RunReport",
    "WorkloadConfig",
    "build_workload",
    "per_adapter",
    "run_benchmark",
    "run_load",
    "summarize",
]
