"""App arguments and adapter folder validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.adapters import AdapterError, check_adapter_name, validate_adapter_dir
from app.config import DEMO_MODEL_NAME, AppArgs
from replicas.errors import ErrorKind
from tests.app.conftest import write_adapter


class TestAppArgs:
    def test_defaults_serve_the_demo(self):
        args = AppArgs()
        assert args.model is None
        assert args.base_model_name == DEMO_MODEL_NAME
        assert args.device == "auto"
        assert args.max_ongoing_requests >= 64

    def test_every_field_is_described(self):
        assert all(field.description for field in AppArgs.model_fields.values())

    def test_the_api_key_is_never_printed(self):
        args = AppArgs(api_key="sk-secret")
        assert "sk-secret" not in repr(args) and "sk-secret" not in str(args.model_dump())
        assert args.resolved_api_key() == "sk-secret"

    def test_the_api_key_falls_back_to_the_environment(self, monkeypatch):
        monkeypatch.setenv("LORAFLEET_API_KEY", "sk-env")
        assert AppArgs().resolved_api_key() == "sk-env"
        assert AppArgs(api_key="sk-arg").resolved_api_key() == "sk-arg"
        monkeypatch.setenv("LORAFLEET_API_KEY", "")
        assert AppArgs().resolved_api_key() is None

    def test_unknown_field_is_rejected_by_name(self):
        with pytest.raises(ValidationError, match="max_lora_rnak"):
            AppArgs.model_validate({"max_lora_rnak": 32})

    @pytest.mark.parametrize(
        ("fields", "words"),
        [
            ({"num_replicas": 0}, "num_replicas"),
            ({"device": "tpu"}, "device"),
            ({"dtype": "int8"}, "dtype"),
            ({"max_lora_rank": 0}, "max_lora_rank"),
            ({"max_model_len": 0}, "max_model_len"),
            ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
            ({"max_loras_per_batch": 8, "max_loaded_loras": 4}, "max_loaded_loras"),
            ({"model": "  "}, "non-empty"),
            ({"adapters": {"a/b": "/x"}}, "must not contain"),
            ({"adapters": {"": "/x"}}, "non-empty"),
            ({"adapters": {"ok": " "}}, "empty path"),
            ({"adapters": {DEMO_MODEL_NAME: "/x"}}, "base model"),
            ({"served_model_name": "mine", "adapters": {"mine": "/x"}}, "base model"),
            ({"model": "/m", "pinned_adapters": ["gone"]}, "not configured"),
            (
                {"model": "/m", "adapters": {"a": "/a"}, "pinned_adapters": ["a", "a"]},
                "more than once",
            ),
            (
                {
                    "adapters": {"a": "/a", "b": "/b"},
                    "pinned_adapters": ["a", "b"],
                    "max_loras_per_batch": 1,
                    "max_loaded_loras": 4,
                },
                "GPU slots",
            ),
            ({"adapter_loading": "prefetch", "enable_prefetch": False}, "contradicts"),
            ({"adapter_loading": "eager"}, "adapter_loading"),
            ({"runtime_adapter_dirs": [" "]}, "runtime_adapter_dirs"),
            ({"api_key": " "}, "api_key"),
            ({"max_request_body_bytes": 10}, "max_request_body_bytes"),
            ({"timed_steps": "/c.json", "device": "cuda"}, "device cpu"),
            ({"timed_steps": " "}, "non-empty"),
            ({"stream_interval_ms": -1}, "stream_interval_ms"),
        ],
    )
    def test_bad_values_are_rejected_with_a_message(self, fields, words):
        with pytest.raises(ValidationError, match=words):
            AppArgs.model_validate(fields)

    def test_args_are_frozen(self):
        with pytest.raises(ValidationError):
            AppArgs().num_replicas = 3

    def test_base_name_of_a_local_folder_and_a_hub_id(self, tmp_path):
        folder = tmp_path / "Llama-3-8B"
        folder.mkdir()
        assert AppArgs(model=str(folder)).base_model_name == "Llama-3-8B"
        assert AppArgs(model=f"{folder}/").base_model_name == "Llama-3-8B"
        assert AppArgs(model="org/some-model").base_model_name == "org/some-model"
        assert AppArgs(model="org/m", served_model_name="m").base_model_name == "m"

    def test_to_engine_config(self):
        args = AppArgs(
            adapters={"b": "/adapters/b", "a": "/adapters/a"},
            adapter_root="/adapters",
            max_lora_rank=32,
            max_num_seqs=8,
            dtype="bfloat16",
            max_model_len=512,
        )
        config = args.to_engine_config("/models/m", "cuda")
        assert (config.model, config.device, config.dtype) == ("/models/m", "cuda", "bfloat16")
        assert config.adapters == (("a", "/adapters/a"), ("b", "/adapters/b"))
        assert config.adapter_root == "/adapters"
        assert (config.max_lora_rank, config.max_num_seqs, config.max_model_len) == (32, 8, 512)
        assert config.max_loaded_loras == args.max_loaded_loras
        assert (config.adapter_loading, config.pinned_adapters) == ("prefetch", ())
        assert (config.enforce_eager, config.max_prefill_graph_tokens) == (False, 1024)
        graphs = AppArgs(enforce_eager=True, max_prefill_graph_tokens=0)
        config = graphs.to_engine_config("/models/m", "cuda")
        assert (config.enforce_eager, config.max_prefill_graph_tokens) == (True, 0)
        assert config.engine_process  # null: its own process on cuda, a thread on cpu
        assert not AppArgs().to_engine_config("/m", "cpu").engine_process
        assert AppArgs(engine_process=True).to_engine_config("/m", "cpu").engine_process
        assert not AppArgs(engine_process=False).to_engine_config("/m", "cuda").engine_process
        with pytest.raises(ValueError):
            AppArgs(max_prefill_graph_tokens=-1)
        assert config.stream_interval_s == 0.05 and config.timed_steps is None
        config = AppArgs(stream_interval_ms=0, timed_steps="/c.json").to_engine_config("/m", "cpu")
        assert (config.stream_interval_s, config.timed_steps) == (0.0, "/c.json")

    def test_each_replica_takes_its_share_of_a_proxys_chunks_within_its_own_cap(self):
        def budget(replicas: int = 1, **fields) -> float:
            config = AppArgs(**fields).to_engine_config("/m", "cuda", replicas)
            return config.max_stream_chunks_per_s

        assert budget() == 1000.0  # the replica's own cap, under a whole proxy's 4,000
        assert budget(4) == 1000.0 and budget(8) == 500.0  # a proxy's share, when less
        assert budget(4, max_proxy_chunks_per_s=6000, max_replica_chunks_per_s=0) == 1500.0
        assert budget(4, max_proxy_chunks_per_s=0) == 1000.0
        assert budget(4, max_proxy_chunks_per_s=0, max_replica_chunks_per_s=0) == 0  # uncapped
        assert budget(1, max_replica_chunks_per_s=2500) == 2500.0
        args = AppArgs()
        with pytest.raises(ValueError, match="replicas_per_proxy"):
            args.to_engine_config("/m", "cuda", 0)
        with pytest.raises(ValidationError, match="max_proxy_chunks_per_s"):
            AppArgs(max_proxy_chunks_per_s=-1)
        with pytest.raises(ValidationError, match="max_replica_chunks_per_s"):
            AppArgs(max_replica_chunks_per_s=-1)

    @pytest.mark.parametrize(
        ("fields", "mode"),
        [
            ({}, "prefetch"),
            ({"enable_prefetch": False}, "overlap"),
            ({"enable_prefetch": False, "adapter_loading": "blocking"}, "blocking"),
            ({"adapter_loading": "overlap"}, "overlap"),
        ],
    )
    def test_adapter_loading_mode(self, fields, mode):
        args = AppArgs.model_validate(fields)
        assert args.to_engine_config("/models/m", "cpu").adapter_loading == mode
        # Survives the round trip build_app makes.
        assert AppArgs.model_validate(args.model_dump()).loading_mode == mode

    def test_pinned_adapters_reach_the_engine(self):
        args = AppArgs(
            model="/models/m",
            adapters={"a": "/adapters/a", "b": "/adapters/b"},
            pinned_adapters=["b"],
        )
        assert args.to_engine_config("/models/m", "cuda").pinned_adapters == ("b",)


class TestAdapterNames:
    @pytest.mark.parametrize("name", ["sql-lora", "v1.2_x", "Ünïcode"])
    def test_good_names(self, name):
        check_adapter_name(name, "base")

    @pytest.mark.parametrize("name", ["", " ", "a/b", "a\\b", "base:x", ".hidden", "..", "base"])
    def test_bad_names(self, name):
        with pytest.raises(ValueError):
            check_adapter_name(name, "base")


class TestValidateAdapterDir:
    def test_valid_folder(self, lora_model_dir, tmp_path):
        path = write_adapter(lora_model_dir, tmp_path / "a", rank=8, target_modules=("q_proj",))
        info = validate_adapter_dir(path, max_lora_rank=16)
        assert (info.path, info.rank, info.target_modules) == (path, 8, ("q_proj",))

    def test_missing_folder_is_404(self, tmp_path):
        with pytest.raises(AdapterError) as e:
            validate_adapter_dir(tmp_path / "nope", 16)
        assert e.value.kind is ErrorKind.NOT_FOUND

    def _broken(self, lora_model_dir, tmp_path, **config_changes):
        path = write_adapter(lora_model_dir, tmp_path / "a")
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(config_changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
        return path

    @pytest.mark.parametrize(
        ("changes", "words"),
        [
            ({"r": 32}, "max_lora_rank"),
            ({"peft_type": "IA3"}, "LORA"),
            ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ],
    )
    def test_unservable_config_is_400(self, lora_model_dir, tmp_path, changes, words):
        path = self._broken(lora_model_dir, tmp_path, **changes)
        with pytest.raises(AdapterError, match=words) as e:
            validate_adapter_dir(path, 16)
        assert e.value.kind is ErrorKind.INVALID

    def test_pickle_weights_are_refused(self, lora_model_dir, tmp_path):
        path = write_adapter(lora_model_dir, tmp_path / "a")
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
        with pytest.raises(AdapterError, match="pickle") as e:
            validate_adapter_dir(path, 16)
        assert e.value.kind is ErrorKind.INVALID

    def test_the_ingress_checks_a_folder_without_torch(self, lora_model_dir, tmp_path):
        """The ingress imports, and checks a folder's config and weights header, without
        importing torch (the engine replicas' dependency, not the ingress's)."""
        path = write_adapter(lora_model_dir, tmp_path / "a", rank=8, target_modules=("q_proj",))
        bad = write_adapter(lora_model_dir, tmp_path / "b", rank=8, target_modules=("q_proj",))
        (bad / "adapter_model.safetensors").write_bytes(b"\x08" + bytes(7) + b"not json")
        code = f"""
import sys
import app.ingress
from app.adapters import AdapterError, validate_adapter_dir
from replicas.errors import ErrorKind
assert validate_adapter_dir({str(path)!r}, 16).rank == 8
try:
    validate_adapter_dir({str(bad)!r}, 16)
except AdapterError as e:
    assert "unreadable" in str(e) and e.kind is ErrorKind.INVALID, e
else:
    raise AssertionError("a damaged weights file passed")
assert "torch" not in sys.modules, "torch imported"
"""
        root = Path(__file__).resolve().parents[2]
        subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("name", ["config.yaml", "gpu-llama3-8b.yaml"])
def test_shipped_serve_configs_parse(name):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from app.main import CONTROLLER_OPTIONS

    path = Path(__file__).parents[2] / "configs" / name
    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    # What `serve run` gives the controller and proxy is what the benchmarks and tests start.
    assert config["controller_options"] == CONTROLLER_OPTIONS
    (application,) = config["applications"]
    assert application["import_path"] == "app.main:build_app"
    AppArgs.model_validate(application["args"])
