"""Reading results at scale (issue 12): results on demand, one target at a time, and
"expired" told apart from "unknown" by tombstones. Every backend of the ``db`` fixture."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator

import pytest
from _fetchers import WAIT, FakeFetch
from conftest import Clock

import batch
import dcache

TTL = dt.timedelta(hours=1)
A, B, C = (f"https://example.com/{n}" for n in "abc")


@pytest.fixture
def fake() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


@pytest.fixture
def runner(db: dcache.DB, fake: FakeFetch, clock: Clock) -> Iterator[batch.Runner]:
    with batch.Runner(db, fake, batch.Config(ttl=TTL, jobs_per_caller=4), clock=clock) as r:
        yield r


def test_status_without_results_gives_each_results_size_in_bytes(
    runner: batch.Runner, fake: FakeFetch
) -> None:
    """A poll of 32 large results should read their sizes, not their megabytes."""
    fake.behave(A, lambda t: batch.Result("é" * 1000, {"k": "ü"}))
    fake.behave(B, lambda t: (_ for _ in ()).throw(batch.FetchError("nope")))
    fake.block(C)
    job_id, _ = runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
    fake.wait_entered(C)
    found = runner.status(job_id, results=False)
    assert found is not None
    job, (a, b, c) = found
    assert job.status == "running"
    stored = json.dumps(batch.Result("é" * 1000, {"k": "ü"}).to_json(), ensure_ascii=False)
    assert (a.status, a.result, a.result_bytes) == ("done", None, len(stored.encode("utf-8")))
    assert (b.status, b.result, b.error) == ("failed", None, "nope")
    assert b.result_bytes is None  # nothing stored
    assert (c.status, c.result, c.result_bytes) == ("running", None, None)
    assert a.to_json()["bytes"] == a.result_bytes and "bytes" not in c.to_json()
    full = runner.status(job_id)
    assert full is not None
    assert full[1][0].result == batch.Result("é" * 1000, {"k": "ü"})
    assert full[1][0].result_bytes is None
    fake.release(C)
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_one_target_is_read_with_its_result_alone(runner: batch.Runner, fake: FakeFetch) -> None:
    """runner.result(job, idx): pull 32 large results one at a time with bounded memory."""
    fake.block(B)
    job_id, _ = runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
    fake.wait_entered(B)
    a = runner.result(job_id, 0)
    assert a is not None
    assert (a.idx, a.url, a.status, a.result) == (
        0,
        A,
        "done",
        batch.Result(f"content of {A}", {"url": A}),
    )
    b = runner.result(job_id, 1)
    assert b is not None and (b.status, b.result) == ("running", None)
    c = runner.result(job_id, 2)
    assert c is not None and (c.status, c.result) == ("pending", None)
    for idx in (3, -1, True, "0"):
        assert runner.result(job_id, idx) is None  # type: ignore[arg-type]
    assert runner.result("0" * 32, 0) is None
    assert runner.result("../etc", 0) is None
    fake.release(B)
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_expired_is_told_from_unknown_until_the_tombstone_goes(
    runner: batch.Runner, fake: FakeFetch, clock: Clock, db: dcache.DB
) -> None:
    """410 Gone for a job whose lease lapsed, purged or not; 404 only for what never was."""
    job_id, _ = runner.submit("alice", "free", [{"url": A}])
    done = runner.wait(job_id, timeout=WAIT)
    assert done is not None and done.expires_at is not None
    assert runner.lookup(job_id) == "found"
    assert runner.lookup("0" * 32) == "unknown"
    assert runner.lookup("not an id!") == "unknown"

    clock.now = done.expires_at  # the lease has lapsed; the row is still there
    assert runner.status(job_id) is None
    assert runner.lookup(job_id) == "expired"
    assert db.lookup(job_id, now=clock()) == dcache.Lookup("expired", "alice", done.expires_at)

    clock.advance(days=1)
    assert db.purge_expired(now=clock()) == 1  # purged: its tombstone answers now
    assert runner.lookup(job_id) == "expired"
    assert db.lookup(job_id, now=clock()) == dcache.Lookup("expired", "alice", done.expires_at)

    clock.now = done.expires_at + dcache.TOMBSTONE_TTL + dt.timedelta(seconds=1)
    assert db.purge_expired(now=clock()) == 0  # and the tombstone is purged in turn
    assert runner.lookup(job_id) == "unknown"


def test_a_live_job_never_reads_as_expired_whatever_the_clock(
    runner: batch.Runner, fake: FakeFetch, clock: Clock
) -> None:
    """A live job's lease is its last write + ttl, and a live job is never hidden."""
    fake.block(B)
    job_id, _ = runner.submit("alice", "free", [{"url": u} for u in (A, B)])
    fake.wait_entered(B)
    job = runner.job(job_id)
    assert job is not None and job.expires_at is not None and job.updated_at is not None
    assert job.expires_at == job.updated_at + TTL
    clock.advance(days=30)
    assert runner.lookup(job_id) == "found"
    assert runner.status(job_id) is not None
    fake.release(B)
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_submit_job_answers_with_the_job_the_submit_transaction_saw(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB
) -> None:
    """An HTTP layer answers a POST with the job: no second read of it."""
    job, reused = runner.submit_job("alice", "free", [{"url": A}])
    assert not reused
    assert (job.status, job.targets_total, job.caller, job.caller_class) == (
        "running",
        1,
        "alice",
        "free",
    )
    again, reused = runner.submit_job("alice", "free", [{"url": A}])
    assert reused and again.id == job.id
    assert runner.wait(job.id, timeout=WAIT) is not None


