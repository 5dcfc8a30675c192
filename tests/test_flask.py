"""The Flask integration: every route through Flask's test client, every answer checked
against the OpenAPI document the app serves."""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _netjail import netjail, netjail_check  # noqa: F401
from flask import Flask, Request
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_spec
from werkzeug.exceptions import Forbidden
from werkzeug.test import TestResponse

import batch
import dcache
from batch import flask as batch_flask
from batch._openapi import document
from batch.fetchers import Fetcher

# -- a fetch the tests drive --------------------------------------------------------------


class GatedFetch:
    """``test://block/...`` waits for its gate; ``test://fail/...`` fails; others succeed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[str, threading.Event] = {}
        self._started: dict[str, threading.Event] = {}

    def _event(self, table: dict[str, threading.Event], url: str) -> threading.Event:
        with self._lock:
            return table.setdefault(url, threading.Event())

    def started(self, url: str) -> threading.Event:
        return self._event(self._started, url)

    def release(self, url: str) -> None:
        self._event(self._gates, url).set()

    def release_all(self) -> None:
        with self._lock:
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()
        self._released = True

    def __call__(self, target: batch.Target) -> batch.Result:
        self.started(target.url).set()
        if "/block/" in target.url:
            assert self._event(self._gates, target.url).wait(30), "gate never opened"
        if "/fail/" in target.url:
            raise batch.FetchError("failed on purpose", hint="a test")
        return batch.Result(f"body of {target.url}", {"n": 1})


def identify(request: Request) -> tuple[str, str] | None:
    caller = request.headers.get("X-Caller")
    if caller == "forbidden":
        raise Forbidden("not you")
    return (caller, "test") if caller else None


# -- an API client that checks every answer against the served document ------------------


_VALID_SPECS: set[str] = set()


def _validate_spec_once(doc: dict[str, Any]) -> None:
    """openapi-spec-validator takes ~0.4 s a document: validate each distinct one once."""
    key = json.dumps(doc, sort_keys=True)
    if key not in _VALID_SPECS:
        validate_spec(doc)
        _VALID_SPECS.add(key)


class Api:
    """Flask's test client; every response is validated against the OpenAPI document."""

    def __init__(self, app: Flask, prefix: str = "/jobs") -> None:
        self.client = app.test_client()
        self.prefix = prefix
        raw = self.client.get(f"{prefix}/openapi.json")
        assert raw.status_code == 200
        self.doc: dict[str, Any] = raw.get_json()
        _validate_spec_once(self.doc)
        self.checked: list[tuple[str, str, int]] = []

    def open(self, method: str, path: str, caller: str | None = "alice", **kw: Any) -> Any:
        headers = dict(kw.pop("headers", {}))
        if caller is not None:
            headers["X-Caller"] = caller
        resp = self.client.open(path, method=method, headers=headers, **kw)
        check_response(self.doc, method, path.split("?", 1)[0], resp)
        self.checked.append((method, path, resp.status_code))
        return resp

    def post(self, targets: Any = None, caller: str | None = "alice", **kw: Any) -> Any:
        if not {"data", "json", "input_stream"} & set(kw):
            kw["json"] = {"targets": targets}
        return self.open("POST", self.prefix, caller, **kw)

    def get(self, job_id: str, caller: str | None = "alice", **kw: Any) -> Any:
        return self.open("GET", f"{self.prefix}/{job_id}", caller, **kw)

    def delete(self, job_id: str, caller: str | None = "alice", **kw: Any) -> Any:
        return self.open("DELETE", f"{self.prefix}/{job_id}", caller, **kw)


def _operation(doc: dict[str, Any], method: str, path: str) -> dict[str, Any] | None:
    paths = doc["paths"]
    candidates = sorted(paths, key=lambda p: p.count("{"))  # static paths win
    for template in candidates:
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path):
            op: dict[str, Any] | None = paths[template].get(method.lower())
            return op
    return None


def _validate(doc: dict[str, Any], schema: dict[str, Any], instance: Any) -> None:
    root = {**schema, "components": doc["components"]}
    Draft202012Validator(root, format_checker=Draft202012Validator.FORMAT_CHECKER).validate(
        instance
    )


def check_response(doc: dict[str, Any], method: str, path: str, resp: TestResponse) -> None:
    """Fail unless the response is one the document promises for this operation."""
    assert resp.headers.get("Cache-Control") == "no-store"
    op = _operation(doc, method, path)
    if op is None or method == "HEAD":
        # Not an operation of the API (a wrong method, an unknown path): still one shape.
        if method != "HEAD":
            assert resp.mimetype == "application/json"
            _validate(doc, {"$ref": "#/components/schemas/Error"}, resp.get_json())
        return
    responses = op["responses"]
    spec = responses.get(str(resp.status_code)) or responses.get("default")
    assert spec is not None, f"{method} {path}: {resp.status_code} is not documented"
    for name, header in spec.get("headers", {}).items():
        if header.get("required"):
            assert name in resp.headers, f"{method} {path}: no {name} header"
        if name in resp.headers:
            value: Any = resp.headers[name]
            if header["schema"].get("type") == "integer":
                value = int(value)
            _validate(doc, header["schema"], value)
    if resp.status_code == 304:
        assert resp.get_data() == b"", f"{method} {path}: a 304 has no body"
    if "content" in spec:
        if "application/json" in spec["content"]:
            assert resp.mimetype == "application/json"
            _validate(doc, spec["content"]["application/json"]["schema"], resp.get_json())
        else:
            assert resp.mimetype, f"{method} {path}: no content type"
    else:
        assert resp.get_data() == b"", f"{method} {path}: a body where none is documented"


