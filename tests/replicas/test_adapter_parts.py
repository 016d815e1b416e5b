"""The adapter reader and the name registry alone, without an engine: reads take turns and
land in the host cache, failures reach the request that asks, and names resolve, retire and
come back as documented."""

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from replicas.adapters.host_cache import HostCache
from replicas.adapters.peft_config import AdapterError
from replicas.adapters.policy import ReadTurns
from replicas.adapters.reader import AdapterReader
from replicas.adapters.registry import VersionRegistry
from replicas.adapters.stats import AdapterStats
from replicas.errors import ErrorKind
from replicas.scheduler import AdapterLoadError
from tests.factories import make_adapter


@dataclass(frozen=True)
class FakeWeights:
    name: str
    nbytes: int = 10


class FakeFiles:
    """`read_file` for the reader: each read waits for its gate; "bad" fails."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def __call__(self, adapter: str, path: Path) -> FakeWeights:
        self.started.append(adapter)
        assert self.gate(adapter).wait(30)
        if adapter == "bad":
            raise AdapterLoadError("adapter 'bad': corrupt file")
        return FakeWeights(adapter)


@pytest.fixture
def parts():
    files, failures = FakeFiles(), []
    reader = AdapterReader(
        files,
        HostCache(4),
        AdapterStats(),
        ReadTurns(workers=1),
        is_pinned=lambda name: False,
        on_failure=failures.append,
    )
    yield reader, files, failures
    for gate in files.gates.values():
        gate.set()
    reader.shutdown()


def collect(reader: AdapterReader, adapter: str) -> bool:
    deadline = time.monotonic() + 30
    while adapter in reader:
        assert time.monotonic() < deadline
        if reader.collect(adapter):
            return True
        time.sleep(0.001)
    return False


class TestReader:
    def test_a_collected_read_lands_in_the_host_cache_and_is_counted(self, parts):
        reader, files, _ = parts
        assert reader.start("a", Path("a"))
        assert not reader.collect("a")  # still reading
        files.gate("a").set()
        assert collect(reader, "a")
        assert reader.host.peek("a") == FakeWeights("a")
        assert reader.stats.disk_reads == 1 and len(reader.stats.read_seconds) == 1

    def test_reads_take_turns(self, parts):
        reader, files, _ = parts
        assert reader.start("a", Path("a"))
        assert not reader.start("b", Path("b"))  # a holds the only turn
        assert reader.start("a", Path("a"))  # already reading
        files.gate("a").set()
        assert collect(reader, "a")
        assert reader.start("b", Path("b"))
        assert reader.reading() == ["b"]

    def test_a_failed_read_is_told_once_to_whoever_asks(self, parts):
        reader, files, failures = parts
        reader.start("bad", Path("bad"))
        files.gate("bad").set()
        assert not collect(reader, "bad")
        assert failures == ["bad"] and reader.failed("bad")
        assert "corrupt" in reader.take_failure("bad")[0]
        assert reader.take_failure("bad") is None and reader.host.peek("bad") is None

    def test_a_dropped_read_is_never_collected(self, parts):
        reader, files, _ = parts
        reader.start("a", Path("a"))
        reader.drop("a")
        files.gate("a").set()
        assert "a" not in reader and not reader.collect("a")
        reader.collect_all()
        assert reader.host.peek("a") is None and reader.stats.disk_reads == 0

    def test_read_now_waits_for_the_read(self, parts):
        reader, files, _ = parts
        files.gate("a").set()
        reader.read_now("a", Path("a"))
        assert reader.host.peek("a") == FakeWeights("a") and reader.stats.disk_reads == 1


@pytest.fixture(scope="module")
def adapter_root(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("root")
    for name in ("r1", "r2"):
        make_adapter(models["llama"], root / name, rank=2, target_modules=["q_proj"])
    return root


class TestRegistry:
    def test_names_resolve_to_registered_folders_then_to_the_root(self, adapter_root):
        registry = VersionRegistry({"x": str(adapter_root / "r1")}, str(adapter_root), 8)
        assert registry.resolve("x").path == adapter_root / "r1"
        assert registry.resolve("r2").path == adapter_root / "r2"
        assert registry.served().adapters == {"x": str(adapter_root / "r1")}  # root not listed
        for name in ("missing", "../r1", ""):
            with pytest.raises(AdapterError) as e:
                registry.resolve(name)
            assert e.value.kind is ErrorKind.NOT_FOUND

    def test_unload_frees_the_name_at_once_and_a_reload_is_a_new_version(self, adapter_root):
        registry = VersionRegistry({"x": str(adapter_root / "r1")}, None, 8, pinned=("x",))
        old = registry.resolve("x")
        assert registry.is_pinned(old.key)
        registry.unregister("x")
        with pytest.raises(AdapterError) as e:
            registry.resolve("x")
        assert e.value.kind is ErrorKind.NOT_FOUND
        assert registry.path(old.key) == adapter_root / "r1"  # for the requests already queued
        assert not registry.is_pinned(old.key) and registry.is_retired(old.key)
        new = registry.register("x", adapter_root / "r2")  # while the old one is still in use
        assert new.key != old.key and registry.resolve("x") == new
        assert registry.name_of(new.key) == registry.name_of(old.key) == "x"
        registry.drop(old.key)
        with pytest.raises(AdapterError):
            registry.path(old.key)
        assert registry.keys() == {new.key}
        with pytest.raises(AdapterError, match="already loaded"):
            registry.register("x", adapter_root / "r1")  # the live name is taken

    def test_a_retired_version_is_unused_once_its_last_request_ends(self, adapter_root):
        registry = VersionRegistry({"x": str(adapter_root / "r1")}, None, 8)
        key = registry.resolve("x").key
        registry.refer(key)
        registry.refer(key)  # two requests on one version
        assert not registry.unrefer(key)  # live: never unused, whatever its count
        registry.refer(key)
        registry.unregister("x")
        assert registry.references(key) == 2
        assert not registry.unrefer(key)  # one request left on it
        assert registry.unrefer(key) and registry.references(key) == 0  # the last: drop it
        with pytest.raises(ValueError, match="more often"):
            registry.unrefer(key)

    def test_keys_stay_unique_when_names_look_like_versions(self, adapter_root):
        registry = VersionRegistry({"x": str(adapter_root / "r1")}, None, 8)
        registry.unregister("x")
        second = registry.register("x", adapter_root / "r2")  # "x" still held by the old one
        third = registry.register(second.key, adapter_root / "r1")  # a name equal to that key
        assert len({"x", second.key, third.key}) == 3
        assert registry.resolve(second.key) == third

    def test_unloading_a_root_folder_hides_it_until_registered_again(self, adapter_root):
        registry = VersionRegistry({}, str(adapter_root), 8)
        registry.unregister("r1")
        with pytest.raises(AdapterError):
            registry.resolve("r1")
        assert registry.served().unloaded == ("r1",)
        with pytest.raises(AdapterError) as e:
            registry.unregister("r1")
        assert e.value.kind is ErrorKind.NOT_FOUND
        registry.register("r1", adapter_root / "r1")
        assert registry.served().adapters == {"r1": str(adapter_root / "r1")}

    def test_a_rank_above_the_limit_is_refused_at_register(self, models, tmp_path):
        registry = VersionRegistry({}, None, max_lora_rank=4)
        path = make_adapter(models["llama"], tmp_path / "big", rank=8, target_modules=["q_proj"])
        with pytest.raises(AdapterError) as e:
            registry.register("big", path)
        assert e.value.kind is ErrorKind.INVALID and registry.keys() == set()
