"""Reading results over HTTP at web scale (issue 12), every answer checked against the
OpenAPI document: pass-through answers, conditional polls, results on demand, 410."""

# ruff: noqa: F811 (the fixtures of test_flask are imported, then named as parameters)
from __future__ import annotations

import base64
import datetime as dt
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Clock
from flask import Flask
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event
from test_flask import (  # noqa: F401
    Api,
    GatedFetch,
    Make,
    _error,
    check_response,
    fetch,
    identify,
    make,
    make_all,
)

import batch
import dcache
from batch import _json as jsonenc
from batch import flask as batch_flask

TTL = dt.timedelta(hours=1)


def _expected(runner: batch.Runner, job_id: str, *, results: bool = True) -> dict[str, Any]:
    """The status document built the slow way: decoded results, re-encoded."""
    found = runner.status(job_id, results=results)
    assert found is not None
    job, targets = found
    doc = job.to_json()
    doc.pop("owner")
    return {"job": doc, "targets": [t.to_json() for t in targets]}


class Statements:
    """The SQL this thread sends through the store's engine, while ``recording``."""

    def __init__(self, db: dcache.DB) -> None:
        self.sql: list[str] = []
        self._thread = threading.get_ident()
        self.recording = False
        self._engine = db.engine
        event.listen(self._engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if self.recording and threading.get_ident() == self._thread:
            self.sql.append(" ".join(statement.split()))

    def __enter__(self) -> Statements:
        self.sql.clear()
        self.recording = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.recording = False

    def close(self) -> None:
        event.remove(self._engine, "before_cursor_execute", self._seen)


@pytest.fixture
def statements(db: dcache.DB) -> Iterator[Statements]:
    s = Statements(db)
    yield s
    s.close()


@pytest.fixture
def api_on(db: dcache.DB, fetch: GatedFetch, clock: Clock) -> Iterator[Any]:
    """An API on each backend, its runner on the injected clock."""
    made: list[batch.Runner] = []

    def build(**config: Any) -> tuple[Api, batch.Runner]:
        cfg = batch.Config(ttl=TTL, jobs_per_caller=8, **config)
        runner = batch.Runner(db, fetch, cfg, clock=clock)
        made.append(runner)
        app = Flask("reads_app")
        app.testing = True
        batch_flask.init_app(app, runner, identify)
        return Api(app), runner

    yield build
    fetch.release_all()
    for runner in made:
        runner.close(timeout=10)


def _submit(api: Api, urls: list[str], caller: str = "alice") -> str:
    resp = api.post([{"url": u} for u in urls], caller=caller)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    job_id: str = resp.get_json()["job"]["id"]
    return job_id


# -- pass-through -------------------------------------------------------------------------


def test_get_answers_the_same_document_as_decoding_and_reencoding(
    make_all: Make, fetch: GatedFetch
) -> None:
    """Splicing stored results in changes nothing a client can see, in progress or done."""
    api, runner = make_all()
    job_id = _submit(api, ["test://a", "test://fail/b", "test://block/c", "test://d"])
    assert fetch.started("test://block/c").wait(10)
    got = api.get(job_id)
    assert got.status_code == 200
    assert got.get_json() == _expected(runner, job_id)
    assert [t["status"] for t in got.get_json()["targets"]] == [
        "done",
        "failed",
        "running",
        "pending",
    ]
    fetch.release("test://block/c")
    done = api.get(job_id, query_string={"wait": 10})
    assert done.get_json() == _expected(runner, job_id)
    assert done.get_json()["job"]["status"] == "partial"


def test_orjson_and_the_stdlib_answer_the_same_bytes(
    make_all: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optional fast encoder changes speed only: byte for byte the same answers."""
    assert jsonenc.ENCODER == "orjson"  # the test extra installs it: both paths are run
    api, runner = make_all()
    job_id = _submit(api, ["test://a", "test://fail/ü"])
    runner.wait(job_id, timeout=10)
    fast = [api.get(job_id).get_data(), api.post([{"url": "test://a"}, {"url": "test://fail/ü"}])]
    monkeypatch.setattr(jsonenc, "dumps", jsonenc.dumps_stdlib)
    slow = [api.get(job_id).get_data(), api.post([{"url": "test://a"}, {"url": "test://fail/ü"}])]
    assert fast[0] == slow[0]
    assert fast[1].get_data() == slow[1].get_data()
    assert json.loads(fast[0]) == _expected(runner, job_id)
    odd = {"s": 'é\u2028"\\\n\x00', "n": [0, -1, 2**53, 1.5, None, True], "e": {}}
    assert jsonenc.dumps_stdlib(odd) == __import__("orjson").dumps(odd)


def test_without_orjson_the_stdlib_encodes_the_answers() -> None:
    """The [fast] extra is optional: with orjson not importable, batch uses the standard
    library, and a whole answer decodes to the same document (a fresh interpreter, orjson
    blocked before batch is imported)."""
    script = (
        "import sys; sys.modules['orjson'] = None\n"
        "import json, flask, batch, dcache\n"
        "from batch import _json, flask as bf\n"
        "assert _json.ENCODER == 'json' and _json.dumps is _json.dumps_stdlib\n"
        "db = dcache.DB.memory()\n"
        "runner = batch.Runner(db, lambda t: batch.Result('é ' + t.url))\n"
        "app = flask.Flask('t')\n"
        "bf.init_app(app, runner, lambda req: ('alice', 'std'))\n"
        "c = app.test_client()\n"
        "r = c.post('/jobs', json={'targets': [{'url': 'http://a.test/ü'}]})\n"
        "job_id = r.get_json()['job']['id']\n"
        "runner.wait(job_id, timeout=10)\n"
        "got = c.get(f'/jobs/{job_id}').get_json()\n"
        "assert got['targets'][0]['result'] == {'content': 'é http://a.test/ü'}, got\n"
        "assert got['job']['status'] == 'done', got\n"
        "runner.close(); db.close(); print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_large_answer_is_streamed_target_by_target(make_all: Make, fetch: GatedFetch) -> None:
    """Past a few hundred KiB the answer is written as it is read, never built whole."""
    api, runner = make_all()
    big = "x" * (200 * 1024)

    def large(target: batch.Target) -> batch.Result:
        return batch.Result(big + target.url, {"content_type": "text/plain"})

    runner._fetch = large  # type: ignore[attr-defined]
    job_id = _submit(api, [f"test://big/{i}" for i in range(4)])
    runner.wait(job_id, timeout=10)
    resp = api.client.get(f"/jobs/{job_id}", headers={"X-Caller": "alice"}, buffered=False)
    assert resp.is_streamed and "Content-Length" not in resp.headers
    check_response(api.doc, "GET", f"/jobs/{job_id}", resp)  # reads it whole, then checks
    body = resp.get_data()
    resp.close()
    assert json.loads(body) == _expected(runner, job_id)
    small = api.get(_submit(api, ["test://small"]), query_string={"wait": 10})
    assert not small.is_streamed and int(small.headers["Content-Length"]) > 0


# -- conditional polls --------------------------------------------------------------------


def test_etag_changes_exactly_when_the_job_or_a_target_does(
    api_on: Any, fetch: GatedFetch, db: dcache.DB
) -> None:
    """Every stored target and every status change moves the tag; nothing else does."""
    api, runner = api_on()
    job_id = _submit(api, ["test://block/a", "test://block/b"])
    assert fetch.started("test://block/a").wait(10)
    tags = [api.get(job_id).headers["ETag"]]
    assert api.get(job_id).headers["ETag"] == tags[0]  # no change, same tag
    fetch.release("test://block/a")
    assert fetch.started("test://block/b").wait(10)
    tags.append(api.get(job_id).headers["ETag"])
    assert api.delete(job_id).status_code == 200
    tags.append(api.get(job_id).headers["ETag"])
    fetch.release("test://block/b")
    runner.wait(job_id, timeout=10)
    tags.append(api.get(job_id).headers["ETag"])  # the in-flight target stored, drain ended
    assert len(set(tags)) == 4, tags
    brief = api.get(job_id, query_string={"results": "false"}).headers["ETag"]
    assert brief != tags[-1]  # another representation, another tag


def test_if_none_match_is_304_from_one_read_of_the_job_row(
    api_on: Any, statements: Statements
) -> None:
    """A poll that finds nothing new reads the job row once, no target, no result."""
    api, runner = api_on()
    job_id = _submit(api, ["test://a", "test://b"])
    runner.wait(job_id, timeout=10)
    tag = api.get(job_id).headers["ETag"]
    with statements:
        resp = api.get(job_id, headers={"If-None-Match": tag})
    assert resp.status_code == 304 and resp.get_data() == b""
    assert resp.headers["ETag"] == tag
    reads = [s for s in statements.sql if s.upper().startswith("SELECT")]
    assert len(reads) == 1, statements.sql
    assert "batch_job" in reads[0] and "batch_target" not in " ".join(statements.sql)
    # Any of several tags, or a weak one, matches too; a stale one gets the full answer.
    assert api.get(job_id, headers={"If-None-Match": f'"x", W/{tag}'}).status_code == 304
    stale = api.get(job_id, headers={"If-None-Match": '"stale"'})
    assert stale.status_code == 200 and stale.headers["ETag"] == tag
    with statements:
        full = api.get(job_id)
    assert full.status_code == 200
    reads = [s for s in statements.sql if s.upper().startswith("SELECT")]
    assert len(reads) == 1, statements.sql  # the full GET: one statement, ownership included


def test_wait_with_if_none_match_waits_for_the_next_change(api_on: Any, fetch: GatedFetch) -> None:
    """A long poll on a tag answers as soon as anything changes, 304 if nothing does."""
    api, runner = api_on()
    job_id = _submit(api, ["test://block/a", "test://block/b"])
    assert fetch.started("test://block/a").wait(10)
    tag = api.get(job_id).headers["ETag"]
    quiet = api.get(job_id, headers={"If-None-Match": tag}, query_string={"wait": 0.3})
    assert quiet.status_code == 304
    out: dict[str, Any] = {}

    def poll() -> None:
        out["resp"] = api.get(job_id, headers={"If-None-Match": tag}, query_string={"wait": 20})

    poller = threading.Thread(target=poll)
    poller.start()
    fetch.release("test://block/a")
    poller.join(20)
    assert not poller.is_alive()
    resp = out["resp"]
    assert resp.status_code == 200 and resp.headers["ETag"] != tag
    assert resp.get_json()["targets"][0]["status"] == "done"
    assert resp.get_json()["job"]["status"] == "running"  # it did not wait for the end
    fetch.release("test://block/b")
    runner.wait(job_id, timeout=10)


# -- results on demand --------------------------------------------------------------------


def test_results_false_gives_sizes_and_null_results(make_all: Make) -> None:
    """?results=false: the job, every status and error, each result's size, no result."""
    api, runner = make_all()
    job_id = _submit(api, ["test://a", "test://fail/b"])
    runner.wait(job_id, timeout=10)
    resp = api.get(job_id, query_string={"results": "false"})
    body = resp.get_json()
    assert body == _expected(runner, job_id, results=False)
    a, b = body["targets"]
    stored = json.dumps({"content": "body of test://a", "meta": {"n": 1}}, ensure_ascii=False)
    assert (a["result"], a["bytes"]) == (None, len(stored.encode()))
    assert (b["result"], b["error"], "bytes" in b) == (None, "failed on purpose", False)
    for bad in ("maybe", "", "2"):
        _error(api.get(job_id, query_string={"results": bad}), 400, "invalid_parameter")


def test_one_target_and_its_content_one_at_a_time(make_all: Make, fetch: GatedFetch) -> None:
    """/targets/<idx> answers one target with its result; /content the content itself."""
    api, runner = make_all()
    job_id = _submit(api, ["test://a", "test://block/b", "test://c"])
    assert fetch.started("test://block/b").wait(10)
    prefix = f"/jobs/{job_id}/targets"
    a = api.open("GET", f"{prefix}/0")
    assert a.status_code == 200
    assert a.get_json() == runner.result(job_id, 0).to_json()  # type: ignore[union-attr]
    assert a.get_json()["result"] == {"content": "body of test://a", "meta": {"n": 1}}
    assert api.open("GET", f"{prefix}/1").get_json()["status"] == "running"
    assert api.open("GET", f"{prefix}/2").get_json()["status"] == "pending"
    content = api.open("GET", f"{prefix}/0/content")
    assert content.status_code == 200
    assert content.get_data() == b"body of test://a"
    assert content.mimetype == "text/plain" and content.mimetype_params["charset"] == "utf-8"
    none = _error(api.open("GET", f"{prefix}/1/content"), 404, "no_result")
    assert none["status"] == "running"
    # A target's own status, which the document's error schema admits (not a job's).
    none = _error(api.open("GET", f"{prefix}/2/content"), 404, "no_result")
    assert none["status"] == "pending"
    for idx in ("3", "-1", "x", "99999999999"):
        _error(api.open("GET", f"{prefix}/{idx}"), 404, "not_found")
        _error(api.open("GET", f"{prefix}/{idx}/content"), 404, "not_found")
    _error(api.open("GET", f"{prefix}/0", caller="bob"), 404, "not_found")
    _error(api.open("GET", f"{prefix}/0/content", caller="bob"), 404, "not_found")
    _error(api.open("GET", f"/jobs/{'0' * 32}/targets/0"), 404, "not_found")
    assert api.open("POST", f"{prefix}/0").status_code == 405
    fetch.release("test://block/b")
    runner.wait(job_id, timeout=10)


def test_content_carries_the_type_fetch_reported(make_all: Make) -> None:
    """HTML stays HTML, base64-stored bytes come back as the bytes they were."""
    api, runner = make_all()
    png = b"\x89PNG\r\n\x1a\n\x00\xff"

    def typed(target: batch.Target) -> batch.Result:
        if target.url.endswith("png"):
            meta = {"content_type": "image/png", "encoding": "base64"}
            return batch.Result(base64.b64encode(png).decode(), meta)
        return batch.Result("<p>é</p>", {"content_type": "text/html; charset=utf-8"})

    runner._fetch = typed  # type: ignore[attr-defined]
    job_id = _submit(api, ["test://page.html", "test://pic.png"])
    runner.wait(job_id, timeout=10)
    html = api.open("GET", f"/jobs/{job_id}/targets/0/content")
    assert html.headers["Content-Type"] == "text/html; charset=utf-8"
    assert html.get_data() == "<p>é</p>".encode()
    assert html.headers["X-Content-Type-Options"] == "nosniff"
    assert html.headers["Content-Security-Policy"] == "sandbox; default-src 'none'"
    pic = api.open("GET", f"/jobs/{job_id}/targets/1/content")
    assert (pic.headers["Content-Type"], pic.get_data()) == ("image/png", png)
    assert pic.headers["Content-Security-Policy"] == "sandbox; default-src 'none'"


def test_base64_content_wrapped_in_lines_comes_back_as_its_bytes(make_all: Make) -> None:
    """An app's fetch may store MIME-style base64 (``base64.encodebytes``: a line break
    every 76 characters, 300 KiB across several of the store's slices): the bytes come
    back, not the base64 text."""
    api, runner = make_all()
    data = bytes(range(256)) * 1200

    def wrapped(target: batch.Target) -> batch.Result:
        meta = {"content_type": "application/octet-stream", "encoding": "base64"}
        return batch.Result(base64.encodebytes(data).decode(), meta)

    runner._fetch = wrapped  # type: ignore[attr-defined]
    job_id = _submit(api, ["test://blob.bin"])
    runner.wait(job_id, timeout=10)
    assert api.open("GET", f"/jobs/{job_id}/targets/0/content").get_data() == data


@pytest.mark.parametrize(
    ("reported", "sent"),
    [
        ("text/html; charset=iso-8859-1", "text/html; charset=utf-8"),
        ('text/html;charset="UTF-16"; level=1', "text/html; level=1; charset=utf-8"),
        ("text/html", "text/html; charset=utf-8"),
        ("application/json", "application/json; charset=utf-8"),
        ("TEXT/CSV ; Charset=latin1", "TEXT/CSV; charset=utf-8"),
        ('text/plain; title="x;charset=y"', 'text/plain; title="x;charset=y"; charset=utf-8'),
    ],
)
def test_text_content_is_sent_as_utf8_whatever_charset_the_page_declared(
    make_all: Make, reported: str, sent: str
) -> None:
    """The stored content is text, and it is sent as UTF-8: the page's own charset
    (the fetcher decoded it) labelled those UTF-8 bytes wrongly (café read as cafÃ©)."""
    api, runner = make_all()
    runner._fetch = lambda _t: batch.Result("café", {"content_type": reported})  # type: ignore[attr-defined]
    job_id = _submit(api, ["test://a"])
    runner.wait(job_id, timeout=10)
    got = api.open("GET", f"/jobs/{job_id}/targets/0/content")
    assert (got.headers["Content-Type"], got.get_data()) == (sent, "café".encode())


@pytest.mark.parametrize(
    "reported",
    ["text/html\r\nX-Injected: 1", "text/\u2603", "text/plain\x00", ["text/html"], 7, "html", ""],
)
def test_content_falls_back_to_the_default_type_when_fetch_reports_an_unusable_one(
    make_all: Make, reported: Any
) -> None:
    """A fetch's content_type that is no media type (a header break, non-Latin-1 text, not
    a string) never reaches the headers: the content goes out as text/plain."""
    api, runner = make_all()
    runner._fetch = lambda _t: batch.Result("body", {"content_type": reported})  # type: ignore[attr-defined]
    job_id = _submit(api, ["test://a"])
    runner.wait(job_id, timeout=10)
    resp = api.open("GET", f"/jobs/{job_id}/targets/0/content")
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert "X-Injected" not in resp.headers
    assert resp.get_data() == b"body"


def test_content_is_read_from_the_store_a_slice_at_a_time(
    api_on: Any, statements: Statements, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large result crosses the driver in slices, never whole, and decodes exactly (escapes
    and characters of every UTF-8 width cut anywhere); a purge mid-stream ends it early."""
    api, runner = api_on()
    content = ('é"\\\n😀\x01 ' + "x" * 300) * 40  # ~12,300 characters
    meta = {"content_type": "text/plain; charset=utf-8"}
    runner._fetch = lambda _t: batch.Result(content, meta)  # type: ignore[attr-defined]
    job_id = _submit(api, ["test://big"])
    runner.wait(job_id, timeout=10)
    monkeypatch.setattr(batch_flask, "_SLICE", 1000)
    sizes: list[int] = []
    real = runner.read_result

    def spy(*args: Any) -> bytes | None:
        data = real(*args)
        sizes.append(-1 if data is None else len(data))
        return data

    monkeypatch.setattr(runner, "read_result", spy)
    with statements:
        resp = api.open("GET", f"/jobs/{job_id}/targets/0/content")
        body = resp.get_data()
    assert resp.status_code == 200 and resp.headers["Content-Type"] == meta["content_type"]
    assert body == content.encode()
    stored = len(json.dumps(batch.Result(content, meta).to_json()).encode())
    assert 0 < max(sizes) <= 1000  # never more than a slice, in bytes
    assert len(sizes) >= 2 * stored // 1000  # two passes: find the end, then decode
    reads = [s for s in statements.sql if s.upper().startswith("SELECT")]
    assert "NULL AS result" in reads[0], reads[0]  # the target's row, its result left out
    if runner._db.dialect == "sqlite" and runner._db._sqlite_blobs():
        # Read in place through a blob handle; SQL only finds the row.
        slices = [
            s for s in reads[1:] if s.startswith("SELECT batch_target.rowid FROM batch_target")
        ]
    else:  # the server cuts the value's UTF-8 bytes: only the slice crosses the wire
        slices = [s for s in reads[1:] if s.lower().startswith("select substr(")]
    assert slices == reads[1:] and len(slices) == len(sizes), reads
    # Purged (or replaced) while it streams: the answer stops, it never lies.
    resp = api.open("GET", f"/jobs/{job_id}/targets/0/content", buffered=False)
    pieces = iter(resp.response)
    first = next(pieces)
    assert content.encode().startswith(first)
    runner._db.purge_expired(now=dt.datetime(2100, 1, 1, tzinfo=dt.timezone.utc))
    with pytest.raises(dcache.StoreError):
        for _ in pieces:
            pass
    resp.close()


# -- expired is not unknown ---------------------------------------------------------------


def test_an_expired_job_is_410_to_its_caller_and_404_to_others(
    api_on: Any, clock: Clock, db: dcache.DB
) -> None:
    """410 Gone with expired_at while the tombstone lasts; never a leak to other callers."""
    api, runner = api_on()
    job_id = _submit(api, ["test://a"])
    done = runner.wait(job_id, timeout=10)
    assert done is not None and done.expires_at is not None
    tag = api.get(job_id).headers["ETag"]
    clock.now = done.expires_at + dt.timedelta(seconds=1)
    paths = [f"/jobs/{job_id}", f"/jobs/{job_id}/targets/0", f"/jobs/{job_id}/targets/0/content"]
    for purged in (False, True):
        if purged:
            assert db.purge_expired(now=clock()) == 1
        for path in paths:
            resp = api.open("GET", path)
            body = _error(resp, 410, "expired")
            assert resp.get_json()["expired_at"] == done.expires_at.isoformat()
            assert body["expired_at"] == done.expires_at.isoformat()
            _error(api.open("GET", path, caller="bob"), 404, "not_found")
        _error(api.get(job_id, headers={"If-None-Match": tag}), 410, "expired")
        _error(api.get(job_id, query_string={"wait": "1"}), 410, "expired")
        _error(api.get(job_id, query_string={"wait": "1"}, caller="bob"), 404, "not_found")
        _error(api.delete(job_id), 410, "expired")
        _error(api.delete(job_id, caller="bob"), 404, "not_found")
    _error(api.get("0" * 32), 404, "not_found")


def test_a_result_purged_before_content_starts_is_410_not_500(
    api_on: Any, clock: Clock, db: dcache.DB
) -> None:
    """Purged between the read of the target's row and the first slice of its result:
    the answer has not started, so it says what a request a moment later would (410 to
    the caller), not that the store failed."""
    api, runner = api_on()
    job_id = _submit(api, ["test://a"])
    done = runner.wait(job_id, timeout=10)
    assert done is not None and done.expires_at is not None
    read = runner.read_result

    def purged_first(*args: Any, **kw: Any) -> Any:
        clock.now = done.expires_at + dt.timedelta(seconds=1)
        db.purge_expired(now=clock())
        return read(*args, **kw)

    runner.read_result = purged_first  # type: ignore[method-assign]
    resp = api.open("GET", f"/jobs/{job_id}/targets/0/content")
    body = _error(resp, 410, "expired")
    assert body["expired_at"] == done.expires_at.isoformat()


# -- each view reads once -----------------------------------------------------------------


def test_delete_is_one_compare_and_set_and_never_touches_another_callers_job(
    api_on: Any, fetch: GatedFetch, statements: Statements
) -> None:
    """DELETE: one locked read and one conditional UPDATE; another caller changes nothing."""
    api, runner = api_on()
    job_id = _submit(api, ["test://block/a", "test://b"])
    assert fetch.started("test://block/a").wait(10)
    _error(api.delete(job_id, caller="bob"), 404, "not_found")
    assert runner.job(job_id).status == "running"  # type: ignore[union-attr]
    with statements:
        resp = api.delete(job_id)
    assert resp.status_code == 200 and resp.get_json()["job"]["status"] == "cancelled"
    work = [s for s in statements.sql if s.split()[0].upper() in ("SELECT", "UPDATE")]
    assert [s.split()[0].upper() for s in work] == ["SELECT", "UPDATE"], statements.sql
    _error(api.delete(job_id), 409, "job_finished")
    fetch.release("test://block/a")
    runner.wait(job_id, timeout=10)


def test_submit_answers_from_its_own_transaction(api_on: Any, statements: Statements) -> None:
    """POST reads nothing after the submit transaction: its row is the answer."""
    api, runner = api_on()
    with statements:
        resp = api.post([{"url": "test://a"}])
    assert resp.status_code == 202
    inserts = [i for i, s in enumerate(statements.sql) if s.upper().startswith("INSERT")]
    assert inserts, statements.sql
    after = statements.sql[inserts[-1] + 1 :]
    assert not [s for s in after if s.upper().startswith("SELECT")], statements.sql
    runner.wait(resp.get_json()["job"]["id"], timeout=10)


@settings(max_examples=300, deadline=None)
@given(
    content=st.text(
        alphabet=st.sampled_from(["a", "é", '"', "\\", "\n", "\x00", "\x1f", "😀", "/"])
    ),
    piece=st.integers(min_value=1, max_value=9),
    meta=st.sampled_from([{}, {"content_type": "text/html"}, {"x": '"}, "meta": {'}]),
)
def test_content_is_decoded_piece_by_piece_exactly(content: str, piece: int, meta: Any) -> None:
    """/content never holds the stored text whole: slices cut anywhere decode to the content."""
    stored = json.dumps(batch.Result(content, meta).to_json(), ensure_ascii=False).encode()
    longest = [0]

    def read(offset: int, size: int) -> bytes:
        longest[0] = max(longest[0], size)
        return stored[offset : offset + size]

    old = batch_flask._SLICE
    batch_flask._SLICE = piece
    try:
        parts = batch_flask._content_parts(read)
        assert parts is not None
        got_meta, pieces = parts
        assert (got_meta, "".join(pieces)) == (meta, content)
    finally:
        batch_flask._SLICE = old
    assert longest[0] <= max(piece, len(batch_flask._CONTENT_PREFIX))
    assert (
        batch_flask._content_parts(lambda s, n: b'{"meta": {}, "content": ""}'[s : s + n]) is None
    )
    encoded = base64.b64encode(content.encode()).decode()
    assert b"".join(batch_flask._base64_body(iter([encoded[:piece], encoded[piece:]]))) == (
        content.encode()
    )
