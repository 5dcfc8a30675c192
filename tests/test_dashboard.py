"""The operators' store reads (every backend) and the dashboard blueprint (issue 13)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fetchers import WAIT, FakeFetch, wait_for
from _ops import HOSTILE, OPERATOR_HEADER, assert_strict, audit, make_app
from conftest import Clock, default_sigint, interrupt_and_wait
from flask import Flask, Request
from flask.testing import FlaskClient

import batch
import dcache
from batch._dashboard import CSP, PREVIEW_BYTES, dashboard

CONFIG = batch.Config(heartbeat=dt.timedelta(seconds=30), jobs_per_caller=2, jobs_total=8)
OP = {OPERATOR_HEADER: "yes"}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


def hostile_fetch(target: batch.Target) -> batch.Result:
    if "fail" in target.url:
        raise batch.FetchError(HOSTILE, hint=HOSTILE)
    return batch.Result(HOSTILE + " é" * 3000, {"note": HOSTILE})


# -- the store's operator reads, on every backend -------------------------------------------


def test_counts_pages_and_live_callers_agree_with_what_was_submitted(
    db: dcache.DB, fake: FakeFetch, clock: Clock
) -> None:
    """Counts per status, filters, newest-first pages and live-per-caller read the same truth."""
    fake.block("https://e.com/held-a", "https://e.com/held-b")
    with batch.Runner(db, fake, CONFIG, clock=clock) as runner:
        done = []
        for i in range(3):
            job_id, _ = runner.submit("alice", "gold", [{"url": f"https://e.com/{i}"}])
            assert runner.wait(job_id, timeout=WAIT) is not None
            done.append(job_id)
            clock.advance(seconds=1)
        live_a, _ = runner.submit("alice", "gold", [{"url": "https://e.com/held-a"}])
        clock.advance(seconds=1)
        live_b, _ = runner.submit("bob", "free", [{"url": "https://e.com/held-b"}])
        fake.wait_entered("https://e.com/held-b")

        assert db.live_by_caller() == {"alice": 1, "bob": 1}
        assert db.status_counts(now=clock()) == {"done": 3, "running": 2}
        assert db.status_counts(caller="bob", now=clock()) == {"running": 1}
        newest = [j.id for j in db.jobs_page(now=clock())]
        assert newest == [live_b, live_a, *reversed(done)]
        assert [j.id for j in db.jobs_page(offset=1, limit=2, now=clock())] == [live_a, done[2]]
        assert [j.id for j in db.jobs_page(status="done", caller="alice", now=clock())] == list(
            reversed(done)
        )
        assert db.jobs_page(status="running", caller="carol", now=clock()) == []
        fake.release("https://e.com/held-a", "https://e.com/held-b")
        assert runner.wait(live_a, timeout=WAIT) is not None
        assert runner.wait(live_b, timeout=WAIT) is not None
    assert db.live_by_caller() == {}


def test_lapsed_jobs_leave_the_counts_and_pages(
    db: dcache.DB, fake: FakeFetch, clock: Clock
) -> None:
    """An operator sees what callers can see: a job whose lease lapsed is gone everywhere."""
    with batch.Runner(db, fake, CONFIG, clock=clock) as runner:
        job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        assert db.job_summary(job_id, now=clock()) is not None
        later = clock() + CONFIG.ttl + dt.timedelta(seconds=1)
        assert db.status_counts(now=later) == {}
        assert db.jobs_page(now=later) == []
        assert db.job_summary(job_id, now=later) is None
        assert db.target_result(job_id, 0, now=later) is None


def test_job_summary_gives_sizes_not_results(db: dcache.DB, fake: FakeFetch) -> None:
    """The job page lists targets without loading megabytes: byte sizes; results on demand."""
    fake.behave("https://e.com/big", lambda t: batch.Result("é" * 5000, {"k": "v"}))
    fake.behave("https://e.com/bad", lambda t: (_ for _ in ()).throw(batch.FetchError("no", "h")))
    with batch.Runner(db, fake, CONFIG) as runner:
        job_id, _ = runner.submit(
            "alice", "gold", [{"url": "https://e.com/big"}, {"url": "https://e.com/bad"}]
        )
        assert runner.wait(job_id, timeout=WAIT) is not None
    found = db.job_summary(job_id)
    assert found is not None
    job, rows = found
    assert (job.id, job.status, job.targets_done, job.targets_failed) == (job_id, "partial", 2, 1)
    big, bad = rows
    stored = db.target_result(job_id, 0)
    assert stored is not None and json.loads(stored)["content"] == "é" * 5000
    assert big.result_bytes == len(stored.encode("utf-8"))  # bytes, not characters
    assert (big.idx, big.url, big.status) == (0, "https://e.com/big", "done")
    assert (bad.status, bad.error, bad.hint, bad.result_bytes) == ("failed", "no", "h", None)
    assert db.target_result(job_id, 1) is None


@pytest.mark.parametrize("key", ["", "nope", "a\x00b", "\ud800", "x" * 500])
def test_operator_reads_of_unknown_or_unstorable_keys_answer_empty(db: dcache.DB, key: str) -> None:
    """No key an operator can type (or forge in a URL) reaches the database as an error."""
    assert db.job_summary(key) is None
    assert db.target_result(key, 0) is None
    assert db.target_result("a" * 32, 2**40) is None
    assert db.status_counts(caller=key) == {}
    assert db.jobs_page(caller=key) == []
    assert db.jobs_page(status=key) == []


# -- the blueprint --------------------------------------------------------------------------


@pytest.fixture
def runner(fake: FakeFetch) -> Iterator[batch.Runner]:
    store = dcache.DB.memory()
    r = batch.Runner(store, fake, CONFIG)
    try:
        yield r
    finally:
        fake.release_all()
        r.close(timeout=WAIT)
        store.close()


@pytest.fixture
def client(runner: batch.Runner) -> FlaskClient:
    return make_app(runner).test_client()


def _finished(runner: batch.Runner, job_id: str) -> batch.Job:
    job = runner.wait(job_id, timeout=WAIT)
    assert job is not None
    return job


def test_every_route_is_forbidden_without_authorization(
    client: FlaskClient, runner: batch.Runner
) -> None:
    """authorize(request) is the only gate: no page, poll, preview or cancel slips past it."""
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    for path in (
        "/batch/",
        f"/batch/jobs/{job_id}",
        f"/batch/jobs/{job_id}/progress.json",
        f"/batch/jobs/{job_id}/targets/0/result",
        "/batch/no-such-page",
    ):
        resp = client.get(path)
        assert resp.status_code == 403, path
        assert "alice" not in resp.get_data(as_text=True)
    asset = client.get("/batch/static/dashboard.js")  # the package's own, for the 403 page
    assert asset.status_code == 200
    asset.close()
    assert client.post(f"/batch/jobs/{job_id}/cancel").status_code == 403


def test_pages_need_nothing_a_strict_csp_forbids(client: FlaskClient, runner: batch.Runner) -> None:
    """Every page carries the policy and uses only the blueprint's own script and styles."""
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    for path in ("/batch/", f"/batch/jobs/{job_id}", f"/batch/jobs/{job_id}?show=0", "/batch/x"):
        resp = client.get(path, headers=OP)
        assert resp.headers["Content-Security-Policy"] == CSP
        assert "default-src 'self'" in CSP
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["Cache-Control"] == "no-store"
        assert_strict(resp.get_data(as_text=True))
    for asset, kind in (("dashboard.js", "javascript"), ("dashboard.css", "text/css")):
        resp = client.get(f"/batch/static/{asset}", headers=OP)
        assert resp.status_code == 200 and kind in resp.content_type
        resp.close()


