"""`build_app`: what it binds, for a local model and for the demo. No Ray cluster is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import app.demo
from app.api import ApiSettings
from app.demo import DemoAssets
from app.main import REPLICA_ENV, build_app, replicas_per_proxy, resolve_device
from replicas.config import EngineConfig
from tests.app.conftest import write_adapter

TINY_CONFIG = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
}


def bound(application):
    """(ingress deployment, its init args, engine deployment, its init args and kwargs)."""
    ingress = application._bound_deployment
    engine_app, settings, model_dir = ingress.init_args
    engine = engine_app._bound_deployment
    return ingress, settings, model_dir, engine, engine.init_args, engine.init_kwargs


@pytest.fixture
def model_dir(tmp_path) -> Path:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder


class TestBuildApp:
    def test_local_model_with_adapters(self, model_dir, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        write_adapter(model_dir, tmp_path / "sql")
        args = {
            "model": str(model_dir),
            "adapters": {"sql": "sql"},  # relative to the working directory
            "adapter_root": "/shared/adapters",
            "device": "cpu",
            "num_replicas": 3,
            "max_ongoing_requests": 100,
        }
        ingress, settings, ingress_model_dir, engine, engine_args, engine_kwargs = bound(
            build_app(args)
        )
        (config,) = engine_args
        assert isinstance(config, EngineConfig)
        assert config.model == str(model_dir) == ingress_model_dir
        assert config.device == "cpu"
        assert config.adapters == (("sql", str(tmp_path / "sql")),)
        assert config.adapter_root == "/shared/adapters"
        assert engine_kwargs == {"prepare": None}
        assert engine.num_replicas == 3
        assert engine.max_ongoing_requests == 100
        assert "num_gpus" not in (engine.ray_actor_options or {})
        # The ingress logs each HTTP request; the engine's calls are not logged again.
        assert engine.logging_config["enable_access_log"] is False
        assert ingress.logging_config is None or ingress.logging_config["enable_access_log"]
        assert isinstance(settings, ApiSettings)
        assert settings.served_model_name == "my-model"
        assert settings.adapters == {"sql": str(tmp_path / "sql")}
        assert ingress.max_ongoing_requests >= 300
        assert ingress.num_replicas == 1  # on CPU, unless set

    def test_replicas_start_with_serves_fast_path_unless_the_environment_says(
        self, model_dir, monkeypatch
    ):
        from app.main import REPLICA_ENV

        user_thread = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
        monkeypatch.delenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", raising=False)
        monkeypatch.delenv(user_thread, raising=False)
        ingress, *_, engine, _, _ = bound(build_app({"model": str(model_dir)}))
        assert engine.ray_actor_options["runtime_env"]["env_vars"] == REPLICA_ENV
        assert ingress.ray_actor_options["runtime_env"]["env_vars"] == REPLICA_ENV
        assert REPLICA_ENV["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
        # Every replica's user code runs on its main loop.
        assert REPLICA_ENV[user_thread] == "0"
        monkeypatch.setenv("RAY_SERVE_USE_GRPC_BY_DEFAULT", "0")  # the user's choice stays
        monkeypatch.setenv(user_thread, "1")
        ingress, *_, engine, _, _ = bound(build_app({"model": str(model_dir)}))
        for replica in (ingress, engine):
            env = replica.ray_actor_options["runtime_env"]["env_vars"]
            assert "RAY_SERVE_USE_GRPC_BY_DEFAULT" not in env and user_thread not in env

    def test_timed_steps_run_on_cpu_from_an_absolute_path(self, model_dir, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ValueError, match="calibration.json is not a step calibration"):
            build_app({"model": str(model_dir), "timed_steps": "calibration.json"})
        step = {"base_s": 0.006, "per_seq_s": 2e-5, "per_adapter_s": 1e-5, "prefill_token_s": 2e-5}
        (tmp_path / "calibration.json").write_text(json.dumps({"step": step}))
        *_, engine, engine_args, _ = bound(
            build_app({"model": str(model_dir), "timed_steps": "calibration.json"})
        )
        assert engine_args[0].timed_steps == str(tmp_path / "calibration.json")
        assert engine_args[0].device == "cpu" and "num_gpus" not in engine.ray_actor_options

    def test_cuda_engine_replicas_get_a_gpu_each(self, model_dir):
        args = {"model": str(model_dir), "device": "cuda", "num_replicas": 3}
        ingress, *_, engine, engine_args, _ = bound(build_app(args))
        assert engine.ray_actor_options["num_gpus"] == 1
        assert ingress.num_replicas == 6  # two ingress replicas per GPU unless set
        assert bound(build_app({**args, "num_ingress_replicas": 1}))[0].num_replicas == 1
        assert engine_args[0].device == "cuda"

    def test_invalid_adapter_fails_the_build_naming_it(self, model_dir, tmp_path):
        write_adapter(model_dir, tmp_path / "big", rank=64)
        args = {
            "model": str(model_dir),
            "adapters": {"big": str(tmp_path / "big"), "gone": str(tmp_path / "gone")},
        }
        with pytest.raises(ValueError) as e:
            build_app(args)
        assert "'big'" in str(e.value) and "max_lora_rank" in str(e.value)
        assert "'gone'" in str(e.value) and "does not exist" in str(e.value)

    def test_missing_model_folder_fails_the_build(self, tmp_path):
        with pytest.raises(ValueError, match="config.json"):
            build_app({"model": str(tmp_path / "nowhere")})

    def test_demo_serves_its_adapters_and_prepares_every_node(
        self, model_dir, tmp_path, monkeypatch
    ):
        demo_adapter = write_adapter(model_dir, tmp_path / "demo-sql")
        mine = write_adapter(model_dir, tmp_path / "mine")
        calls = []

        def fake_ensure_demo(cache_dir):
            calls.append(cache_dir)
            return DemoAssets(model_dir=model_dir, adapters={"demo-sql": demo_adapter})

        monkeypatch.setattr(app.demo, "ensure_demo", fake_ensure_demo)
        args = {"demo_cache_dir": str(tmp_path / "cache"), "adapters": {"mine": str(mine)}}
        _, settings, _, _, engine_args, engine_kwargs = bound(build_app(args))
        assert settings.served_model_name == "lorafleet-demo"
        assert set(settings.adapters) == {"demo-sql", "mine"}
        assert dict(engine_args[0].adapters) == settings.adapters
        # The replicas' prepare builds the demo at the very path the builder chose.
        calls.clear()
        engine_kwargs["prepare"]()
        assert calls == [tmp_path / "cache"]
        # Run-time loads: only from the demo's own adapters folder, unless configured.
        assert settings.runtime_adapter_dirs == (str(model_dir.parent / "adapters"),)
        args["runtime_adapter_dirs"] = [str(tmp_path / "mine")]
        _, settings, *_ = bound(build_app(args))
        assert settings.runtime_adapter_dirs == (str(tmp_path / "mine"),)

    def test_pinning_a_demo_adapter_is_checked_after_merging(
        self, model_dir, tmp_path, monkeypatch
    ):
        demo_adapter = write_adapter(model_dir, tmp_path / "demo-sql")
        monkeypatch.setattr(
            app.demo,
            "ensure_demo",
            lambda cache_dir: DemoAssets(model_dir=model_dir, adapters={"demo-sql": demo_adapter}),
        )
        args = {"demo_cache_dir": str(tmp_path / "cache"), "device": "cpu"}
        *_, engine_args, _ = bound(build_app({**args, "pinned_adapters": ["demo-sql"]}))
        assert engine_args[0].pinned_adapters == ("demo-sql",)
        with pytest.raises(ValueError, match="not configured"):
            build_app({**args, "pinned_adapters": ["demo-nope"]})


class TestSecuritySettings:
    def test_by_default_loading_is_off_no_key_and_the_body_limit_follows_the_context(
        self, model_dir, monkeypatch
    ):
        monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
        _, settings, *_ = bound(build_app({"model": str(model_dir), "max_model_len": 4096}))
        assert settings.runtime_adapter_dirs == ()
        assert settings.api_key is None
        assert settings.body_limit == 2**20 + 32 * 4096

    def test_folders_are_made_absolute_and_the_limit_is_kept(
        self, model_dir, tmp_path, monkeypatch
    ):
        monkeypatch.chdir(tmp_path)
        args = {
            "model": str(model_dir),
            "runtime_adapter_dirs": ["adapters", "/srv/adapters"],
            "max_request_body_bytes": 5000,
        }
        _, settings, *_ = bound(build_app(args))
        assert settings.runtime_adapter_dirs == (str(tmp_path / "adapters"), "/srv/adapters")
        assert settings.body_limit == 5000

    def test_the_key_comes_from_the_arg_else_the_environment_and_is_never_shown(
        self, model_dir, monkeypatch
    ):
        monkeypatch.setenv("LORAFLEET_API_KEY", "from-env")
        _, settings, *_ = bound(build_app({"model": str(model_dir)}))
        assert settings.api_key == "from-env"
        _, settings, *_ = bound(build_app({"model": str(model_dir), "api_key": "from-arg"}))
        assert settings.api_key == "from-arg"
        assert "from-arg" not in repr(settings)


def test_explicit_device_is_kept():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("cuda") == "cuda"


def test_replicas_share_a_proxy_by_the_gpus_of_a_node(monkeypatch):
    import ray

    assert replicas_per_proxy(6, "cpu") == 6  # CPU replicas may all land on one node
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert replicas_per_proxy(6, "cuda") == 6  # no cluster to ask: the most that could share
    nodes = [
        {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 4.0}},
        {"Alive": True, "Resources": {"CPU": 8.0}},  # a head without GPUs
        {"Alive": False, "Resources": {"GPU": 8.0}},  # a dead node does not count
    ]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert replicas_per_proxy(6, "cuda") == 4  # one a GPU: at most a node's four share
    assert replicas_per_proxy(2, "cuda") == 2


class TestRouterConfig:
    """The engine deployment's request router follows `router`, and the affinity router sends
    prefetch hints only when asked to and when the engines prefetch."""

    def _config(self, **kw):
        from app.config import AppArgs
        from app.main import request_router_config

        return request_router_config(AppArgs(**kw))

    def test_pow2_is_rays_default_router(self):
        import importlib

        from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

        module, _, name = self._config(router="pow2")["request_router_class"].partition(":")
        router = getattr(importlib.import_module(module), name)
        assert issubclass(router, PowerOfTwoChoicesRequestRouter)

    def test_affinity_hints_follow_the_arg_and_the_loading_mode(self):
        kwargs = lambda **kw: self._config(router="affinity", **kw)["request_router_kwargs"]
        assert kwargs()["prefetch_hints"] is False  # off unless asked for
        assert kwargs(router_prefetch_hints=True)["prefetch_hints"] is True
        assert (
            kwargs(router_prefetch_hints=True, adapter_loading="overlap")["prefetch_hints"] is False
        )


def test_load_format_reaches_the_engine(tmp_path):
    from app.config import AppArgs

    config = AppArgs(load_format="dummy").to_engine_config(tmp_path, "cpu")
    assert config.load_format == "dummy"
    assert AppArgs().to_engine_config(tmp_path, "cpu").load_format == "safetensors"
    with pytest.raises(ValueError):
        AppArgs(load_format="pickle")


def test_host_cache_byte_budget_reaches_the_engine(tmp_path):
    from app.config import AppArgs

    assert AppArgs().to_engine_config(tmp_path, "cpu").max_loaded_lora_bytes is None
    config = AppArgs(max_loaded_lora_gib=1.5).to_engine_config(tmp_path, "cpu")
    assert config.max_loaded_lora_bytes == 3 * 2**29
    with pytest.raises(ValueError):
        AppArgs(max_loaded_lora_gib=0)


@pytest.mark.parametrize("grpc_on", [True, False])
def test_the_ingress_calls_the_engine_over_grpc_when_its_replicas_are_set_to(
    monkeypatch, grpc_on
):
    """The engine's handle reaches the ingress with the transport of the process that made it
    (the driver's: actor calls); the ingress takes gRPC itself when REPLICA_ENV asks for it."""
    import ray.serve._private.constants as serve_constants

    from app.ingress import engine_handle

    class Handle:
        def __init__(self) -> None:
            self.options_given: list[dict] = []

        def options(self, **kwargs):
            self.options_given.append(kwargs)
            return self

    monkeypatch.setattr(serve_constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc_on)
    handle = Handle()
    assert engine_handle(handle) is handle  # type: ignore[arg-type]
    assert handle.options_given == ([{"_by_reference": False}] if grpc_on else [])
    assert REPLICA_ENV["RAY_SERVE_USE_GRPC_BY_DEFAULT"] == "1"
