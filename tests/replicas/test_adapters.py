"""Adapter files: validation with clear errors, slot pool and host cache rules."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from replicas.adapters import loader, safetensors_file
from replicas.adapters.host_cache import HostCache
from replicas.adapters.layout import check_adapter_files
from replicas.adapters.loader import load_adapter
from replicas.adapters.peft_config import AdapterError, read_adapter_config
from replicas.adapters.slot_pool import NoFreeSlot, SlotPool
from replicas.engine import RequestRejected
from replicas.errors import ErrorKind
from replicas.models.spec import ModelSpec
from replicas.request import Request
from tests.factories import hf_greedy, make_adapter
from tests.replicas.conftest import greedy, make_engine, run_to_completion
from tests.replicas.damaged_adapters import AT_ENGINE, AT_INGRESS, damage


@pytest.fixture(scope="module")
def good_adapter(models, tmp_path_factory):
    return make_adapter(
        models["llama"],
        tmp_path_factory.mktemp("good") / "good",
        rank=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        seed=1,
    )


def broken_copy(good, tmp_path, name):
    path = tmp_path / name
    shutil.copytree(good, path)
    return path


class TestValidation:
    def test_missing_folder_is_404(self, tmp_path):
        with pytest.raises(AdapterError, match="does not exist") as e:
            read_adapter_config(tmp_path / "nope", 16)
        assert e.value.kind is ErrorKind.NOT_FOUND

    def test_invalid_json_config(self, good_adapter, tmp_path):
        path = broken_copy(good_adapter, tmp_path, "badjson")
        (path / "adapter_config.json").write_text("{not json")
        with pytest.raises(AdapterError, match="not valid JSON") as e:
            read_adapter_config(path, 16)
        assert e.value.kind is ErrorKind.INVALID

    def test_rank_above_max(self, good_adapter):
        with pytest.raises(AdapterError, match="rank 8, above max_lora_rank 4"):
            read_adapter_config(good_adapter, 4)

    def test_pickle_only_weights_are_refused(self, good_adapter, tmp_path):
        path = broken_copy(good_adapter, tmp_path, "pickle")
        (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
        with pytest.raises(AdapterError, match="pickle"):
            read_adapter_config(path, 16)

    def test_unsupported_target(self, good_adapter, tmp_path):
        path = broken_copy(good_adapter, tmp_path, "embed")
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg["target_modules"] = ["q_proj", "embed_tokens"]
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(AdapterError, match="embed_tokens"):
            read_adapter_config(path, 16)

    @pytest.mark.parametrize("cut", [0, 40, -100])
    def test_truncated_or_corrupt_safetensors(self, models, good_adapter, tmp_path, cut):
        path = broken_copy(good_adapter, tmp_path, f"trunc{cut}")
        weights = path / "adapter_model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[:cut] if cut else b"\x00" * 64)
        spec = ModelSpec.from_dir(models["llama"])
        with pytest.raises(AdapterError, match="unreadable"):
            load_adapter("t", path, spec, 16)

    def test_unaligned_tensor_data_reads_the_same(self, models, good_adapter, tmp_path):
        """safetensors does not promise aligned data: a header one byte longer shifts every
        tensor to an odd offset, and the weights must still come out the same."""
        path = broken_copy(good_adapter, tmp_path, "unaligned")
        weights = path / "adapter_model.safetensors"
        data = weights.read_bytes()
        n = int.from_bytes(data[:8], "little")
        weights.write_bytes((n + 1).to_bytes(8, "little") + data[8 : 8 + n] + b" " + data[8 + n :])
        spec = ModelSpec.from_dir(models["llama"])
        want = load_adapter("g", good_adapter, spec, 16).modules
        got = load_adapter("u", path, spec, 16).modules
        assert got.keys() == want.keys()
        for key, (a, b) in want.items():
            assert torch.equal(got[key][0], a) and torch.equal(got[key][1], b)

    def test_a_file_larger_than_any_adapter_is_refused_unread(
        self, models, good_adapter, tmp_path, monkeypatch
    ):
        path = broken_copy(good_adapter, tmp_path, "huge")
        spec = ModelSpec.from_dir(models["llama"])
        limit = loader.max_file_bytes(spec, 16)
        with open(path / "adapter_model.safetensors", "r+b") as f:
            f.truncate(limit + 1)  # sparse: the header and weights, then a hole of zeros
        with monkeypatch.context() as patch:
            # reading it into memory would fail here
            patch.setattr(safetensors_file.np, "empty", None)
            with pytest.raises(AdapterError, match="too large.*embeddings"):
                load_adapter("t", path, spec, 16)
        with open(path / "adapter_model.safetensors", "r+b") as f:
            f.truncate(limit)  # at the limit: read, then refused for the bytes past the tensors
        with pytest.raises(AdapterError, match="follow the last tensor"):
            load_adapter("t", path, spec, 16)

    def test_a_file_read_in_ranges_gives_the_same_weights(self, models, good_adapter, monkeypatch):
        """Large files are read in ranges on several threads: the ranges must tile the file."""
        spec = ModelSpec.from_dir(models["llama"])
        want = load_adapter("g", good_adapter, spec, 16).modules
        size = (good_adapter / "adapter_model.safetensors").stat().st_size
        monkeypatch.setattr(safetensors_file, "HOST_THREADS", 8)
        # 5 ranges, the last short
        monkeypatch.setattr(safetensors_file, "READ_CHUNK", size // 5 + 3)
        got = load_adapter("g", good_adapter, spec, 16).modules
        assert got.keys() == want.keys()
        for key, (a, b) in want.items():
            assert torch.equal(got[key][0], a) and torch.equal(got[key][1], b)

    @pytest.mark.parametrize("damage", ["shape", "offsets", "entry"])
    def test_inconsistent_header_is_unreadable(self, models, good_adapter, tmp_path, damage):
        path = broken_copy(good_adapter, tmp_path, f"header-{damage}")
        weights = path / "adapter_model.safetensors"
        data = weights.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        key = next(k for k in header if k != "__metadata__")
        if damage == "shape":  # more elements than its bytes hold
            header[key]["shape"] = [header[key]["shape"][0] + 1, header[key]["shape"][1]]
        elif damage == "offsets":  # past the end of the file
            begin, end = header[key]["data_offsets"]
            header[key]["data_offsets"] = [begin, end + len(data)]
        else:
            del header[key]["data_offsets"]
        text = json.dumps(header).encode()
        weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
        with pytest.raises(AdapterError, match="unreadable"):
            load_adapter("h", path, ModelSpec.from_dir(models["llama"]), 16)

    def test_non_float_tensor_is_refused(self, models, good_adapter, tmp_path):
        path = broken_copy(good_adapter, tmp_path, "ints")
        weights = path / "adapter_model.safetensors"
        data = weights.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        key = next(k for k in header if k != "__metadata__")
        header[key]["dtype"] = {"F32": "I32", "BF16": "I16", "F16": "I16"}[header[key]["dtype"]]
        text = json.dumps(header).encode()
        weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
        with pytest.raises(AdapterError, match="not floating point"):
            load_adapter("i", path, ModelSpec.from_dir(models["llama"]), 16)

    def test_shapes_checked_against_the_model(self, models, good_adapter):
        with pytest.raises(
            AdapterError,
            match=r"q_proj.lora_B.weight' has shape \[64, 8\]; "
            r"expected \[128, 8\]",
        ):
            load_adapter("x", good_adapter, ModelSpec.from_dir(models["qwen3"]), 16)

    def test_corrupt_adapter_fails_its_request_only(self, models, good_adapter, tmp_path):
        bad = broken_copy(good_adapter, tmp_path, "corrupt")
        (bad / "adapter_model.safetensors").write_bytes(b"garbage")
        engine = make_engine(
            models["llama"], adapters=(("good", str(good_adapter)), ("bad", str(bad)))
        )
        prompt = [5, 6, 7, 8]
        results = run_to_completion(
            engine,
            [
                Request("b", prompt, greedy(4), "bad"),
                Request("g", prompt, greedy(4), "good"),
                Request("n", prompt, greedy(4)),
            ],
        )
        assert results["b"] == ([], "error")
        assert results["g"][0] == hf_greedy(models["llama"], prompt, 4, adapter_dir=good_adapter)
        assert results["n"][0] == hf_greedy(models["llama"], prompt, 4)
        assert engine.blocks.num_free == engine.blocks.num_blocks


class TestSlotPool:
    def test_held_and_pinned_adapters_are_never_evicted(self):
        pool = SlotPool(3)
        pool.assign("pinned", pinned=True)
        pool.assign("busy")
        pool.hold("busy")
        pool.assign("idle")
        moved = pool.assign("new")
        assert moved.evicted == "idle"
        pool.hold("new")
        with pytest.raises(NoFreeSlot):
            pool.assign("another")
        assert set(pool.resident) == {"pinned", "busy", "new"}

    def test_least_recently_used_goes_first(self):
        pool = SlotPool(2)
        pool.assign("a")
        pool.assign("b")
        pool.hold("a")
        pool.release("a")  # a is now the most recently used
        assert pool.assign("c").evicted == "b"

    def test_slots_never_shared(self):
        pool = SlotPool(4)
        for i in range(20):
            name = f"a{i}"
            pool.assign(name)
            if i % 3 == 0:
                pool.hold(name)
            slots = list(pool.resident.values())
            assert len(slots) == len(set(slots))
            if pool.num_held == 4:
                break

    def test_remove_refuses_held_adapter(self):
        pool = SlotPool(1)
        pool.assign("a")
        pool.hold("a")
        with pytest.raises(ValueError, match="held"):
            pool.remove("a")
        pool.release("a")
        pool.remove("a")
        assert pool.assign("b").slot == 0


def test_host_cache_evicts_lru_but_not_pinned():
    cache: HostCache[int] = HostCache(2)
    cache.put("p", 1, pinned=True)
    cache.put("a", 2)
    cache.get("p")
    assert cache.put("b", 3) == ["a"]
    assert "p" in cache and "b" in cache and len(cache) == 2


def test_host_cache_byte_budget():
    cache: HostCache[int] = HostCache(10, max_bytes=100, size=lambda v: v)
    cache.put("pinned", 30, pinned=True)
    cache.put("a", 30)
    cache.put("b", 30)
    assert cache.nbytes == 90
    assert cache.put("c", 30) == ["a"]  # the least recent unpinned entry goes
    assert cache.nbytes == 90
    assert cache.put("huge", 500) == ["b", "c"]  # kept alone over budget: a request needs it
    assert set(cache) == {"pinned", "huge"} and cache.nbytes == 530
    cache.put("huge", 20)  # replacing an entry counts its new size only
    assert cache.nbytes == 50
    cache.remove("huge")
    assert cache.nbytes == 30
    with pytest.raises(ValueError):
        HostCache(2, max_bytes=10)  # a byte budget without a size function


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        ("all-linear", 7),
        (r".*\.(q_proj|v_proj)", 2),
        (["q_proj", "k_proj"], 2),
    ],
)
def test_target_module_forms(good_adapter, tmp_path, targets, expected):
    path = broken_copy(good_adapter, tmp_path, "targets")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = targets
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    assert len(read_adapter_config(path, 16).target_modules) == expected


def test_targets_matching_nothing_are_refused(good_adapter, tmp_path):
    path = broken_copy(good_adapter, tmp_path, "nothing")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = r".*\.lm_head"
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="names none"):
        read_adapter_config(path, 16)


class TestEvictionPolicies:
    def _pool(self, policy):
        pool = SlotPool(2, policy)
        for name in ("popular", "once"):
            pool.assign(name)
        for _ in range(3):
            pool.hold("popular")
            pool.release("popular")
        pool.hold("once")
        pool.release("once")  # "once" is now the most recent, "popular" the most used
        return pool

    def test_lru_gives_up_the_least_recent(self):
        assert self._pool("lru").assign("new").evicted == "popular"

    def test_lfu_gives_up_the_least_used(self):
        assert self._pool("lfu").assign("new").evicted == "once"

    def test_no_policy_evicts_a_held_or_pinned_adapter(self):
        for policy in ("lru", "lfu"):
            pool = self._pool(policy)
            pool.hold("once")
            pool.set_pinned("popular", True)
            with pytest.raises(NoFreeSlot):
                pool.assign("new")

    def test_unknown_policy_is_refused(self):
        with pytest.raises(ValueError, match="eviction policy"):
            SlotPool(2, "random")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("eviction_policy", "random", "unknown eviction_policy"),
        ("max_loaded_lora_bytes", 0, "max_loaded_lora_bytes must be positive"),
        ("adapter_loading", "eager", "unknown adapter_loading"),
    ],
)
def test_engine_config_refuses_bad_adapter_settings(field, value, message):
    from replicas.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **{field: value})


def _peft_adapter(model_dir, out, **config):
    """An adapter written by PEFT itself with these LoraConfig arguments (r 8 unless given)."""
    from peft import LoraConfig, get_peft_model

    from tests.factories import _load_model, _quiet_peft

    config = {"r": 8, "lora_alpha": 16, "init_lora_weights": False, **config}
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(0)
        model = get_peft_model(_load_model(model_dir), LoraConfig(task_type="CAUSAL_LM", **config))
    model.save_pretrained(out, safe_serialization=True)
    return out


class TestLoadTimeChecks:
    """A load reads the weights file's header, never its tensors, and refuses (400, naming the
    tensor and what was expected) any file that disagrees with its config or the model."""

    @pytest.mark.parametrize("kind", sorted({**AT_INGRESS, **AT_ENGINE}))
    def test_a_bad_adapter_is_refused_at_load(
        self, models, good_adapter, tmp_path, kind, monkeypatch
    ):
        bad = damage(good_adapter, tmp_path / kind, kind)
        engine = make_engine(models["llama"])
        with monkeypatch.context() as patch:
            # reading tensor data would fail here
            patch.setattr(safetensors_file, "_read_bytes", None)
            with pytest.raises(RequestRejected) as e:
                engine.load_adapter("new", str(bad))
        assert e.value.kind is ErrorKind.INVALID
        assert {**AT_INGRESS, **AT_ENGINE}[kind] in str(e.value), str(e.value)
        with pytest.raises(RequestRejected) as e:
            engine.add_request(Request("r", [5, 6], greedy(1), "new"))
        assert e.value.kind is ErrorKind.NOT_FOUND
        engine.load_adapter("new", str(good_adapter))  # the name was never taken

    @pytest.mark.parametrize("kind", sorted(AT_INGRESS))
    def test_without_the_model_the_file_and_config_are_still_checked(
        self, good_adapter, tmp_path, kind
    ):
        bad = damage(good_adapter, tmp_path / kind, kind)
        with pytest.raises(AdapterError, match=re.escape(AT_INGRESS[kind])) as e:
            check_adapter_files("new", bad, 16)
        assert e.value.kind is ErrorKind.INVALID

    @pytest.mark.parametrize("kind", sorted(AT_ENGINE))
    def test_what_needs_the_model_is_left_to_the_engine(self, good_adapter, tmp_path, kind):
        check_adapter_files("new", damage(good_adapter, tmp_path / kind, kind), 16)

    @pytest.mark.parametrize(
        "config",
        [
            {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
            {"target_modules": r".*\.layers\.0\..*(k_proj|down_proj)"},
            {"target_modules": "all-linear", "exclude_modules": ["o_proj", "up_proj"]},
            {"target_modules": ["q_proj", "v_proj"], "rank_pattern": {"v_proj": 4}},
        ],
        ids=["layers_to_transform", "regex", "exclude_modules", "rank_pattern"],
    )
    def test_what_peft_writes_passes_and_loads_its_modules(self, models, tmp_path, config):
        path = _peft_adapter(models["llama"], tmp_path / "peft", **config)
        spec = ModelSpec.from_dir(models["llama"])
        check_adapter_files("p", path, 16, spec)
        keys = load_file(path / "adapter_model.safetensors").keys()
        want = {
            (int(k.split(".layers.")[1].split(".")[0]), k.split(".")[-3])
            for k in keys
            if ".lora_A." in k
        }
        assert set(load_adapter("p", path, spec, 16).modules) == want
