"""io_timeout: a server that stops answering costs a store call seconds, on every path.

A small proxy (``_proxy.Proxy``) between the store and the shared PostgreSQL or MariaDB
server holds every byte back (a silent server: no reset, no TCP timer fires), either at
once or at the chunk that carries ``COMMIT``. Each path the store talks to the server by
must fail with ``StoreUnavailableError`` within ``io_timeout`` plus a little: SQLAlchemy's
``Connection.execute``, the held DBAPI cursor of the per-target write and of the status
read, and COMMIT on both (the request paths together, through the runner, are in
``test_faults.py``). The real network partition (packets dropped in a network
namespace) is in ``test_partition.py``.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from _proxy import Proxy, proxied
from conftest import backend_url, job_row_locked, queue_behind_a_lock, wipe

import batch
import dcache

IO_TIMEOUT = 2.0
LATE = 2.0  # how far past io_timeout a call may fail
WAIT = 30.0
TTL = dt.timedelta(hours=1)


@attrs.define
class Silent:
    """A store behind a proxy that can go silent, and a direct handle for checks."""

    backend: str
    proxy: Proxy
    db: dcache.DB
    direct: dcache.DB


@pytest.fixture(params=["postgresql", "mariadb"])
def silent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Silent]:
    url = backend_url(request.param, tmp_path)
    direct = dcache.DB.open(url)
    try:
        wipe(direct)
        with proxied(url) as (proxy, through):
            db = dcache.DB.open(through, io_timeout=IO_TIMEOUT, connect_timeout=IO_TIMEOUT)
            try:
                yield Silent(request.param, proxy, db, direct)
            finally:
                proxy.restore()
                db.close()
    finally:
        direct.close()


def submit(db: dcache.DB, n: int = 2, caller: str = "alice") -> dcache.JobRow:
    out = db.submit(
        job_id=batch.new_job_id(),
        caller=caller,
        caller_class="user",
        idem_key=batch.new_job_id() * 2,
        targets=[dcache.NewTarget(f"https://io.example/{caller}/{i}", "{}") for i in range(n)],
        ttl=TTL,
        jobs_per_caller=8,
        jobs_total=8,
    )
    assert out.job is not None
    return out.job


def fails_in_time(call: Callable[[], Any]) -> float:
    """Run ``call`` on a thread; it must raise StoreUnavailableError within io_timeout + LATE."""
    got: list[tuple[BaseException | None, float]] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            call()
        except BaseException as exc:
            got.append((exc, time.monotonic() - t0))
        else:
            got.append((None, time.monotonic() - t0))

    worker = threading.Thread(target=run, name="io-timeout-call", daemon=True)
    worker.start()
    worker.join(IO_TIMEOUT + LATE + 5)
    assert not worker.is_alive(), "the call hung while the server did not answer"
    raised, took = got[0]
    assert isinstance(raised, dcache.StoreUnavailableError), repr(raised)
    assert took < IO_TIMEOUT + LATE, f"took {took:.1f} s to fail"
    assert took >= IO_TIMEOUT * 0.9, f"failed after {took:.1f} s: not the deadline"
    return took


def target_statuses(db: dcache.DB, job_id: str) -> list[str]:
    found = db.get_job_with_targets(job_id)
    assert found is not None
    return [t.status for t in found[1]]


@pytest.mark.slow
def test_a_held_writer_statement_with_no_answer_fails_in_time_and_the_next_write_stores(
    silent: Silent,
) -> None:
    """The per-target write runs on a held DBAPI cursor, outside SQLAlchemy: it needs a deadline."""
    job = submit(silent.db)
    with silent.db.writer() as writer:
        assert writer.write_target(job.id, 0, status="done", result="r0", ttl=TTL).stored
        silent.proxy.stall()
        fails_in_time(lambda: writer.write_target(job.id, 1, status="done", result="r1", ttl=TTL))
        silent.proxy.sever()  # drop what the proxy held: the write never reached the server
        silent.proxy.restore()
        assert target_statuses(silent.direct, job.id) == ["done", "pending"]
        # The writer dropped its dead connection and stores on a new one.
        out = writer.write_target(job.id, 1, status="done", result="r1", ttl=TTL)
        assert (out.stored, out.status) == (True, "done")
    assert target_statuses(silent.direct, job.id) == ["done", "done"]


@pytest.mark.slow
@pytest.mark.parametrize("silent", ["postgresql"], indirect=True)
def test_a_batch_with_no_answer_fails_every_outcome_in_time_and_writes_none(
    silent: Silent,
) -> None:
    """Group commit on PostgreSQL: the batch the writer pipelines in one round trip while
    the server is silent fails as a whole, every outcome in it told StoreUnavailableError
    within the deadline, none of it written; each write then stores on retry. The first
    writer is held on a row lock until the others queue behind it, so they form one
    batch. (Elsewhere a batch is a transaction of its own: its silent COMMIT is above.)"""
    first, *rest = [submit(silent.db, n=1, caller=f"c{i}") for i in range(4)]
    errors: dict[str, BaseException] = {}
    took: dict[str, float] = {}

    def write(job: dcache.JobRow) -> None:
        t0 = time.monotonic()
        try:
            silent.db.write_target(job.id, 0, status="done", result="r", ttl=TTL)
        except dcache.StoreError as exc:
            errors[job.id] = exc
            took[job.id] = time.monotonic() - t0

    leader = threading.Thread(target=write, args=(first,))
    others = [threading.Thread(target=write, args=(j,)) for j in rest]
    with job_row_locked(silent.direct, first.id):
        queue_behind_a_lock(silent.db, leader, others, at_server=silent.direct)
        # The batch after the leader's statement goes silent.
        went_by = silent.proxy.stall_on(b"WITH changed AS")
    leader.join(WAIT)
    for t in others:
        t.join(WAIT)
        assert not t.is_alive()
    assert first.id not in errors
    assert set(errors) == {j.id for j in rest}
    assert all(isinstance(e, dcache.StoreUnavailableError) for e in errors.values()), errors
    assert all(t < IO_TIMEOUT + LATE for t in took.values()), took
    assert went_by.is_set()
    silent.proxy.sever()  # what the proxy held never reaches the server
    silent.proxy.restore()
    assert target_statuses(silent.direct, first.id) == ["done"]
    for job in rest:
        assert target_statuses(silent.direct, job.id) == ["pending"]
        assert silent.db.write_target(job.id, 0, status="done", result="r", ttl=TTL).stored
        assert target_statuses(silent.direct, job.id) == ["done"]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["writer", "execute"])
def test_a_commit_with_no_answer_fails_in_time(silent: Silent, path: str) -> None:
    """COMMIT is a round trip too: a silent server there must not hang the drain or a cancel.

    On PostgreSQL the per-target write commits itself (one statement in autocommit, its
    own implicit transaction): that statement is where the writer's commit is held."""
    job = submit(silent.db)
    if path == "writer":
        commit = b"WITH changed AS" if silent.db.dialect == "postgresql" else b"COMMIT"
        with silent.db.writer() as writer:
            writer.write_target(job.id, 0, status="done", result="r0", ttl=TTL)
            went_by = silent.proxy.stall_on(commit)
            fails_in_time(
                lambda: writer.write_target(job.id, 1, status="done", result="r1", ttl=TTL)
            )
    else:
        went_by = silent.proxy.stall_on(b"COMMIT")
        fails_in_time(lambda: silent.db.cancel(job.id))
    assert went_by.is_set(), "the call did not reach its COMMIT"
    silent.proxy.sever()  # the held COMMIT never arrives: the server rolls back
    silent.proxy.restore()
    found = silent.direct.get_job_with_targets(job.id)
    assert found is not None
    if path == "writer":
        assert [t.status for t in found[1]] == ["done", "pending"]
    else:
        assert found[0].status == "running"
        assert silent.db.cancel(job.id) is True  # the store works again at once


