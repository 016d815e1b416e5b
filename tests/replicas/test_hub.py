"""Hub adapters through the real `huggingface_hub` client against a local hub (tests/hub_server):
pinning and checking (`inspect`), downloading, and the engine's download tier above disk."""

from __future__ import annotations

import json
import socket
import time

import pytest

from replicas.adapters.hub import HubAccess, HubError, HubRef, download, inspect
from replicas.errors import ErrorKind
from replicas.request import Request
from tests.factories import hf_greedy, make_adapter, make_model
from tests.hub_server import FakeHub
from tests.replicas.conftest import greedy, make_engine

PROMPT = [5, 17, 200, 33, 98, 4]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def local(models, tmp_path_factory):
    """Adapter folders written by PEFT, and one for another model's shapes."""
    root = tmp_path_factory.mktemp("hub-adapters")
    other_model = make_model(root / "other", hidden_size=32, intermediate_size=64)
    return {
        "sql": make_adapter(models["llama"], root / "sql", rank=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj"], seed=21),
        "chat": make_adapter(models["llama"], root / "chat", rank=8, lora_alpha=16, seed=22),
        "other": make_adapter(other_model, root / "other-ad", rank=4, seed=23),
    }  # fmt: skip


@pytest.fixture
def hub(local):
    server = FakeHub().start()
    server.shas = {
        "sql": server.push_folder("org/sql-lora", local["sql"]),
        "private": server.push_folder("org/private-lora", local["sql"], private_token="hf_secret"),
        "other": server.push_folder("org/other-lora", local["other"]),
    }
    yield server
    server.stop()


@pytest.fixture
def access(hub, tmp_path):
    return HubAccess(endpoint=hub.url, cache_dir=str(tmp_path / "hf-cache"), timeout_s=5.0)


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


class TestNames:
    def test_hf_and_plain_ids_parse_alike(self):
        assert HubRef.parse("hf://org/x@v1") == HubRef.parse("org/x@v1") == HubRef("org/x", "v1")
        assert str(HubRef.parse("org/x")) == "hf://org/x" and not HubRef("org/x").pinned
        assert HubRef("org/x", "a" * 40).pinned

    @pytest.mark.parametrize("text", ["x", "org/", "/x", "a/b/c", "org/x@", "org/../x", "o--/x"])
    def test_malformed_ids_are_refused(self, text):
        with pytest.raises(ValueError):
            HubRef.parse(text)


class TestInspect:
    def test_pins_the_default_branch_and_reads_the_config(self, hub, access):
        adapter = inspect(HubRef.parse("org/sql-lora"), access, max_lora_rank=16)
        assert adapter.ref == HubRef("org/sql-lora", hub.shas["sql"])
        assert adapter.rank == 4 and set(adapter.config.target_modules) == {"q_proj", "v_proj"}

    def test_a_branch_or_tag_pins_to_its_commit_and_a_later_push_changes_no_pin(self, hub, access,
                                                                              local):
        first = inspect(HubRef("org/sql-lora", "main"), access, 16).ref
        newer = hub.push_folder("org/sql-lora", local["chat"])
        assert first.revision == hub.shas["sql"] != newer
        assert inspect(HubRef("org/sql-lora", hub.shas["sql"]), access, 16).ref == first
        assert inspect(HubRef("org/sql-lora"), access, 16).ref.revision == newer

    @pytest.mark.parametrize("ref", [HubRef("org/nothing"), HubRef("org/sql-lora", "no-such")])
    def test_an_unknown_repo_or_revision_is_404(self, hub, access, ref):
        with pytest.raises(HubError) as e:
            inspect(ref, access, 16)
        assert e.value.kind is ErrorKind.NOT_FOUND and ref.repo_id in str(e.value)

    def test_a_private_repo_needs_the_token(self, hub, access, monkeypatch):
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/private-lora"), access, 16)
        assert e.value.kind is ErrorKind.NOT_FOUND and "HF_TOKEN" in str(e.value)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert inspect(HubRef("org/private-lora"), access, 16).ref.pinned

    @pytest.mark.parametrize(
        ("files", "reason"),
        [
            ({"config.json": b"{}", "model.safetensors": b"x"}, "no adapter_config.json"),
            ({"adapter_config.json": b"{}", "adapter_model.bin": b"x"}, "pickle"),
            ({"adapter_config.json": b"{}"}, "no adapter_model.safetensors"),
            ({"adapter_config.json": b"{oops", "adapter_model.safetensors": b"x"}, "not valid"),
            ({"adapter_config.json": json.dumps({"r": 64, "target_modules": ["q_proj"]}).encode(),
              "adapter_model.safetensors": b"x"}, "above max_lora_rank"),
        ],
    )  # fmt: skip
    def test_a_repo_that_is_not_a_servable_adapter_is_400_with_the_reason(
        self, hub, access, files, reason
    ):
        hub.push("org/not-an-adapter", files)
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/not-an-adapter"), access, max_lora_rank=16)
        assert e.value.kind is ErrorKind.INVALID and reason in str(e.value)
        assert access.cache_dir not in str(e.value)  # the hub's name, never the cache's path
        assert "hf://org/not-an-adapter" in str(e.value)

    def test_weights_above_the_size_cap_are_refused_before_download(self, hub, access):
        small = HubAccess(access.endpoint, access.cache_dir, timeout_s=5.0, max_bytes=1000)
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/sql-lora"), small, 16)
        assert e.value.kind is ErrorKind.INVALID and "max_hub_adapter_gib" in str(e.value)
        assert hub.requests["get"] == 0

    def test_an_unreachable_hub_is_503(self, access):
        with socket.socket() as s:  # a port nothing listens on once closed
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        gone = HubAccess(f"http://127.0.0.1:{port}", access.cache_dir, timeout_s=1.0)
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/sql-lora"), gone, 16)
        assert e.value.kind is ErrorKind.UNAVAILABLE and "127.0.0.1" not in str(e.value)

    def test_a_hub_that_does_not_answer_is_503_within_the_timeout(self, hub, access):
        hub.stall_api()
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/sql-lora"), HubAccess(hub.url, access.cache_dir, timeout_s=0.3), 16)
        assert e.value.kind is ErrorKind.UNAVAILABLE

    def test_offline_pins_and_serves_from_the_cache_alone(self, hub, access, local):
        pinned = inspect(HubRef("org/sql-lora"), access, 16).ref
        download(pinned, access)
        hub.push_folder("org/sql-lora", local["chat"])  # unseen offline
        hub.stop()
        offline = HubAccess(cache_dir=access.cache_dir, offline=True)
        assert inspect(HubRef("org/sql-lora"), offline, 16).ref == pinned
        assert files(download(pinned, offline)) == {
            k: v for k, v in files(local["sql"]).items() if k != "README.md"
        }
        with pytest.raises(HubError) as e:
            inspect(HubRef("org/other-lora"), offline, 16)
        assert e.value.kind is ErrorKind.NOT_FOUND and "HF_HUB_OFFLINE" in str(e.value)


class TestDownload:
    def test_downloads_only_the_config_and_the_weights(self, hub, access, local):
        folder = download(HubRef("org/sql-lora", hub.shas["sql"]), access)
        want = files(local["sql"])
        assert files(folder) == {k: want[k] for k in ("adapter_config.json",
                                                      "adapter_model.safetensors")}  # fmt: skip

    def test_a_body_cut_once_is_resumed_whole(self, hub, access, local):
        hub.drop_downloads(1)
        folder = download(HubRef("org/sql-lora", hub.shas["sql"]), access)
        assert files(folder)["adapter_model.safetensors"] == files(local["sql"])[
            "adapter_model.safetensors"
        ]


# -- the engine's tier above disk ---------------------------------------------------------------


@pytest.fixture
def engine_env(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "engine-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "engine-cache"


def hub_engine(models, hub, local, **kw):
    adapters = (
        ("sql", f"hf://org/sql-lora@{hub.shas['sql']}"),
        ("other", f"hf://org/other-lora@{hub.shas['other']}"),
        ("gone", f"hf://org/gone@{'0' * 40}"),
        ("chat", str(local["chat"])),
    )
    engine = make_engine(models["llama"], adapters=adapters, **kw)
    clock = FakeClock()
    engine.adapters.fetcher.clock = clock
    return engine, clock


def step_until(engine, done, outputs, hang_guard_s=60.0):
    """Step (sleeping a little while the engine only waits on downloads or reads) until
    `done()`; the guard only turns a hang into a failure."""
    deadline = time.monotonic() + hang_guard_s
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there"
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if engine.stalled or not engine.has_work:
            time.sleep(0.001)


def finished(outputs, rid):
    return bool(outputs.get(rid)) and outputs[rid][-1].finished


def tokens(outputs, rid):
    return [t for out in outputs[rid] for t in out.new_token_ids]


@pytest.mark.parametrize("mode", ["blocking", "prefetch"])
def test_a_hub_adapter_downloads_on_first_need_while_others_run_and_matches_peft(
    models, hub, local, engine_env, mode
):
    engine, _ = hub_engine(models, hub, local, adapter_loading=mode)
    assert engine.adapter_status()["sql"]["tier"] == "hub"
    hub.stall_downloads()
    engine.add_request(Request("hub", PROMPT, greedy(6), "sql"))
    engine.add_request(Request("disk", PROMPT, greedy(6), "chat"))
    outputs: dict = {}
    step_until(engine, lambda: finished(outputs, "disk"), outputs)  # the download waits
    assert engine.adapter_status()["sql"]["tier"] == "downloading"
    assert "sql" not in engine.routing_stats().loading  # cold, for the router
    assert not outputs.get("hub")
    hub.release()
    step_until(engine, lambda: finished(outputs, "hub"), outputs)
    assert tokens(outputs, "hub") == hf_greedy(models["llama"], PROMPT, 6, adapter_dir=local["sql"])
    assert tokens(outputs, "disk") == hf_greedy(models["llama"], PROMPT, 6, local["chat"])
    assert engine.adapter_status()["sql"]["tier"] in ("gpu", "host")
    assert engine.adapters.fetcher.downloads == 1


def test_requests_waiting_on_one_download_share_it(models, hub, local, engine_env):
    engine, _ = hub_engine(models, hub, local)
    for i in range(3):
        engine.add_request(Request(f"r{i}", PROMPT, greedy(2), "sql"))
    outputs: dict = {}
    step_until(engine, lambda: all(finished(outputs, f"r{i}") for i in range(3)), outputs)
    assert hub.requests["get"] == 2  # the config and the weights, once
    assert engine.adapters.fetcher.downloads == 1


def test_a_stalled_download_fails_its_requests_503_after_the_timeout_and_goes_on(
    models, hub, local, engine_env
):
    engine, clock = hub_engine(models, hub, local, hub_timeout_s=5.0)
    hub.stall_downloads()
    engine.add_request(Request("first", PROMPT, greedy(2), "sql"))
    outputs: dict = {}
    step_until(engine, lambda: engine.adapter_status()["sql"]["tier"] == "downloading", outputs)
    clock.now += 6.0  # past the timeout: the wait ends, the download does not
    step_until(engine, lambda: finished(outputs, "first"), outputs)
    last = outputs["first"][-1]
    assert last.finish_reason == "error" and last.error_kind is ErrorKind.UNAVAILABLE
    assert "hf://org/sql-lora" in last.error and str(engine_env) not in last.error
    assert engine.adapter_status()["sql"]["tier"] == "downloading"
    hub.release()  # the download that went on lands: the next request finds it on disk
    step_until(engine, lambda: engine.adapter_status()["sql"]["tier"] == "disk", outputs)
    engine.add_request(Request("second", PROMPT, greedy(2), "sql"))
    step_until(engine, lambda: finished(outputs, "second"), outputs)
    assert outputs["second"][-1].finish_reason == "length"


def test_a_download_cut_on_every_attempt_leaves_nothing_a_later_request_trusts(
    models, hub, local, engine_env
):
    engine, clock = hub_engine(models, hub, local, hub_timeout_s=5.0)
    hub.drop_downloads(10_000)
    engine.add_request(Request("first", PROMPT, greedy(3), "sql"))
    outputs: dict = {}
    step_until(engine, lambda: engine.adapter_status()["sql"]["tier"] == "downloading", outputs)
    clock.now += 6.0
    step_until(engine, lambda: finished(outputs, "first"), outputs)
    assert outputs["first"][-1].error_kind is ErrorKind.UNAVAILABLE
    snapshot = engine_env / "models--org--sql-lora" / "snapshots" / hub.shas["sql"]
    assert not (snapshot / "adapter_model.safetensors").exists()  # only *.incomplete so far
    hub.drop_downloads(0)  # the client resumes the cut file; what it links is whole
    step_until(engine, lambda: engine.adapter_status()["sql"]["tier"] == "disk", outputs)
    engine.add_request(Request("second", PROMPT, greedy(3), "sql"))
    step_until(engine, lambda: finished(outputs, "second"), outputs)
    assert tokens(outputs, "second") == hf_greedy(models["llama"], PROMPT, 3, local["sql"])


@pytest.mark.parametrize(
    ("adapter", "kind", "reason"),
    [("gone", ErrorKind.NOT_FOUND, "no repo org/gone"), ("other", ErrorKind.INVALID, "shape")],
)
def test_a_hub_adapter_that_cannot_be_served_fails_its_request_with_the_reason(
    models, hub, local, engine_env, adapter, kind, reason
):
    engine, _ = hub_engine(models, hub, local)
    engine.add_request(Request("r", PROMPT, greedy(2), adapter))
    outputs: dict = {}
    step_until(engine, lambda: finished(outputs, "r"), outputs)
    last = outputs["r"][-1]
    assert last.finish_reason == "error" and last.error_kind is kind
    assert reason in last.error and str(engine_env) not in last.error


def test_registering_an_unpinned_hub_reference_is_refused(models, hub, local, engine_env):
    from replicas.engine import RequestRejected

    engine, _ = hub_engine(models, hub, local)
    with pytest.raises(RequestRejected) as e:
        engine.load_adapter("latest", "hf://org/sql-lora")
    assert e.value.kind is ErrorKind.INVALID
    engine.load_adapter("pinned", f"hf://org/sql-lora@{hub.shas['sql']}")
    assert engine.served_adapters().adapters["pinned"] == f"hf://org/sql-lora@{hub.shas['sql']}"