def test_stored_text_is_never_rendered_as_html(fake: FakeFetch) -> None:
    """Results, errors, hints, URLs and callers are untrusted: each shows as text, escaped."""
    store = dcache.DB.memory()
    with batch.Runner(store, hostile_fetch, CONFIG) as runner:
        client = make_app(runner).test_client()
        url = "https://e.com/" + HOSTILE
        job_id, _ = runner.submit(
            HOSTILE, "gold", [{"url": url}, {"url": "https://e.com/fail" + HOSTILE}]
        )
        _finished(runner, job_id)
        for path in ("/batch/", f"/batch/jobs/{job_id}?show=0"):
            html = client.get(path, headers=OP).get_data(as_text=True)
            page = assert_strict(html)
            assert "<img" not in html and "<script>window" not in html
            assert HOSTILE in "".join(page.text), "shown as text, not dropped"
        html = client.get(f"/batch/jobs/{job_id}?show=0", headers=OP).get_data(as_text=True)
        assert html.count("&lt;script&gt;window.__pwned = 1&lt;/script&gt;") >= 4
        preview = client.get(f"/batch/jobs/{job_id}/targets/0/result", headers=OP)
        assert preview.mimetype == "text/plain"
        assert preview.headers["X-Content-Type-Options"] == "nosniff"
        assert preview.get_data(as_text=True).startswith(HOSTILE)
        progress = client.get(f"/batch/jobs/{job_id}/progress.json", headers=OP)
        assert progress.mimetype == "application/json"
        assert progress.get_json()["targets"][1]["error"] == HOSTILE  # data, for textContent
    store.close()