# -- fixtures -------------------------------------------------------------------------------

Make = Callable[..., tuple[Api, batch.Runner]]


@pytest.fixture
def fetch() -> Iterator[GatedFetch]:
    f = GatedFetch()
    yield f
    f.release_all()


def _factory(db: dcache.DB, fetch: GatedFetch, made: list[batch.Runner]) -> Make:
    def make(
        config: batch.Config | None = None,
        clock: Any = None,
        webhooks: batch.Webhooks | None = None,
        **options: Any,
    ) -> Any:
        runner = batch.Runner(db, fetch, config, clock=clock, webhooks=webhooks)
        made.append(runner)
        app = Flask("test_app")
        app.testing = True
        batch_flask.init_app(app, runner, identify, **options)
        return Api(app), runner

    return make


def _close(made: list[batch.Runner], fetch: GatedFetch) -> None:
    fetch.release_all()
    for runner in made:
        runner.close(timeout=10)


@pytest.fixture
def make_all(db: dcache.DB, fetch: GatedFetch) -> Iterator[Make]:
    """An API on each backend."""
    made: list[batch.Runner] = []
    yield _factory(db, fetch, made)
    _close(made, fetch)


@pytest.fixture
def make(fetch: GatedFetch) -> Iterator[Make]:
    """An API on in-memory SQLite."""
    made: list[batch.Runner] = []
    store = dcache.DB.memory()
    try:
        yield _factory(store, fetch, made)
        _close(made, fetch)
    finally:
        store.close()


def _error(resp: Any, status: int, type_: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    body: dict[str, Any] = resp.get_json()["error"]
    assert body["type"] == type_, body
    assert body["message"]
    return body


# -- the document ---------------------------------------------------------------------------


def test_openapi_document_is_valid_openapi_31(make: Make) -> None:
    """The served document is a valid OpenAPI 3.1 document describing the five routes."""
    api, _ = make()
    resp = api.open("GET", "/jobs/openapi.json", caller=None)
    doc = resp.get_json()
    validate_spec(doc)
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/targets/{idx}",
        "/jobs/{job_id}/targets/{idx}/content",
        "/jobs/openapi.json",
    }
    assert doc == document("/jobs", "/")


def test_blueprint_mounted_elsewhere_documents_its_own_prefix(fetch: GatedFetch) -> None:
    """An app mounting the blueprint under another prefix gets a document for that prefix."""
    with dcache.DB.memory() as store, batch.Runner(store, fetch) as runner:
        app = Flask("elsewhere")
        app.register_blueprint(batch_flask.blueprint(runner, identify, "/api/v1/batches"))
        api = Api(app, prefix="/api/v1/batches")
        assert set(api.doc["paths"]) == {
            "/api/v1/batches",
            "/api/v1/batches/{job_id}",
            "/api/v1/batches/{job_id}/targets/{idx}",
            "/api/v1/batches/{job_id}/targets/{idx}/content",
            "/api/v1/batches/openapi.json",
        }
        resp = api.post([{"url": "test://a"}])
        assert resp.status_code == 202
        assert resp.headers["Location"].startswith("/api/v1/batches/")
        assert api.get(resp.get_json()["job"]["id"], query_string={"wait": 5}).status_code == 200


def test_init_app_keeps_its_state_in_app_extensions(fetch: GatedFetch) -> None:
    """init_app stores one runner per app in app.extensions["batch"] and refuses a second."""
    with dcache.DB.memory() as store, batch.Runner(store, fetch) as runner:
        app = Flask("ext")
        state = batch_flask.init_app(app, runner, identify)
        assert app.extensions["batch"] is state
        assert state.runner is runner
        with pytest.raises(RuntimeError, match="already"):
            batch_flask.init_app(app, runner, identify)


# -- POST -----------------------------------------------------------------------------------


def test_post_starts_a_job_and_points_at_it(make_all: Make) -> None:
    """POST answers 202 with the running job, reused false, and a Location to poll."""
    api, _ = make_all()
    resp = api.post([{"url": "test://a"}, {"url": "test://b", "options": {"grep": "x"}}])
    assert resp.status_code == 202
    body = resp.get_json()
    assert body["reused"] is False
    job = body["job"]
    assert job["status"] in ("running", "done")
    assert job["targets_total"] == 2
    assert job["caller"] == "alice"
    assert "owner" not in job
    assert resp.headers["Location"] == f"/jobs/{job['id']}"
    got = api.get(job["id"], query_string={"wait": 10}).get_json()
    assert got["job"]["status"] == "done"
    assert [t["status"] for t in got["targets"]] == ["done", "done"]
    assert got["targets"][1]["options"] == {"grep": "x"}
    assert got["targets"][0]["result"] == {"content": "body of test://a", "meta": {"n": 1}}


