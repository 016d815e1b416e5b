"""The routes against their own OpenAPI schema, with Schemathesis: generated bodies, valid and
not (its coverage phase: boundary values, wrong types, missing fields, undeclared methods; then
a few random ones), sent in-process over a fake engine.

Every answer must be one the schema declares (status, content type, body), no request may get a
5xx, and a body the schema rules out must be refused. Bodies the schema allows may still be
refused (a prompt longer than the context, a token id outside the vocabulary): the schema cannot
say so, so that check is left out.

A generated `model` almost never names the served model, so every generation body is sent a
second time aimed at it: those reach tokenization, the chat template, the engine and the
streamed and whole answers (`test_generated_bodies_reached_the_engine`, last, checks that they
did). The module runs on one worker, in order.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import positive_data_acceptance
from schemathesis.python.asgi import get_client

from app.api import ApiSettings, make_api
from app.metrics import IngressMetrics
from synthetic.tokenizer import build_byte_tokenizer
from tests.app.conftest import BASE, FakeEngine, FakeMetricsBackend, text_chunks

MAX_EXAMPLES = 10  # random bodies per route, after the coverage phase's systematic ones
GENERATION = {"/v1/completions", "/v1/chat/completions"}

pytestmark = pytest.mark.xdist_group("schema")  # the tally below is read by the last test
# (route, status) of each generation body sent again aimed at the served model
aimed: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def fake_engine():
    return FakeEngine(text_chunks("fine", " text"))


@pytest.fixture(scope="module")
def app_under_test(tmp_path_factory, fake_engine):
    settings_ = ApiSettings(
        served_model_name=BASE,
        model_root="/models/tiny-base",
        runtime_adapter_dirs=(str(tmp_path_factory.mktemp("runtime-adapters")),),
        max_model_len=64,
    )
    metrics = IngressMetrics(FakeMetricsBackend())
    return make_api(fake_engine, build_byte_tokenizer(), settings_, metrics=metrics)


@pytest.fixture(scope="module")
def api_schema(app_under_test):
    return schemathesis.openapi.from_asgi("/openapi.json", app_under_test)


@pytest.fixture(scope="module")
def session(app_under_test):
    with get_client(app_under_test) as client:
        yield client


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,  # the same bodies every run: a failure is reproducible, never flaky
    suppress_health_check=list(HealthCheck),
)
def test_every_answer_is_declared_and_none_is_a_server_error(case, session):
    case.call_and_validate(session=session, excluded_checks=[positive_data_acceptance])
    if case.path in GENERATION and isinstance(case.body, dict) and "model" in case.body:
        case.body = {**case.body, "model": BASE}  # Schemathesis re-checks it against the schema
        response = case.call_and_validate(
            session=session, excluded_checks=[positive_data_acceptance]
        )
        aimed[case.path, response.status_code] += 1


def test_generated_bodies_reached_the_engine(fake_engine):
    if not aimed:
        pytest.skip("the generated cases above were not selected in this run")
    for path in GENERATION:
        assert aimed[path, 200] > 0, aimed  # some bodies were served, and their answers valid
    assert fake_engine.requests, "no generated body reached the engine"


async def test_each_route_declares_its_errors_as_openai_bodies(app_under_test):
    transport = httpx.ASGITransport(app=app_under_test)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    declared = {
        f"{method.upper()} {path}": set(operation["responses"])
        for path, item in paths.items()
        for method, operation in item.items()
    }
    assert declared["POST /v1/completions"] >= {"200", "400", "401", "404", "413", "500", "503"}
    assert declared["POST /v1/chat/completions"] == declared["POST /v1/completions"]
    assert declared["POST /v1/load_lora_adapter"] >= {"200", "400", "401", "403", "413", "503"}
    assert all("422" not in statuses for statuses in declared.values())
    for item in paths.values():
        for operation in item.values():
            for status, response in operation["responses"].items():
                if status >= "400":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