def test_job_list_filters_counts_pages_and_shows_callers_at_cap(
    fake: FakeFetch, clock: Clock
) -> None:
    """The list answers an operator's first questions: what is live, who is at the cap."""
    store = dcache.DB.memory()
    fake.block("https://e.com/held-1", "https://e.com/held-2")
    with batch.Runner(store, fake, CONFIG, clock=clock) as runner:
        client = make_app(runner).test_client()
        small = Flask("small")
        small.register_blueprint(dashboard(runner, lambda r: True, page_size=2))
        small_client = small.test_client()
        ids = []
        for i in range(3):
            job_id, _ = runner.submit("bob", "free", [{"url": f"https://e.com/{i}"}])
            _finished(runner, job_id)
            ids.append(job_id)
            clock.advance(seconds=1)
        held = []
        for i in (1, 2):
            held.append(runner.submit("alice", "gold", [{"url": f"https://e.com/held-{i}"}])[0])
            clock.advance(seconds=1)
        html = client.get("/batch/", headers=OP).get_data(as_text=True)
        assert re.search(r'id="live-count">2 <span class="of">of 8</span>', html)
        cap = html[html.index("Callers at their cap") : html.index('<nav class="statuses"')]
        assert "alice" in cap and "bob" not in cap
        assert 'data-status-count="done">3<' in html and 'data-status-count="running">2<' in html
        running = client.get("/batch/?status=running", headers=OP).get_data(as_text=True)
        assert re.findall(r'data-job-id="(\w+)"', running) == list(reversed(held))
        bob = client.get("/batch/?caller=bob", headers=OP).get_data(as_text=True)
        assert re.findall(r'data-job-id="(\w+)"', bob) == list(reversed(ids))
        first = small_client.get("/batch/").get_data(as_text=True)
        assert re.findall(r'data-job-id="(\w+)"', first) == list(reversed(held))
        assert "page 1 of 3" in first and 'href="/batch/?page=2"' in first
        third = small_client.get("/batch/?page=3").get_data(as_text=True)
        assert re.findall(r'data-job-id="(\w+)"', third) == [ids[0]]
        assert 'rel="next"' not in third and 'href="/batch/?page=2" rel="prev"' in third
        fake.release("https://e.com/held-1", "https://e.com/held-2")
        for job_id in held:
            _finished(runner, job_id)
    store.close()


def test_progress_answers_304_until_the_job_changes(
    client: FlaskClient, runner: batch.Runner, fake: FakeFetch
) -> None:
    """Conditional polls cost one key read and no body while nothing changed."""
    fake.block("https://e.com/a", "https://e.com/b")
    job_id, _ = runner.submit(
        "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
    )
    fake.wait_entered("https://e.com/a")
    url = f"/batch/jobs/{job_id}/progress.json"
    first = client.get(url, headers=OP)
    body = first.get_json()
    assert body["job"]["status"] == "running" and body["job"]["stored"] == 0
    assert [t["status"] for t in body["targets"]] == ["running", "pending"]
    assert body["targets"][0]["in_flight"] is True
    etag = first.headers["ETag"]
    again = client.get(url, headers={**OP, "If-None-Match": etag})
    assert again.status_code == 304 and again.get_data() == b""
    fake.release("https://e.com/a")
    fake.wait_entered("https://e.com/b")
    changed = client.get(url, headers={**OP, "If-None-Match": etag})
    assert changed.status_code == 200 and changed.headers["ETag"] != etag
    assert [t["status"] for t in changed.get_json()["targets"]] == ["done", "running"]
    fake.release("https://e.com/b")
    _finished(runner, job_id)
    end = client.get(url, headers={**OP, "If-None-Match": changed.headers["ETag"]}).get_json()
    assert end["job"]["finished"] is True and end["job"]["live"] is False
    assert client.get("/batch/jobs/nope/progress.json", headers=OP).status_code == 404