def test_same_targets_in_another_spelling_reuse_the_job(make_all: Make) -> None:
    """Key order, white space and default options do not make a second job."""
    api, _ = make_all()
    first = api.post([{"url": "test://a", "options": {"grep": "x", "context": False}}])
    body = '{ "targets" : [ { "options": {"grep":"x"}, "url":"test://a" } ] }'
    again = api.post(data=body, content_type="application/json")
    assert again.status_code == 202
    assert again.get_json()["reused"] is True
    assert again.get_json()["job"]["id"] == first.get_json()["job"]["id"]


def test_malformed_json_is_400(make: Make) -> None:
    """A body that is not JSON (or nests absurdly deep) answers 400, never 500."""
    api, _ = make()
    for data in ['{"targets": [', "NaN", '{"targets": [1e999999]', "[" * 100_000, b"\xff\xfe"]:
        _error(api.post(data=data, content_type="application/json"), 400, "bad_request")


def test_wrong_content_type_is_415(make: Make) -> None:
    """Only application/json (or a +json type) is read."""
    api, _ = make()
    body = json.dumps({"targets": [{"url": "test://a"}]})
    _error(api.post(data=body, content_type="text/plain"), 415, "unsupported_media_type")
    _error(api.post(data=body), 415, "unsupported_media_type")
    ok = api.post(data=body, content_type="application/vnd.batch+json; charset=utf-8")
    assert ok.status_code == 202