def test_a_client_key_reused_for_other_targets_is_told_without_reading_targets(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB
) -> None:
    """The stored hash of the canonical targets decides: no target row is read."""
    from sqlalchemy import event

    job_id, _ = runner.submit("alice", "free", [{"url": A}], idempotency_key="k1")
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *rest: object) -> None:
        seen.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        with pytest.raises(batch.IdempotencyKeyMismatchError):
            runner.submit("alice", "free", [{"url": B}], idempotency_key="k1")
        assert runner.submit("alice", "free", [{"url": A}], idempotency_key="k1") == (
            job_id,
            True,
        )
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    assert not [s for s in seen if "batch_target" in s and s.lstrip().upper().startswith("SELECT")]
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_a_job_stored_before_payload_keys_is_still_checked_by_its_targets(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB
) -> None:
    """Rows of the previous release have no payload key: the targets themselves decide."""
    from sqlalchemy import update

    from dcache._schema import jobs

    job_id, _ = runner.submit("alice", "free", [{"url": A}], idempotency_key="k1")
    with db.engine.begin() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(payload_key=None))
    with pytest.raises(batch.IdempotencyKeyMismatchError):
        runner.submit("alice", "free", [{"url": B}], idempotency_key="k1")
    assert runner.submit("alice", "free", [{"url": A}], idempotency_key="k1") == (job_id, True)
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_streamed_read_hands_out_stored_texts_one_row_at_a_time(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB, clock: Clock
) -> None:
    """The pass-through read: the same rows as the plain read, results as stored, no decode."""
    fake.behave(A, lambda t: batch.Result("é" * 3000, {"content_type": "text/html"}))
    fake.block(C)
    job_id, _ = runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
    fake.wait_entered(C)
    plain = db.get_job_with_targets(job_id, now=clock())
    assert plain is not None
    for results in (True, False):
        stream = db.get_job_with_targets_streamed(job_id, now=clock(), results=results)
        assert stream is not None
        with stream:
            assert stream.job == plain[0]
            rows = list(stream)
        expected = db.get_job_with_targets(job_id, now=clock(), results=results)
        assert expected is not None and rows == expected[1]
    assert rows[0].result is None and rows[0].result_bytes is not None
    raw = runner.status_raw(job_id)
    assert raw is not None
    with raw:
        targets = list(raw)
    assert [t.status for t in targets] == ["done", "done", "running"]
    assert targets[0].result == plain[1][0].result  # the stored text itself
    assert json.loads(targets[0].result or "") == {
        "content": "é" * 3000,
        "meta": {"content_type": "text/html"},
    }
    # Closed half-way (a client gone mid-answer): the connection goes back to the pool.
    stream = db.get_job_with_targets_streamed(job_id, now=clock())
    assert stream is not None
    next(iter(stream))
    stream.close()
    assert db.get_job_with_targets_streamed("0" * 32, now=clock()) is None
    assert db.get_job_with_targets_streamed("bad\x00id", now=clock()) is None
    fake.release(C)
    assert runner.wait(job_id, timeout=WAIT) is not None


