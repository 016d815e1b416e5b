"""The application builder named by the Serve config: `import_path: app.main:build_app`.

`build_app(args)` validates the arguments, finds the model (a local folder, a hub id, or the
embedded demo), checks every configured adapter folder, resolves the device and binds two
deployments: the HTTP `Ingress` (CPU) and the engine replicas (one GPU each on cuda).

Replicas may land on other nodes than the one that builds the app, so each one first runs a
`prepare` callable that makes sure the model files exist on its node at the path this builder
chose (building the demo there, or downloading the hub snapshot).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.adapters import AdapterError, validate_adapter_dir
from app.api import ApiSettings
from app.config import AppArgs, check_pinned, looks_like_local_path
from app.hub import pin_configured_adapters
from app.ingress import Ingress
from replicas import hop_log
from replicas.adapters.hub import HUB_SCHEME, HubAccess
from replicas.step_cost import load_step_cost

if TYPE_CHECKING:
    from ray.serve import Application

logger = logging.getLogger("ray.serve")

# What a model folder needs for the engine and the tokenizer; no pickle weights.
HUB_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


@dataclass(frozen=True)
class ModelSource:
    """Where the base model will be on every node, and how a node makes sure it is there."""

    model_dir: Path
    root: str  # what /v1/models reports as the base model's origin
    prepare: Callable[[], object] | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # adapters that come with the model
    # Where /v1/load_lora_adapter may load from when runtime_adapter_dirs is not set.
    runtime_adapter_dirs: tuple[str, ...] = ()


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The Serve application for `args` (the YAML's `args:` block, or an `AppArgs`)."""
    from replicas.deployment import EngineDeployment

    given = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    source = resolve_model(given)
    # Validated again with the model's own adapters merged in (configured ones win on a name
    # clash) and every path absolute: replicas do not share the builder's working directory.
    adapters = {**source.adapters, **given.adapters}
    hub = HubAccess.from_env(given.hub_timeout_s, given.max_hub_adapter_bytes)
    args = AppArgs.model_validate(
        {
            **given.model_dump(),
            "served_model_name": given.base_model_name,
            # Hub ids pinned to a commit here: every replica serves the same weights.
            "adapters": pin_configured_adapters(adapters, given.max_lora_rank, hub),
            "adapter_root": _absolute(given.adapter_root) if given.adapter_root else None,
            "timed_steps": _absolute(given.timed_steps) if given.timed_steps else None,
            "runtime_adapter_dirs": [
                _absolute(folder)
                for folder in given.runtime_adapter_dirs or source.runtime_adapter_dirs
            ],
        }
    )
    check_adapters(args.adapters, args.max_lora_rank)
    check_pinned(args.pinned_adapters, args.adapters)
    if args.timed_steps is not None:
        load_step_cost(args.timed_steps)  # a bad file fails the build, not every replica start
    device = "cpu" if args.timed_steps is not None else resolve_device(args.device)
    logger.info(
        "serving %s from %s on %s with %d adapter(s)",
        args.base_model_name,
        source.model_dir,
        device,
        len(args.adapters),
    )

    engine_options: dict[str, Any] = {
        "num_replicas": args.num_replicas,
        "max_ongoing_requests": args.max_ongoing_requests,
        "request_router_config": request_router_config(args),
        # No access line a call: each HTTP request has its own from the ingress, and an engine
        # call's line (two log writes, to file and stderr, then shipped to the driver) cost the
        # engine replica about 2% of its CPU a request. Failed calls are still logged.
        "logging_config": {"enable_access_log": False},
    }
    actor_options: dict[str, Any] = {"runtime_env": {"env_vars": replica_env()}}
    if device == "cuda":
        actor_options["num_gpus"] = 1
    engine_options["ray_actor_options"] = actor_options
    # @serve.deployment returns a Deployment; Ray's typing keeps the decorated class.
    engine = EngineDeployment.options(**engine_options).bind(  # type: ignore[attr-defined]
        args.to_engine_config(
            source.model_dir, device, replicas_per_proxy(args.num_replicas, device)
        ),
        prepare=source.prepare,
    )
    settings = ApiSettings(
        served_model_name=args.base_model_name,
        model_root=source.root,
        adapters=dict(args.adapters),
        adapter_root=args.adapter_root,
        max_lora_rank=args.max_lora_rank,
        runtime_adapter_dirs=tuple(args.runtime_adapter_dirs),
        hub_adapter_repos=tuple(args.hub_adapter_repos),
        hub_timeout_s=args.hub_timeout_s,
        max_hub_adapter_bytes=args.max_hub_adapter_bytes,
        api_key=args.resolved_api_key(),
        max_model_len=args.max_model_len,
        max_request_body_bytes=args.max_request_body_bytes,
    )
    # The ingress only streams; it should never be what limits the fleet's concurrency.
    return Ingress.options(  # type: ignore[attr-defined]  # a Deployment, as above
        ray_actor_options={"runtime_env": {"env_vars": replica_env()}},
        num_replicas=args.ingress_replicas(device),
        max_ongoing_requests=args.max_ongoing_requests * args.num_replicas,
    ).bind(engine, settings, str(source.model_dir), prepare=source.prepare)