def test_body_over_the_limit_is_413(make: Make) -> None:
    """A body over max_body answers 413, with or without a Content-Length."""
    api, _ = make(max_body=200)
    big = json.dumps({"targets": [{"url": "test://" + "a" * 300}]})
    body = _error(api.post(data=big, content_type="application/json"), 413, "payload_too_large")
    assert body["limit"] == 200
    chunked = api.post(
        input_stream=io.BytesIO(big.encode()),
        content_type="application/json",
        headers={"Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},
    )
    _error(chunked, 413, "payload_too_large")


@pytest.mark.parametrize(
    ("payload", "type_", "context"),
    [
        ([], "invalid_request", {"field": ""}),
        ({"targets": [], "extra": 1}, "invalid_request", {"field": "extra"}),
        ({}, "invalid_request", {"field": "targets"}),
        ({"targets": []}, "invalid_targets", {}),
        ({"targets": "test://a"}, "invalid_targets", {}),
        ({"targets": [{"url": ""}]}, "invalid_targets", {"index": 0, "field": "url"}),
        ({"targets": [{"url": "test://a"}, {"url": 7}]}, "invalid_targets", {"index": 1}),
        ({"targets": [{"url": "test://a", "x": 1}]}, "invalid_targets", {"field": "x"}),
        (
            {"targets": [{"url": "test://a", "options": {"grep": 1}}]},
            "invalid_targets",
            {"field": "options.grep"},
        ),
        ({"targets": [{"url": "test://a"}, {"url": "test://a"}]}, "invalid_targets", {}),
        ({"targets": [{"url": "test://\u0000"}]}, "invalid_targets", {"field": "url"}),
        # A name that is no UTF-8 (a lone surrogate) is named escaped, not a 500.
        ({"targets": [], "\ud800": 1}, "invalid_request", {"field": "\\ud800"}),
        ({"targets": [{"url": "test://a", "\udfff": 1}]}, "invalid_targets", {"field": "\\udfff"}),
        (
            {"targets": [{"url": "test://a", "options": {"\ud800": ""}}]},
            "invalid_targets",
            {"field": "options.\\ud800"},
        ),
    ],
)
def test_invalid_requests_are_422_naming_the_fault(
    make: Make, payload: Any, type_: str, context: dict[str, Any]
) -> None:
    """Well-formed JSON that is not a valid job answers 422 with the index and field."""
    api, runner = make()
    body = _error(api.post(json=payload), 422, type_)
    for key, value in context.items():
        assert body[key] == value
    assert runner.jobs() == []


def test_too_many_targets_is_422(make: Make) -> None:
    """More targets than targets_per_job answers 422 with the count and the limit."""
    api, _ = make(batch.Config(targets_per_job=2))
    resp = api.post([{"url": f"test://{i}"} for i in range(3)])
    body = _error(resp, 422, "too_many_targets")
    assert (body["count"], body["limit"]) == (3, 2)


def test_caller_busy_is_429_with_retry_after(make: Make) -> None:
    """A caller at its live-job cap gets 429 caller_busy and a Retry-After."""
    api, _ = make(batch.Config(jobs_per_caller=1), retry_after=7)
    assert api.post([{"url": "test://block/a"}]).status_code == 202
    resp = api.post([{"url": "test://b"}])
    body = _error(resp, 429, "caller_busy")
    assert resp.headers["Retry-After"] == "7"
    assert (body["live"], body["limit"], body["retry_after"]) == (1, 1, 7)


def test_busy_is_429_with_retry_after(make: Make) -> None:
    """When the service is at jobs_total, anyone gets 429 busy, without others' numbers."""
    api, _ = make(batch.Config(jobs_total=1))
    assert api.post([{"url": "test://block/a"}], caller="alice").status_code == 202
    resp = api.post([{"url": "test://b"}], caller="bob")
    body = _error(resp, 429, "busy")
    assert resp.headers["Retry-After"] == "5"
    assert "live" not in body


def test_unauthenticated_requests_are_401(make: Make) -> None:
    """identify() returning None answers 401 on every route, before anything is read."""
    api, _ = make(www_authenticate='Bearer realm="jobs"')
    job_id = api.post([{"url": "test://a"}]).get_json()["job"]["id"]
    for resp in (
        api.post(data="garbage", content_type="text/plain", caller=None),
        api.get(job_id, caller=None),
        api.delete(job_id, caller=None),
    ):
        _error(resp, 401, "unauthorized")
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="jobs"'


def test_identify_may_refuse_with_an_http_error(make: Make) -> None:
    """An HTTPException raised by identify() is answered in the API's JSON shape."""
    api, _ = make()
    _error(api.post([{"url": "test://a"}], caller="forbidden"), 403, "forbidden")


def test_store_outage_is_503_with_retry_after(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store outage answers 503 + Retry-After and never leaks the database's words."""
    api, runner = make()
    job_id = api.post([{"url": "test://a"}]).get_json()["job"]["id"]

    def down(*_a: Any, **_kw: Any) -> Any:
        raise dcache.StoreUnavailableError("OperationalError: db.internal:5432 refused")

    for name in ("submit_job", "job", "status_raw", "cancel_job"):
        monkeypatch.setattr(runner, name, down)
    for resp in (api.post([{"url": "test://b"}]), api.get(job_id), api.delete(job_id)):
        body = _error(resp, 503, "unavailable")
        assert resp.headers["Retry-After"] == "5"
        assert "db.internal" not in json.dumps(body)


def test_permanent_store_error_is_500_in_the_json_shape(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A permanent store failure answers 500 in the one shape, without details."""
    api, runner = make()

    def broken(*_a: Any, **_kw: Any) -> Any:
        raise dcache.StoreError("ProgrammingError: relation secret_table does not exist")

    monkeypatch.setattr(runner, "submit_job", broken)
    body = _error(api.post([{"url": "test://a"}]), 500, "internal")
    assert "secret_table" not in body["message"]


def test_closed_runner_is_503(make: Make) -> None:
    """A runner shutting down refuses submissions with 503 and Retry-After."""
    api, runner = make()
    runner.close()
    resp = api.post([{"url": "test://a"}])
    _error(resp, 503, "unavailable")
    assert "Retry-After" in resp.headers


# -- Idempotency-Key --------------------------------------------------------------------------


def test_idempotency_key_same_payload_is_the_same_job(make: Make) -> None:
    """The same key with the same payload answers the same job (sf-string form too)."""
    api, _ = make()
    first = api.post([{"url": "test://a"}], headers={"Idempotency-Key": "k-1"})
    again = api.post([{"url": "test://a"}], headers={"Idempotency-Key": '"k-1"'})
    assert again.status_code == 202
    assert again.get_json()["reused"] is True
    assert again.get_json()["job"]["id"] == first.get_json()["job"]["id"]


def test_idempotency_key_with_another_payload_is_422(make: Make) -> None:
    """Reusing a key for a different payload is refused, and no job is made for it."""
    api, runner = make(batch.Config(jobs_per_caller=5))
    api.post([{"url": "test://a"}], headers={"Idempotency-Key": "k-1"})
    resp = api.post([{"url": "test://b"}], headers={"Idempotency-Key": "k-1"})
    _error(resp, 422, "idempotency_key_reused")
    assert len(runner.jobs()) == 1
    # Keys are per caller; a fresh key, or none, makes a new job.
    assert (
        api.post([{"url": "test://b"}], "bob", headers={"Idempotency-Key": "k-1"}).status_code
        == 202
    )
    assert api.post([{"url": "test://b"}], headers={"Idempotency-Key": "k-2"}).status_code == 202
    assert len(runner.jobs()) == 3


def test_idempotency_key_is_free_again_once_its_job_lapsed(make: Make, clock: Any) -> None:
    """After the job's lease lapses, its key may name a new payload."""
    api, runner = make(batch.Config(ttl=60), clock=clock)
    job_id = api.post([{"url": "test://a"}], headers={"Idempotency-Key": "k"}).get_json()["job"][
        "id"
    ]
    assert api.get(job_id, query_string={"wait": 10}).get_json()["job"]["status"] == "done"
    clock.advance(seconds=120)
    resp = api.post([{"url": "test://b"}], headers={"Idempotency-Key": "k"})
    assert resp.status_code == 202
    assert resp.get_json()["reused"] is False


@pytest.mark.parametrize("key", ["", "x" * 256, "clé", "a\tb"])
def test_malformed_idempotency_key_is_400(make: Make, key: str) -> None:
    """Empty, over-long or non-printable-ASCII keys are refused."""
    api, _ = make()
    resp = api.post([{"url": "test://a"}], headers={"Idempotency-Key": key})
    _error(resp, 400, "invalid_idempotency_key")


# -- GET --------------------------------------------------------------------------------------


def test_get_shows_progress_target_by_target(make_all: Make, fetch: GatedFetch) -> None:
    """While a target is in flight it reads running; the rest stay pending."""
    api, _ = make_all()
    job_id = api.post([{"url": "test://block/a"}, {"url": "test://fail/b"}]).get_json()["job"]["id"]
    assert fetch.started("test://block/a").wait(10)
    body = api.get(job_id).get_json()
    assert body["job"]["status"] == "running"
    assert [t["status"] for t in body["targets"]] == ["running", "pending"]
    fetch.release("test://block/a")
    body = api.get(job_id, query_string={"wait": 10}).get_json()
    assert body["job"]["status"] == "partial"
    assert body["targets"][1]["error"] == "failed on purpose"
    assert body["targets"][1]["hint"] == "a test"
    assert body["job"]["finished_at"] is not None


def test_wait_long_polls_until_the_job_finishes(
    make: Make, fetch: GatedFetch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """?wait=N holds the request while the job runs and answers as soon as it finishes."""
    api, runner = make()
    job_id = api.post([{"url": "test://block/a"}]).get_json()["job"]["id"]
    waiting = threading.Event()
    real_wait = runner.wait

    def spy(job_id: str, timeout: float | None = None) -> Any:
        waiting.set()
        return real_wait(job_id, timeout)

    monkeypatch.setattr(runner, "wait", spy)
    releaser = threading.Thread(target=lambda: waiting.wait(10) and fetch.release("test://block/a"))
    releaser.start()
    body = api.get(job_id, query_string={"wait": 30}).get_json()
    releaser.join(10)
    assert waiting.is_set()
    assert body["job"]["status"] == "done"


def test_wait_that_runs_out_answers_the_current_state(make: Make) -> None:
    """A long-poll whose time runs out answers 200 with the job as it is."""
    api, _ = make()
    job_id = api.post([{"url": "test://block/a"}]).get_json()["job"]["id"]
    resp = api.get(job_id, query_string={"wait": "0.05"})
    assert resp.status_code == 200
    assert resp.get_json()["job"]["status"] == "running"


@pytest.mark.parametrize("wait", ["31", "-1", "abc", "nan", "inf", "1e400"])
def test_bad_wait_is_400(make: Make, wait: str) -> None:
    """wait must be a number of seconds from 0 to 30."""
    api, _ = make()
    job_id = api.post([{"url": "test://a"}]).get_json()["job"]["id"]
    body = _error(api.get(job_id, query_string={"wait": wait}), 400, "invalid_parameter")
    assert body["parameter"] == "wait"


def test_another_callers_job_is_404_like_an_unknown_one(make_all: Make) -> None:
    """Bob can neither read nor cancel Alice's job, nor tell it from a missing one."""
    api, _ = make_all()
    job_id = api.post([{"url": "test://block/a"}], caller="alice").get_json()["job"]["id"]
    unknown = api.get("0" * 32, caller="bob")
    for resp in (api.get(job_id, caller="bob"), api.delete(job_id, caller="bob")):
        _error(resp, 404, "not_found")
        assert resp.get_json() == unknown.get_json()
    assert api.get(job_id, caller="alice").get_json()["job"]["status"] == "running"


@pytest.mark.parametrize(
    "job_id",
    ["nope", "%00", "' OR 1=1 --", "x" * 5000, "\u00e9\u00e8", "%ED%A0%80", ".."],
)
def test_hostile_ids_are_plain_404s(make: Make, job_id: str) -> None:
    """Odd ids (SQL, NUL, surrogates, very long) are unknown ids, nothing more."""
    api, _ = make()
    resp = api.get(job_id)
    assert resp.status_code == 404
    assert resp.get_json()["error"]["type"] == "not_found"
    assert api.delete(job_id).status_code == 404


# -- DELETE -----------------------------------------------------------------------------------


def test_delete_cancels_a_live_job(make_all: Make, fetch: GatedFetch) -> None:
    """DELETE answers the cancelled job; the drain stores the in-flight target and stops."""
    api, _ = make_all()
    targets = [{"url": f"test://block/{c}"} for c in "abc"]
    job_id = api.post(targets).get_json()["job"]["id"]
    assert fetch.started("test://block/a").wait(10)
    resp = api.delete(job_id)
    assert resp.status_code == 200
    assert resp.get_json()["job"]["status"] == "cancelled"
    fetch.release("test://block/a")
    body = api.get(job_id, query_string={"wait": 10}).get_json()
    assert body["job"]["status"] == "cancelled"
    assert body["job"]["finished_at"] is not None
    assert [t["status"] for t in body["targets"]] == ["done", "pending", "pending"]
    assert not fetch.started("test://block/b").is_set()


def test_delete_of_a_finished_job_is_409(make: Make) -> None:
    """Only a live job can be cancelled; a finished one answers 409 with its status."""
    api, _ = make()
    job_id = api.post([{"url": "test://a"}]).get_json()["job"]["id"]
    api.get(job_id, query_string={"wait": 10})
    body = _error(api.delete(job_id), 409, "job_finished")
    assert body["status"] == "done"
    body = _error(api.delete(job_id), 409, "job_finished")


# -- the rest of the surface ------------------------------------------------------------------


def test_wrong_methods_and_unknown_paths_answer_in_the_json_shape(make: Make) -> None:
    """Routing errors under the prefix are JSON too: 405 with Allow, 404 for unknown paths."""
    api, _ = make()
    resp = api.open("GET", "/jobs")
    _error(resp, 405, "method_not_allowed")
    assert resp.headers["Allow"] == "POST, OPTIONS"  # as OPTIONS itself answers
    resp = api.open("PUT", "/jobs/abc")
    _error(resp, 405, "method_not_allowed")
    assert resp.headers["Allow"] == "GET, HEAD, DELETE, OPTIONS"
    _error(api.open("POST", "/jobs/openapi.json"), 405, "method_not_allowed")
    _error(api.open("GET", "/jobs/abc/def"), 404, "not_found")
    assert api.open("HEAD", "/jobs/openapi.json").status_code == 200


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "SEARCH", "HEAD"])
def test_other_methods_are_405_in_the_json_shape_with_the_routes_own_allow(
    make: Make, method: str
) -> None:
    """A method no route takes (WebDAV's, TRACE) answers the one JSON 405, and Allow lists
    what the route takes, not every method some other rule of the path answers."""
    api, _ = make()
    allow = {
        "/jobs": "POST",
        "/jobs/openapi.json": "GET, HEAD",
        "/jobs/abc": "GET, HEAD, DELETE",
        "/jobs/abc/targets/0": "GET, HEAD",
        "/jobs/abc/targets/0/content": "GET, HEAD",
    }
    for path, allowed in allow.items():
        if method in allowed:
            continue
        resp = api.open(method, path)
        assert resp.status_code == 405, (method, path)
        if method != "HEAD":
            _error(resp, 405, "method_not_allowed")
        assert resp.headers["Allow"] == f"{allowed}, OPTIONS", (method, path)
    if method != "HEAD":
        _error(api.open(method, "/jobs/abc/def"), 404, "not_found")
        _error(api.open(method, "/jobs/"), 404, "not_found")


def test_options_lists_what_each_route_takes(make: Make) -> None:
    """OPTIONS answers 204 with the route's own methods (not its 405 rules' methods)."""
    api, _ = make()
    for path, allowed in {
        "/jobs": "POST, OPTIONS",
        "/jobs/openapi.json": "GET, HEAD, OPTIONS",
        "/jobs/abc": "GET, HEAD, DELETE, OPTIONS",
        "/jobs/abc/targets/0": "GET, HEAD, OPTIONS",
        "/jobs/abc/targets/0/content": "GET, HEAD, OPTIONS",
    }.items():
        resp = api.client.open(path, method="OPTIONS")
        assert resp.status_code == 204, path
        assert resp.headers["Allow"] == allowed, path
        assert resp.headers["Cache-Control"] == "no-store"


def test_responses_are_never_cached(make: Make) -> None:
    """Per-caller answers carry Cache-Control: no-store (checked on every response)."""
    api, _ = make()
    resp = api.post([{"url": "test://a"}])
    assert resp.headers["Cache-Control"] == "no-store"
    assert all(status < 500 for _m, _p, status in api.checked)


def test_the_prefix_with_a_slash_answers_a_json_404(make: Make) -> None:
    """GET /jobs/ (no id) answers in the API's JSON shape, not Flask's HTML page."""
    api, _ = make()
    for method in ("GET", "POST", "DELETE"):
        body = _error(api.open(method, "/jobs/"), 404, "not_found")
        assert "job id" in body["message"]
    assert api.post([{"url": "test://a"}]).status_code == 202
    _error(api.open("GET", "/jobs"), 405, "method_not_allowed")


@pytest.fixture
def fetcher_api() -> Iterator[Callable[..., Api]]:
    """An API whose runner fetches with the library's Fetcher (as built by the test)."""
    made: list[batch.Runner] = []
    store = dcache.DB.memory()

    def build(fetcher: Fetcher) -> Api:
        config = batch.Config(jobs_per_caller=10)
        runner = batch.Runner(store, fetcher, config)
        made.append(runner)
        app = Flask("fetcher_app")
        app.testing = True
        batch_flask.init_app(app, runner, identify)
        return Api(app)

    try:
        yield build
    finally:
        for runner in made:
            runner.close(timeout=10)
        store.close()


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1/", "blocked address 127.0.0.1 (loopback)"),
        ("http://2130706433/admin", "blocked address 127.0.0.1 (loopback)"),
        ("http://[::ffff:10.0.0.5]:8080/", "private network"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("file:///etc/passwd", "URL scheme 'file' refused"),
        ("gopher://example.org/", "URL scheme 'gopher' refused"),
        ("http://[::1/", "invalid URL"),
        ("http://example.org:99999/", "invalid URL"),
        ("http://127\u30020\u30020\u30021/", "blocked address 127.0.0.1 (loopback)"),
        ("http://[::ffff:0:127.0.0.1]/", "IPv4-translated"),
        ("http://[64:ff9b:1::a00:5]/", "local-use NAT64"),
    ],
)
def test_the_default_fetcher_refuses_targets_early_with_422(
    fetcher_api: Callable[..., Api], url: str, words: str
) -> None:
    """A target the library's Fetcher would surely refuse never becomes a job."""
    api = fetcher_api(Fetcher())
    resp = api.post([{"url": "https://example.org/"}, {"url": url}])
    body = _error(resp, 422, "refused_target")
    assert body["index"] == 1
    assert body["field"] == "url"
    assert words in body["message"]
    assert body["hint"]


def test_early_refusal_follows_the_fetchers_own_policy(fetcher_api: Callable[..., Api]) -> None:
    """allow= and schemes= open what they name; an app's own fetch is never second-guessed."""
    local = fetcher_api(Fetcher(allow=["127.0.0.0/8"], schemes=("http", "file")))
    assert local.post([{"url": "http://127.0.0.1:9/"}], caller="a").status_code == 202
    assert local.post([{"url": "file:///nonexistent"}], caller="b").status_code == 202
    names = fetcher_api(Fetcher())
    # A name is judged when connected (then refused there, failing only its target).
    assert names.post([{"url": "http://localhost:9/"}], caller="c").status_code == 202
    # Malformed lists still get the usual invalid_targets answer.
    _error(names.post([{"url": ""}], caller="d"), 422, "invalid_targets")


@pytest.mark.parametrize("library_fetcher", [True, False])
def test_a_posted_target_is_checked_once(
    fetcher_api: Callable[..., Api],
    make: Make,
    monkeypatch: pytest.MonkeyPatch,
    library_fetcher: bool,
) -> None:
    """The view checks the targets (and, with the library's Fetcher, their addresses)
    and submits what it checked: nothing is parsed and checked a second time."""
    api = fetcher_api(Fetcher()) if library_fetcher else make()[0]
    checked: list[str] = []
    check_url = batch.Target._check_url

    def counting(self: batch.Target) -> None:
        checked.append(self.url)
        check_url(self)

    monkeypatch.setattr(batch.Target, "_check_url", counting)
    urls = [f"https://example.org/{i}" for i in range(3)]
    resp = api.post(
        [{"url": urls[0]}, {"url": urls[1], "options": {"mode": "raw"}}, {"url": urls[2]}]
    )
    assert resp.status_code == 202, resp.get_json()
    assert checked == urls
    # Malformed targets are refused by the submit, with the index and field at fault.
    checked.clear()
    body = _error(api.post([{"url": urls[0]}, {"url": 7}], caller="b"), 422, "invalid_targets")
    assert (body["index"], body["field"]) == (1, "url")
    # Checked up to the bad one, by the view and again by the submit that refused the list
    # (the cost of keeping the submit's order of errors, paid by refused requests only).
    assert checked == [urls[0], 7] * 2


# -- job-end webhooks (issue 14) --------------------------------------------------------------


def test_post_with_notify_announces_the_end_and_get_shows_the_notification(
    make_all: Make,
) -> None:
    from test_webhooks import SECRET, Receiver, poll

    receiver = Receiver([500])
    try:
        hooks = batch.Webhooks(
            secret=SECRET, allow=["127.0.0.1"], schedule=(dt.timedelta(0),), poll=0.05
        )
        api, runner = make_all(webhooks=hooks)
        body = {"targets": [{"url": "test://ok/1"}], "notify": {"url": receiver.url}}
        resp = api.post(json=body)
        assert resp.status_code == 202, resp.get_data(as_text=True)
        job_id = resp.get_json()["job"]["id"]

        def delivered() -> Any:
            doc = api.get(job_id).get_json()
            note = doc.get("notification")
            return doc if note and note["status"] == "delivered" else None

        doc = poll(delivered)
        note = doc["notification"]
        assert (note["attempts"], note["next_attempt_at"]) == (2, None)
        assert note["last_answer"].startswith("HTTP 200")
        assert len(receiver.seen) == 2
        assert {h["webhook-id"] for h, _ in receiver.seen} == {note["id"]}
        sent = json.loads(receiver.seen[-1][1])
        assert sent["job"] == doc["job"] and sent["type"] == "job.finished"
    finally:
        receiver.close()


def test_get_reads_the_notification_on_its_streamed_reads_own_connection(
    make_all: Make,
) -> None:
    """A GET never takes a second connection while its streamed read holds one: on SQLite
    without WAL (the in-memory store) a second read waits for a pending commit, which waits
    for the first read to end (seen as a GET stuck, then 503 'database is locked')."""
    from sqlalchemy import event
    from test_webhooks import SECRET, Receiver, poll

    receiver = Receiver()
    try:
        api, runner = make_all(webhooks=batch.Webhooks(secret=SECRET, allow=["127.0.0.1"]))
        body = {"targets": [{"url": "test://ok/1"}], "notify": {"url": receiver.url}}
        job_id = api.post(json=body).get_json()["job"]["id"]
        delivered = lambda: getattr(runner.notification(job_id), "status", "") == "delivered"  # noqa: E731
        poll(delivered)  # then nothing changes it while the GET runs
        me = threading.get_ident()
        held = [0]
        reads: list[tuple[str, int]] = []

        def out(*_: Any) -> None:
            held[0] += threading.get_ident() == me

        def back(*_: Any) -> None:
            held[0] -= threading.get_ident() == me

        def sql(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
            if threading.get_ident() == me and statement.lstrip().upper().startswith("SELECT"):
                reads.append((" ".join(statement.split()), held[0]))

        engine = runner.db.engine
        event.listen(engine.pool, "checkout", out)
        event.listen(engine.pool, "checkin", back)
        event.listen(engine, "before_cursor_execute", sql)
        try:
            doc = api.get(job_id).get_json()
        finally:
            event.remove(engine.pool, "checkout", out)
            event.remove(engine.pool, "checkin", back)
            event.remove(engine, "before_cursor_execute", sql)
        assert doc["job"]["id"] == job_id
        assert doc["notification"] == runner.notification(job_id).to_json()  # type: ignore[union-attr]
        outbox = [n for s, n in reads if "batch_outbox" in s]
        assert outbox and len(reads) == 2, reads
        assert outbox == [1], reads  # one connection out: the stream's own
    finally:
        receiver.close()


def test_the_etag_moves_when_the_notification_does(make_all: Make) -> None:
    """GET shows the notification, so its state is in the tag: a conditional poll (and a
    long poll) sees a delivery even when nothing else about the job changed."""
    from test_webhooks import SECRET, Receiver, poll

    receiver = Receiver([410])  # the first attempt is refused for good: failed
    try:
        hooks = batch.Webhooks(secret=SECRET, allow=["127.0.0.1"], poll=0.05)
        api, runner = make_all(webhooks=hooks)
        body = {"targets": [{"url": "test://ok/1"}], "notify": {"url": receiver.url}}
        job_id = api.post(json=body).get_json()["job"]["id"]
        poll(lambda: getattr(runner.notification(job_id), "status", "") == "failed")
        failed = api.get(job_id)
        tag = failed.headers["ETag"]
        assert failed.get_json()["notification"]["status"] == "failed"
        assert api.get(job_id, headers={"If-None-Match": tag}).status_code == 304
        answers: list[Any] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                api.get(job_id, headers={"If-None-Match": tag}, query_string={"wait": 20})
            )
        )
        waiter.start()
        assert runner.redeliver(job_id)  # the job row does not change; its notification does
        waiter.join(20)
        assert not waiter.is_alive()
        (woken,) = answers
        assert woken.status_code == 200 and woken.headers["ETag"] != tag
        assert woken.get_json()["notification"]["status"] in ("pending", "delivered")
        assert woken.get_json()["job"] == failed.get_json()["job"]
        poll(lambda: getattr(runner.notification(job_id), "status", "") == "delivered")
        now = api.get(job_id, headers={"If-None-Match": tag})
        assert now.status_code == 200 and now.get_json()["notification"]["status"] == "delivered"
        assert api.get(job_id, headers={"If-None-Match": now.headers["ETag"]}).status_code == 304
    finally:
        receiver.close()