def test_cancel_job_is_one_compare_and_set_answering_with_the_job(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB, clock: Clock
) -> None:
    """DELETE's store call: flips a live job, says who won, returns the row it decided on."""
    fake.block(A)
    job_id, _ = runner.submit("alice", "free", [{"url": A}, {"url": B}])
    fake.wait_entered(A)
    assert db.cancel_job(job_id, now=clock(), caller="mallory") == (False, None)
    assert runner.job(job_id).status == "running"  # type: ignore[union-attr]
    won, job = runner.cancel_job(job_id, caller="alice")
    assert won and job is not None
    assert (job.status, job.updated_at, job.expires_at) == ("cancelled", clock(), clock() + TTL)
    again, same = runner.cancel_job(job_id, caller="alice")
    assert not again and same is not None and same.status == "cancelled"
    assert runner.cancel_job("0" * 32) == (False, None)
    fake.release(A)
    finished = runner.wait(job_id, timeout=WAIT)
    assert finished is not None and finished.status == "cancelled"
    assert finished.targets_done == 1  # the in-flight target was stored, the next never ran


def test_every_read_shows_the_same_target_in_flight(
    runner: batch.Runner, fake: FakeFetch, db: dcache.DB
) -> None:
    """The runner's reads, its pass-through read, the HTTP API's streamed answers, the
    dashboard and the CLI's store reader agree: the target a running job's drain holds is
    ``running``, the ones after it ``pending``; once the job has ended, nothing is."""
    from flask import Flask

    from batch import flask as batch_flask
    from batch._cli import StoreReader
    from batch._dashboard import _in_flight, _progress

    app = Flask("reads")
    batch_flask.init_app(app, runner, lambda request: ("alice", "free"))
    http = app.test_client()

    def dashboard() -> list[str]:
        found = db.job_summary(job_id)
        assert found is not None
        job, rows = found
        progress = [t["status"] for t in _progress(job, rows)["targets"]]
        flight = _in_flight(job, rows)
        assert flight == (progress.index("running") if "running" in progress else -1)
        return progress

    def streamed(query: str) -> list[str]:
        resp = http.get(f"/jobs/{job_id}{query}")
        assert resp.status_code == 200 and resp.is_streamed
        return [t["status"] for t in json.loads(resp.get_data())["targets"]]

    fake.block(B)
    job_id, _ = runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
    fake.wait_entered(B)
    reader = StoreReader(db)
    shown = ["done", "running", "pending"]
    assert dashboard() == shown
    assert streamed("") == streamed("?results=false") == shown
    for idx, status in enumerate(shown):
        one = http.get(f"/jobs/{job_id}/targets/{idx}")
        assert one.status_code == 200 and json.loads(one.get_data())["status"] == status
    for results in (True, False):
        for read in (runner.status, reader.status):
            found = read(job_id, results=results)
            assert found is not None and [t.status for t in found[1]] == shown
        raw = runner.status_raw(job_id, results=results)
        assert raw is not None
        try:
            assert [t.status for t in raw] == shown
        finally:
            raw.close()
    for idx, status in enumerate(shown):
        for one in (runner.result, reader.result):
            target = one(job_id, idx)
            assert target is not None and target.status == status
        both = runner.result_raw(job_id, idx)
        assert both is not None and both[1].status == status
    fake.release(B)
    assert runner.wait(job_id, timeout=WAIT) is not None
    found = runner.status(job_id)
    assert found is not None and [t.status for t in found[1]] == ["done"] * 3
    assert dashboard() == streamed("") == ["done"] * 3