def test_job_page_marks_the_target_in_flight(
    client: FlaskClient, runner: batch.Runner, fake: FakeFetch
) -> None:
    """Without JavaScript, a reload shows which target is being fetched and a Cancel form."""
    fake.block("https://e.com/a")
    job_id, _ = runner.submit(
        "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
    )
    fake.wait_entered("https://e.com/a")
    html = client.get(f"/batch/jobs/{job_id}", headers=OP).get_data(as_text=True)
    assert re.search(r'<tr class="target in-flight" data-idx="0" data-status="running">', html)
    assert '<tr class="target" data-idx="1" data-status="pending">' in html
    assert re.search(r'<form id="cancel-form" method="post" action="[^"]+/cancel">', html)
    fake.release("https://e.com/a")
    _finished(runner, job_id)
    html = client.get(f"/batch/jobs/{job_id}", headers=OP).get_data(as_text=True)
    assert "in-flight" not in html and re.search(r'<form id="cancel-form"[^>]* hidden>', html)
    missing = client.get("/batch/jobs/0123456789abcdef", headers=OP)
    assert missing.status_code == 404 and "No such job" in missing.get_data(as_text=True)


def _csrf(client: FlaskClient, job_id: str) -> str:
    html = client.get(f"/batch/jobs/{job_id}", headers=OP).get_data(as_text=True)
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match is not None
    return match.group(1)


def test_cancel_needs_the_forms_token_and_says_what_happened(
    client: FlaskClient, runner: batch.Runner, fake: FakeFetch
) -> None:
    """A forged or cross-site POST cancels nothing; the operator's own form does, and is told."""
    fake.block("https://e.com/a")
    job_id, _ = runner.submit(
        "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
    )
    fake.wait_entered("https://e.com/a")
    token = _csrf(client, job_id)
    url = f"/batch/jobs/{job_id}/cancel"
    assert client.post(url, headers=OP, data={"csrf": "x" * 43}).status_code == 400
    evil = {**OP, "Origin": "https://evil.example"}
    assert client.post(url, headers=evil, data={"csrf": token}).status_code == 400
    fresh = make_app(runner).test_client()  # no cookie: a token alone proves nothing
    assert fresh.post(url, headers=OP, data={"csrf": token}).status_code == 400
    job = runner.job(job_id)
    assert job is not None and job.status == "running"

    resp = client.post(url, headers={**OP, "Origin": "http://localhost"}, data={"csrf": token})
    assert resp.status_code == 303
    page = client.get(resp.headers["Location"], headers=OP).get_data(as_text=True)
    assert 'id="cancel-outcome"' in page and "Cancelled" in page
    fake.release("https://e.com/a")
    assert _finished(runner, job_id).status == "cancelled"
    assert fake.count("https://e.com/b") == 0
    again = client.post(url, headers=OP, data={"csrf": token})
    page = client.get(again.headers["Location"], headers=OP).get_data(as_text=True)
    assert "already finished" in page
    unknown = client.post("/batch/jobs/0123456789abcdef/cancel", headers=OP, data={"csrf": token})
    assert unknown.status_code == 404


