"""`python -m loadgen`: load-test an OpenAI-compatible server. See the package
docstring for examples; `--help` for every option."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx

from loadgen.benchmark import WarmupFailed, run_benchmark
from loadgen.client import PATHS, OpenAIClient
from loadgen.metrics import SLO
from loadgen.report import to_json, to_markdown, write_plot
from loadgen.runner import LoadConfig
from workloads.popularity import POPULARITIES
from workloads.requests import LengthRange, WorkloadConfig, build_workload, workload_digest


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text}")
    return rate


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def _length(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load-test an OpenAI-compatible server with many LoRA adapters: seeded "
        "arrivals, adapter popularity and lengths; streaming TTFT/ITL/TPOT/E2E, throughput and "
        "goodput.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server's root URL.")
    g.add_argument("--endpoint", choices=list(PATHS), default="completions")
    g.add_argument("--api-key", default=None, help="Bearer token. Default: $OPENAI_API_KEY.")
    g.add_argument(
        "--model",
        default=None,
        help="The base model's name. Default: the first model without a parent in /v1/models.",
    )

    g = p.add_argument_group("adapters")
    names = g.add_mutually_exclusive_group()
    names.add_argument("--adapters", default=None, help="Adapter names, comma-separated.")
    names.add_argument(
        "--num-adapters",
        type=int,
        default=None,
        help="Name N adapters PREFIX0 .. PREFIX{N-1} (see --adapter-prefix).",
    )
    names.add_argument(
        "--adapters-from-server",
        action="store_true",
        help="Every model in /v1/models except the base.",
    )
    g.add_argument("--adapter-prefix", default="adapter-")
    g.add_argument(
        "--popularity",
        choices=POPULARITIES,
        default="uniform",
        help="distinct: round robin; skewed: geometric, adapter i has weight "
        "alpha^i; zipf: weight 1/(i+1)^s.",
    )
    g.add_argument("--alpha", type=float, default=0.7, help="Ratio of the skewed law.")
    g.add_argument("--zipf-s", type=float, default=1.0, help="Exponent of the zipf law.")
    g.add_argument(
        "--base-fraction",
        type=float,
        default=0.0,
        help="Share of requests for the base model (all of them without adapters).",
    )

    g = p.add_argument_group("requests")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument(
        "--input-len",
        type=_length,
        default=LengthRange(200, 1000),
        help="N or LOW:HIGH, uniform; tokens, or words for text prompts.",
    )
    g.add_argument(
        "--output-len",
        type=_length,
        default=LengthRange(100, 400),
        help="N or LOW:HIGH, uniform; sent as max_tokens.",
    )
    g.add_argument(
        "--prompt-kind",
        choices=["tokens", "text"],
        default=None,
        help="Random token ids (completions only) or random words. Default: tokens "
        "for completions, text for chat.",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="Token-id prompts draw from [0, vocab-size); 256 is valid for any tokenizer.",
    )
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Send ignore_eos so every output has its asked length.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seeds the workload and the arrivals.")

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Requests per second; inf sends all at once.",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier.",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Requests in flight at most; with rate inf, a closed loop.",
    )
    g.add_argument(
        "--sweep-rates",
        type=_rates,
        default=None,
        help="Comma-separated rates: one run per rate, same workload.",
    )
    g.add_argument("--warmup", type=int, default=1, help="Uncounted requests sent first.")
    g.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="Seconds each run may last; running requests are then aborted.",
    )
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="Seconds one request may last."
    )

    g = p.add_argument_group("metrics and output")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--output-json", type=Path, default=None)
    g.add_argument(
        "--save-requests",
        action="store_true",
        help="Put every request's record (with its ITLs) in the JSON.",
    )
    g.add_argument("--output-md", type=Path, default=None)
    g.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG of latency and throughput against the rate (needs matplotlib).",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")
    return p


async def discover(
    client: OpenAIClient, args: argparse.Namespace
) -> tuple[list[str], str | None, list[str] | None]:
    """Adapter names, the base model's name, and the ids /v1/models lists (None if it failed)."""
    try:
        cards = await client.list_models()
    except (httpx.HTTPError, ValueError) as e:
        if args.adapters_from_server:
            raise ValueError(f"--adapters-from-server: GET /v1/models failed: {e}") from None
        cards = None
    ids = [c["id"] for c in cards or [] if "id" in c]
    roots = [c["id"] for c in cards or [] if "id" in c and not c.get("parent")]
    base = args.model or (roots[0] if roots else None)
    if args.adapters:
        adapters = [a.strip() for a in args.adapters.split(",") if a.strip()]
    elif args.num_adapters is not None:
        adapters = [f"{args.adapter_prefix}{i}" for i in range(args.num_adapters)]
    elif args.adapters_from_server:
        with_parent = [c["id"] for c in cards if "id" in c and c.get("parent")]
        adapters = with_parent or [i for i in ids if i != base]
        if not adapters:
            raise ValueError("--adapters-from-server: /v1/models lists no adapter")
    else:
        adapters = []
    return adapters, base, (ids if cards is not None else None)


async def amain(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run the benchmark the parsed `args` describe; print and write its report; return the
    JSON dict. Raises ValueError for arguments that do not fit together or fit no server, and
    `WarmupFailed`."""
    if args.prompt_kind == "tokens" and args.endpoint == "chat":
        raise ValueError("--prompt-kind tokens needs --endpoint completions (chat takes text)")
    prompt_kind = args.prompt_kind or ("text" if args.endpoint == "chat" else "tokens")
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    rates = args.sweep_rates or [args.request_rate]
    loads = [
        LoadConfig(
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout,
            seed=args.seed,
        )
        for rate in rates
    ]
    async with OpenAIClient(
        args.base_url,
        args.endpoint,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
    ) as client:
        adapters, base, models = await discover(client, args)
        workload = WorkloadConfig(
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            adapters=tuple(adapters),
            base_model=base,
            popularity=args.popularity,
            alpha=args.alpha,
            zipf_s=args.zipf_s,
            base_fraction=args.base_fraction,
            prompt_kind=prompt_kind,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
        specs = build_workload(workload)
        result = await run_benchmark(
            client, specs, loads, warmup=args.warmup, slo=slo, progress=args.progress
        )
    report = to_json(
        result,
        base_url=args.base_url,
        endpoint=args.endpoint,
        workload=workload,
        digest=workload_digest(specs),
        slo=slo,
        command=command,
        models=models,
        client_options={
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "request_timeout_s": args.request_timeout,
            "warmup": args.warmup,
        },
        save_requests=args.save_requests,
    )
    markdown = to_markdown(report)
    print(markdown)
    if args.output_md:
        args.output_md.parent.mkdir(parents=True, exist_ok=True)
        args.output_md.write_text(markdown)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(report, args.plot)
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    command = "python -m loadgen " + shlex.join(argv)
    try:
        report = asyncio.run(amain(args, command))
    except (WarmupFailed, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # A run where nothing succeeded is a failure for scripts, though its report was written.
    return 0 if all(run["summary"]["completed"] for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
