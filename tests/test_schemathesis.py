"""Property-based API tests: schemathesis generates requests from the OpenAPI document the
Flask API serves (``/jobs/openapi.json``) and checks every answer against it, in-process
through WSGI (no network).

Every generated request carries the one bearer token ``identify`` accepts. The generated
``job_id`` is swapped, some of the time, for a real job of that caller (or of another
caller), so ``GET`` and ``DELETE`` reach their 200 and 409 answers, not only 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from flask import Flask, Request
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

import batch
import dcache
from batch import flask as batch_flask
from batch._openapi import document

TOKEN = "schemathesis-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CALLER = "fuzzer"

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def identify(request: Request) -> tuple[str, str] | None:
    """Accept exactly one bearer token (and ``X-Other`` as a second caller, for seeding)."""
    if request.headers.get("X-Other") == TOKEN:
        return ("other", "test")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return (CALLER, "test") if scheme.lower() == "bearer" and token == TOKEN else None


def fetch(target: batch.Target) -> batch.Result:
    """Answers at once, so every job finishes (and long polls return) immediately."""
    return batch.Result(f"body of {target.url}", {"n": 1})


def _submit(app: Flask, headers: dict[str, str], url: str) -> str:
    resp = app.test_client().post("/jobs", json={"targets": [{"url": url}]}, headers=headers)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    job_id: str = resp.get_json()["job"]["id"]
    return job_id


# The document the app serves at /jobs/openapi.json (the ``app`` fixture checks they are
# equal). It is loaded at import time because ``schemathesis.pytest.from_fixture`` breaks
# on pytest 9 (it sets ``request.node._nodeid``, which pytest 9 no longer has), and
# ``from_wsgi`` at import time would need a running Runner before any fixture exists.
schema = schemathesis.openapi.from_dict(document("/jobs", "/"))

# Real job ids, filled by the ``app`` fixture: the caller's own (finished) jobs, then one
# job of another caller (which must answer 404, exactly like an unknown id).
SEEDED: list[str] = []


@schema.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any] | None) -> Any:
    """Swap the generated job_id for a real one some of the time."""
    if not path_parameters or "job_id" not in path_parameters or not SEEDED:
        return st.just(path_parameters)
    ids = [path_parameters["job_id"], *SEEDED]
    return st.sampled_from(ids).map(lambda job_id: {**path_parameters, "job_id": job_id})


@pytest.fixture(scope="module")
def app() -> Iterator[Flask]:
    """One store, runner and app for the module, with caps far above what the tests reach."""
    config = batch.Config(jobs_per_caller=100_000, jobs_total=100_000)
    with dcache.DB.memory() as store, batch.Runner(store, fetch, config) as runner:
        flask_app = Flask("schemathesis_app")
        flask_app.testing = True
        batch_flask.init_app(flask_app, runner, identify)
        served = flask_app.test_client().get("/jobs/openapi.json").get_json()
        assert served == schema.raw_schema, "the served document is not the one under test"
        own = [_submit(flask_app, AUTH, f"test://seed/{i}") for i in range(3)]
        foreign = _submit(flask_app, {"X-Other": TOKEN}, "test://seed/other")
        for job_id in [*own, foreign]:
            runner.wait(job_id, timeout=10)
        SEEDED[:] = [*own, foreign]
        try:
            yield flask_app
        finally:
            SEEDED.clear()


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_api_conforms_to_its_openapi_document(case: Any, app: Flask) -> None:
    """No generated request gets a 5xx; every answer matches the document."""
    case.call_and_validate(headers=AUTH, checks=CHECKS, app=app)