def test_a_results_first_kilobytes_on_demand(
    client: FlaskClient, runner: batch.Runner, fake: FakeFetch
) -> None:
    """A preview is bounded (never megabytes into a page) and cut on a character boundary."""
    fake.behave("https://e.com/a", lambda t: batch.Result("é" * 10_000))
    job_id, _ = runner.submit(
        "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
    )
    _finished(runner, job_id)
    resp = client.get(f"/batch/jobs/{job_id}/targets/0/result", headers=OP)
    text = resp.get_data(as_text=True)
    assert text == "é" * (PREVIEW_BYTES // 2)
    assert resp.headers["X-Result-Bytes"] == "20000"
    small = client.get(f"/batch/jobs/{job_id}/targets/0/result?bytes=5", headers=OP)
    assert small.get_data(as_text=True) == "éé"
    html = client.get(f"/batch/jobs/{job_id}?show=0", headers=OP).get_data(as_text=True)
    shown = re.search(r'<pre class="t-preview">(.*?)</pre>', html, re.S)
    assert shown is not None and shown.group(1) == "é" * (PREVIEW_BYTES // 2)
    assert "content is 19.5 KiB; the first 4 KiB are shown" in html
    assert client.get(f"/batch/jobs/{job_id}/targets/7/result", headers=OP).status_code == 404
    assert audit(html).inline_scripts == 0


def test_store_outage_is_a_503_page(tmp_path: Path, fake: FakeFetch) -> None:
    """A database that went away is reported as such, not as a crash."""
    store = dcache.DB.open(f"sqlite:///{tmp_path / 's.sqlite3'}")
    with batch.Runner(store, fake, CONFIG) as runner:
        client = make_app(runner).test_client()
        assert client.get("/batch/", headers=OP).status_code == 200
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE batch_target")
            conn.exec_driver_sql("DROP TABLE batch_job")
        resp = client.get("/batch/", headers=OP)
        assert resp.status_code == 503 and "unavailable" in resp.get_data(as_text=True)
        with store.engine.begin() as conn:  # put the tables back for a clean close
            dcache._schema.metadata.create_all(conn)
    store.close()


# -- python -m batch serve ----------------------------------------------------------------


def test_serve_answers_on_loopback_and_refuses_other_hosts(tmp_path: Path) -> None:
    """The local server shows the dashboard and API, only to its own loopback host names."""
    url = f"sqlite:///{tmp_path / 'serve.sqlite3'}"
    code = (
        "import argparse, sys\n"
        "from batch import _serve\n"
        "p = argparse.ArgumentParser(); _serve.add_parser(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            "--db",
            url,
            "--port",
            "0",
        ],  # the default fetch: the CLI's, which reads file: URLs
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"},
        preexec_fn=default_sigint,  # the test's SIGINT is a Ctrl-C
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/batch/", line)
        assert match, line
        base = f"http://127.0.0.1:{match.group(1)}"
        with urllib.request.urlopen(base + "/batch/", timeout=WAIT) as resp:
            assert resp.status == 200 and "Jobs" in resp.read().decode()
            assert resp.headers["Content-Security-Policy"] == CSP
        target = tmp_path / "t.txt"
        target.write_text("hello")
        body = json.dumps({"targets": [{"url": target.as_uri()}]}).encode()
        req = urllib.request.Request(
            base + "/jobs", body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=WAIT) as resp:
            job_id = json.load(resp)["job"]["id"]

        def done() -> bool:
            with urllib.request.urlopen(f"{base}/jobs/{job_id}", timeout=WAIT) as r:
                return bool(json.load(r)["job"]["finished_at"])

        wait_for(done, "the served job to finish")
        with urllib.request.urlopen(f"{base}/batch/jobs/{job_id}", timeout=WAIT) as resp:
            assert "file://" in resp.read().decode()
        rebinding = urllib.request.Request(base + "/batch/", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(rebinding, timeout=WAIT)
        assert err.value.code == 403
    finally:
        try:
            assert interrupt_and_wait(proc, WAIT) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)


def test_a_failed_notification_is_shown_and_redelivered_from_the_page(fake: FakeFetch) -> None:
    """The job page shows the webhook's state; Redeliver (with the form's token) re-sends."""
    from test_webhooks import SECRET, Receiver, poll

    receiver = Receiver([503, 503])
    store = dcache.DB.memory()
    hooks = batch.Webhooks(
        secret=SECRET, allow=["127.0.0.1"], schedule=(dt.timedelta(0),), poll=0.05
    )
    r = batch.Runner(store, fake, CONFIG, webhooks=hooks)
    try:
        client = make_app(r).test_client()
        job_id, _ = r.submit("alice", "gold", [{"url": "https://e.com/a"}], notify=receiver.url)
        poll(lambda: (n := r.notification(job_id)) and n.status == "failed")
        page = client.get(f"/batch/jobs/{job_id}", headers=OP).get_data(as_text=True)
        assert 'id="notification-status"' in page and ">failed<" in page
        assert "HTTP 503" in page and 'id="redeliver-form"' in page
        url = f"/batch/jobs/{job_id}/redeliver"
        assert client.post(url, headers=OP, data={"csrf": "x" * 43}).status_code == 400
        token = _csrf(client, job_id)
        resp = client.post(url, headers=OP, data={"csrf": token})
        assert resp.status_code == 303
        assert "queued again" in client.get(resp.headers["Location"], headers=OP).get_data(
            as_text=True
        )
        note = poll(lambda: (n := r.notification(job_id)) and n.status == "delivered" and n)
        assert note.attempts == 1  # a redelivery starts the schedule over
        assert len({h["webhook-id"] for h, _ in receiver.seen}) == 1
        page = client.get(f"/batch/jobs/{job_id}", headers=OP).get_data(as_text=True)
        assert ">delivered<" in page
    finally:
        r.close(timeout=WAIT)
        store.close()
        receiver.close()


# -- review fixes ---------------------------------------------------------------------------

UNUSABLE_NUMBERS = ["²", "①", "٣", "abc", "-1", "+0", " 0", "1_0", "0x1", "1e3", ""]


@pytest.mark.parametrize("raw", UNUSABLE_NUMBERS)
def test_unusable_numbers_in_the_query_are_ignored(
    client: FlaskClient, runner: batch.Runner, raw: str
) -> None:
    """A number is what ASCII digits spell: '²' or '①' (which isdigit() takes) is no crash."""
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    page = client.get(f"/batch/jobs/{job_id}", query_string={"show": raw}, headers=OP)
    assert page.status_code == 200
    assert '<pre class="t-preview"></pre>' in page.get_data(as_text=True)  # no preview
    listing = client.get("/batch/", query_string={"page": raw}, headers=OP)
    assert listing.status_code == 200 and "page 1 of 1" in listing.get_data(as_text=True)
    result = client.get(
        f"/batch/jobs/{job_id}/targets/0/result", query_string={"bytes": raw}, headers=OP
    )
    assert result.status_code == 200
    assert result.get_data(as_text=True) == "content of https://e.com/a"


def test_numbers_in_the_query_are_clamped_not_refused(
    client: FlaskClient, runner: batch.Runner, fake: FakeFetch
) -> None:
    """Leading zeros mean nothing; a number past the bounds (4301 digits too) is clamped."""
    fake.behave("https://e.com/a", lambda t: batch.Result("x" * 100_000))
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    shown = client.get(f"/batch/jobs/{job_id}?show=000", headers=OP).get_data(as_text=True)
    assert "x" * PREVIEW_BYTES + "</pre>" in shown
    far = client.get(f"/batch/jobs/{job_id}?show=" + "9" * 4301, headers=OP)
    assert far.status_code == 200 and '<pre class="t-preview"></pre>' in far.get_data(as_text=True)
    url = f"/batch/jobs/{job_id}/targets/0/result?bytes="
    assert len(client.get(url + "0", headers=OP).get_data()) == 1
    assert len(client.get(url + "0002", headers=OP).get_data()) == 2
    assert len(client.get(url + "9" * 40, headers=OP).get_data()) == 65536
    assert len(client.get(url + "9" * 4301, headers=OP).get_data()) == 65536
    for many in ("9" * 40, "9" * 4301):
        listing = client.get("/batch/?page=" + many, headers=OP)
        assert listing.status_code == 200
        assert "page 1000000 of 1" in listing.get_data(as_text=True)


def test_the_caller_filter_matches_the_stored_caller_exactly(
    client: FlaskClient, runner: batch.Runner
) -> None:
    """Callers are stored verbatim: ' bob ' and 'bob' are two callers, each with their own list."""
    spaced, _ = runner.submit(" bob ", "gold", [{"url": "https://e.com/a"}])
    plain, _ = runner.submit("bob", "gold", [{"url": "https://e.com/b"}])
    _finished(runner, spaced)
    _finished(runner, plain)
    for caller, job_id in ((" bob ", spaced), ("bob", plain)):
        html = client.get("/batch/", query_string={"caller": caller}, headers=OP).get_data(
            as_text=True
        )
        assert re.findall(r'data-job-id="(\w+)"', html) == [job_id], caller
        assert 'data-status-count="done">1<' in html
        assert f'name="caller" value="{caller}"' in html  # the form keeps it as typed


def test_authorize_may_answer_with_its_own_http_error(runner: batch.Runner) -> None:
    """HTTP Basic auth works: a 401 raised by authorize keeps its WWW-Authenticate header."""
    from werkzeug.datastructures import WWWAuthenticate
    from werkzeug.exceptions import Unauthorized

    def basic(request: Request) -> bool:
        if request.authorization and request.authorization.password == "pw":
            return True
        raise Unauthorized(www_authenticate=WWWAuthenticate("basic", {"realm": "ops"}))

    client = make_app(runner, basic).test_client()
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    for path, kind in (("/batch/", "text/html"), (f"/batch/jobs/{job_id}/progress.json", "json")):
        resp = client.get(path)
        assert resp.status_code == 401, path
        assert resp.headers["WWW-Authenticate"] == "Basic realm=ops"
        assert kind in resp.content_type
        assert resp.headers["Content-Security-Policy"] == CSP
        assert "alice" not in resp.get_data(as_text=True)
        assert client.get(path, auth=("op", "pw")).status_code == 200


# (method, path under /batch/jobs/<id>, the Allow header of that path)
KNOWN_PATHS = [
    ("", "GET, HEAD"),
    ("/progress.json", "GET, HEAD"),
    ("/targets/0/result", "GET, HEAD"),
    ("/cancel", "POST"),
    ("/redeliver", "POST"),
]


def test_other_methods_get_the_dashboards_405_with_its_headers(
    client: FlaskClient, runner: batch.Runner
) -> None:
    """PUT, DELETE, PATCH, WebDAV's... pass the gate and get the pages' headers and Allow."""
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    paths = [("/batch/", "GET, HEAD"), ("/batch/static/dashboard.js", "GET, HEAD")]
    paths += [(f"/batch/jobs/{job_id}{p}", allow) for p, allow in KNOWN_PATHS]
    for path, allow in paths:
        methods = {"PUT", "DELETE", "PATCH", "PROPFIND", "GET", "POST"} - set(allow.split(", "))
        for method in sorted(methods):
            stranger = client.open(path, method=method)
            assert stranger.status_code == 403, (method, path)
            assert stranger.headers["Content-Security-Policy"] == CSP
            resp = client.open(path, method=method, headers=OP)
            assert resp.status_code == 405, (method, path)
            assert resp.headers["Allow"] == f"{allow}, OPTIONS", (method, path)
            assert resp.headers["Content-Security-Policy"] == CSP
            assert resp.headers["X-Frame-Options"] == "DENY"
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            assert resp.headers["Cache-Control"] == "no-store"
            if not path.endswith(".json"):
                assert_strict(resp.get_data(as_text=True))  # the dashboard's own page
        options = client.open(path, method="OPTIONS", headers=OP)
        assert options.status_code == 204, path
        assert options.headers["Allow"] == f"{allow}, OPTIONS"
        assert options.headers["Content-Security-Policy"] == CSP
        assert client.open(path, method="OPTIONS").status_code == 403
    for method in ("PUT", "DELETE", "OPTIONS"):
        unknown = client.open("/batch/no/such/page", method=method, headers=OP)
        assert unknown.status_code == 404 and unknown.headers["Content-Security-Policy"] == CSP
    job = runner.job(job_id)
    assert job is not None and job.status == "done"


def test_redeliver_without_a_notification_says_there_is_none(
    client: FlaskClient, runner: batch.Runner
) -> None:
    """A job submitted without a webhook has nothing to resend, and the page says just that."""
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    _finished(runner, job_id)
    token = _csrf(client, job_id)
    resp = client.post(f"/batch/jobs/{job_id}/redeliver", headers=OP, data={"csrf": token})
    assert resp.status_code == 303
    page = client.get(resp.headers["Location"], headers=OP).get_data(as_text=True)
    assert "no notification" in page and "still pending" not in page


@pytest.mark.parametrize(
    ("answer", "status"),
    [(True, 200), (False, 403), (None, 403), (1, 403), ("yes", 403), ("denied: no", 403)],
)
def test_only_a_true_answer_gets_in(runner: batch.Runner, answer: object, status: int) -> None:
    """authorize's answer is taken literally: a truthy string or 1 is no operator's True."""
    client = make_app(runner, lambda request: answer).test_client()  # type: ignore[arg-type,return-value]
    assert client.get("/batch/").status_code == status