# Serve's HAProxy mode, read by the controller and by each replica (an ingress replica then
# takes HTTP itself): see PROXY_ENV.
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}

# Ray Serve settings each replica reads at start (the part of RAY_SERVE_THROUGHPUT_OPTIMIZED=1
# a replica's environment can carry; the proxy and controller read theirs from the environment
# `serve run` starts in): calls between replicas go over gRPC, the garbage collector is frozen
# after start, and user code runs on the replica's main loop, with its HTTP server (an
# ingress's) and Ray's calls: no hop between two loops for each request, chunk and channel
# batch. No replica's user code blocks its loop (prompts are tokenized, ledgers and Ray's GCS
# read on worker threads; the engine's work is on its own thread or process). On the 2-core CPU
# the engines' main loop took 1.6-2 ms off the timed seeds TTFT P50 and 7 µs a token off their
# CPU (docs/perf/serving.md). Before the ingress called its engines over gRPC, a killed ingress
# stalled an engine's main loop for about 2 s; its streams now close with it.
REPLICA_ENV = {
    **HAPROXY_ENV,
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


# The hub the builder pinned adapters on is the one replicas download them from. HF_TOKEN is not
# passed (the runtime environment is shown on the dashboard): set it on every node.
HUB_ENV = ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME")
# Passed on as the builder has them too: a diagnostic run's per-request hop log
# (`replicas.hop_log`).
PASSED_ENV = (*HUB_ENV, hop_log.ENV)


# The controller's and proxy's part (the proxy is started by the controller and inherits its
# environment): `controller_options` in configs/*.yaml, and `CONTROLLER_OPTIONS` for code that
# starts Serve itself. HAProxy takes HTTP and balances each connection onto an ingress replica's
# own HTTP server (half the host CPU a token, and no queue in Serve's Python proxy when a burst
# arrives: docs/perf/serving.md, "HAProxy in front of the ingresses"); an ingress replica that
# stops stays reachable 5 s (Ray's default 30 s) so HAProxy drops it first. Serve's proxy stays
# as HAProxy's fallback: it sends each HTTP request to an ingress over gRPC and runs its router
# on its own loop; access logs are written in batches (an error at once). What that saved:
# docs/perf/serving.md, "The proxy over gRPC".
# A name the environment starting Serve sets is left to it (e.g. a diagnostic run's
# `RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1`, each access line at once).
PROXY_ENV = {
    name: value
    for name, value in {
        **HAPROXY_ENV,
        "RAY_SERVE_PROXY_USE_GRPC": "1",
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
        "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    }.items()
    if name not in os.environ
}
CONTROLLER_OPTIONS = {"runtime_env": {"env_vars": PROXY_ENV}}


def replica_env() -> dict[str, str]:
    """Every replica's environment: REPLICA_ENV, less what the environment building the app
    already sets (a user's choice), plus the builder's hub settings and hop log (PASSED_ENV)
    where set."""
    env = {name: value for name, value in REPLICA_ENV.items() if name not in os.environ}
    return env | {name: os.environ[name] for name in PASSED_ENV if os.environ.get(name)}


# Ray Serve's own router: power of two choices, preferring replicas that report the request's
# multiplexed model id (the engine reports its GPU-resident adapters); channels pinned.
POW2_ROUTER = "router.serve_router:Pow2Router"
AFFINITY_ROUTER = "router.serve_router:AffinityRequestRouter"
ROUTING_STATS_PERIOD_S = 0.5  # how often Serve's controller polls each replica's residency


def request_router_config(args: AppArgs) -> dict[str, Any]:
    """The engine deployment's `request_router_config` for `args.router`. Affinity routing sends
    prefetch hints when asked to and the engines prefetch (otherwise nothing would act on them)."""
    if args.router == "pow2":
        return {"request_router_class": POW2_ROUTER}
    return {
        "request_router_class": AFFINITY_ROUTER,
        "request_router_kwargs": {
            "prefetch_hints": args.router_prefetch_hints and args.loading_mode == "prefetch",
            "num_slots": args.max_loras_per_batch,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": 2.0,
    }


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def resolve_model(args: AppArgs) -> ModelSource:
    """The embedded demo (model null), a local folder, or a hub id."""
    if args.model is None:
        from app.demo import default_cache_dir, ensure_demo

        cache = Path(args.demo_cache_dir) if args.demo_cache_dir else default_cache_dir()
        cache = cache.expanduser().absolute()
        assets = ensure_demo(cache)
        return ModelSource(
            model_dir=assets.model_dir,
            root=str(assets.model_dir),
            prepare=functools.partial(ensure_demo, cache),
            adapters={name: str(path) for name, path in assets.adapters.items()},
            # Only the demo's own adapters: loading one under a new name shows the route.
            runtime_adapter_dirs=(str(assets.adapters_dir),),
        )
    if looks_like_local_path(args.model):
        model_dir = Path(args.model).expanduser().absolute()
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"model folder {str(model_dir)!r} does not exist or has no config.json"
            )
        return ModelSource(model_dir=model_dir, root=str(model_dir))
    return _hub_source(args.model)


def _hub_source(repo_id: str) -> ModelSource:
    """A hub model, pinned to its current commit so every node downloads the same files to the
    same path (the Hugging Face cache must sit at the same place on every node)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name

    revision = HfApi().model_info(repo_id).sha
    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    model_dir = Path(constants.HF_HUB_CACHE) / folder / "snapshots" / str(revision)
    return ModelSource(
        model_dir=model_dir,
        root=repo_id,
        prepare=functools.partial(download_model, repo_id, revision),
    )


def download_model(repo_id: str, revision: str | None) -> str:
    """Download (or find in the cache) a hub model's config, tokenizer and safetensors."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_PATTERNS))


def check_adapters(adapters: dict[str, str], max_lora_rank: int) -> None:
    """Validate every configured adapter folder; raise ValueError naming the bad ones."""
    problems = []
    for name, path in sorted(adapters.items()):
        if path.startswith(HUB_SCHEME):
            continue  # pinned and checked against the hub already (pin_configured_adapters)
        try:
            validate_adapter_dir(path, max_lora_rank)
        except AdapterError as e:
            problems.append(f"adapter {name!r}: {e}")
    if problems:
        raise ValueError("invalid adapters in the app config:\n  " + "\n  ".join(problems))


def resolve_device(device: str) -> str:
    """`auto` -> "cuda" when the Ray cluster (or, without Ray, this machine) has a GPU."""
    if device != "auto":
        return device
    return "cuda" if _has_gpu() else "cpu"


def replicas_per_proxy(num_replicas: int, device: str) -> int:
    """How many engine replicas may share one node's Serve proxy: on cuda one a GPU, so at
    most the GPUs of the Ray cluster's largest node; on CPU (or without Ray) all of them."""
    import ray

    if device != "cuda" or not ray.is_initialized():
        return num_replicas
    gpus = [node["Resources"].get("GPU", 0) for node in ray.nodes() if node.get("Alive")]
    return max(1, min(num_replicas, int(max(gpus, default=num_replicas))))


def _has_gpu() -> bool:
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