def test_a_running_job_shows_no_notification_and_one_without_notify_neither(
    make_all: Make, fetch: GatedFetch
) -> None:
    from test_webhooks import SECRET

    api, runner = make_all(webhooks=batch.Webhooks(secret=SECRET, allow=["127.0.0.1"]))
    resp = api.post(
        json={"targets": [{"url": "test://block/1"}], "notify": {"url": "https://example.com/h"}}
    )
    job_id = resp.get_json()["job"]["id"]
    assert "notification" not in api.get(job_id).get_json()
    fetch.release_all()
    runner.wait(job_id, timeout=30)
    plain = api.post([{"url": "test://ok/2"}]).get_json()["job"]["id"]
    runner.wait(plain, timeout=30)
    assert "notification" not in api.get(plain).get_json()


@pytest.mark.parametrize(
    "notify",
    [
        {"url": "http://127.0.0.1/hook"},
        {"url": "http://10.1.2.3/hook"},
        {"url": "ftp://example.com/hook"},
        {"url": ""},
        {"url": 5},
        "https://example.com/hook",
        {"url": "https://example.com/hook", "secret": "x"},
    ],
)
def test_an_invalid_notify_is_422(make: Make, notify: Any) -> None:
    from test_webhooks import SECRET

    api, runner = make(webhooks=batch.Webhooks(secret=SECRET))
    resp = api.post(json={"targets": [{"url": "test://ok/1"}], "notify": notify})
    assert resp.status_code == 422, resp.get_data(as_text=True)
    assert resp.get_json()["error"]["type"] in ("invalid_request", "invalid_targets")
    assert runner.jobs() == []


def test_notify_on_a_server_without_webhooks_is_422(make: Make) -> None:
    api, runner = make()
    resp = api.post(
        json={"targets": [{"url": "test://ok/1"}], "notify": {"url": "https://e.com/h"}}
    )
    _error(resp, 422, "invalid_targets")