@pytest.mark.slow
def test_the_drain_retries_through_a_silent_server_and_loses_nothing(
    silent: Silent, caplog: pytest.LogCaptureFixture
) -> None:
    """Each silent attempt costs io_timeout; the drain keeps retrying within write_retry."""
    caplog.set_level(logging.WARNING)
    entered, go = threading.Event(), threading.Event()
    calls: list[str] = []

    def fetch(target: batch.Target) -> batch.Result:
        calls.append(target.url)
        if target.url.endswith("/1"):
            entered.set()
            if not go.wait(WAIT):
                raise RuntimeError("never released")
        return batch.Result(f"content of {target.url}")

    runner = batch.Runner(silent.db, fetch, batch.Config(heartbeat=dt.timedelta(hours=1)))
    try:
        job_id, _ = runner.submit(
            "alice", "user", [batch.Target(f"https://io.example/d/{i}") for i in range(3)]
        )
        assert entered.wait(WAIT)
        silent.proxy.stall()
        go.set()
        threading.Event().wait(2 * IO_TIMEOUT + 1)  # real time for the outage to last
        silent.proxy.sever()
        silent.proxy.restore()
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None
        assert (job.status, job.targets_done) == ("done", 3)
        assert sorted(calls) == [f"https://io.example/d/{i}" for i in range(3)]
    finally:
        go.set()
        silent.proxy.restore()
        runner.close(timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]
    assert any("retrying" in r.getMessage() for r in caplog.records), "no write ever timed out"
