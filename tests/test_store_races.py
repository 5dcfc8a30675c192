"""The store under real concurrency: threads on every backend, processes on the shared ones.

Threads start together behind a ``threading.Barrier``; processes (``spawn``, each opening
the store from its URL) behind a ``Manager().Barrier``. Nothing here sleeps to synchronise:
every wait is on a barrier or an event, with a timeout.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import _store_procs as procs
import attrs
import pytest
from conftest import lock_waiters
from sqlalchemy import event, text

import dcache
from dcache import DB, NewTarget, SubmitOutcome

T = TypeVar("T")

UTC = dt.timezone.utc
T0 = dt.datetime(2030, 1, 1, tzinfo=UTC)
TTL = dt.timedelta(minutes=10)
N = 16  # racing threads / processes
JOIN_TIMEOUT = 60.0
MIXED_SECONDS = 3.0


def race(n: int, fn: Callable[[int], T]) -> list[T]:
    """Run ``fn(i)`` in ``n`` threads released together; return results, re-raise failures."""
    start = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait(JOIN_TIMEOUT)
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"race-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not [t.name for t in threads if t.is_alive()], "threads still running: deadlock?"
    if errors:
        raise errors[0]
    return results


def submit(
    db: DB, *, caller: str, key: str, per_caller: int = N, total: int = N, n: int = 3
) -> SubmitOutcome:
    """One submit with the given caps at a fixed instant."""
    return db.submit(
        job_id=uuid.uuid4().hex,
        caller=caller,
        caller_class="user",
        idem_key=key,
        targets=[NewTarget(f"https://example.com/{i}") for i in range(n)],
        ttl=TTL,
        jobs_per_caller=per_caller,
        jobs_total=total,
        now=T0,
    )


def counts_match_targets(db: DB) -> list[Any]:
    """Every job whose counters disagree with its stored targets (should be none)."""
    with db.engine.begin() as conn:
        rows = conn.execute(
            text(
                "SELECT j.id, j.status, j.targets_total, j.targets_done, j.targets_failed,"
                " (SELECT count(*) FROM batch_target t WHERE t.job_id = j.id) AS n,"
                " (SELECT count(*) FROM batch_target t"
                "   WHERE t.job_id = j.id AND t.status <> 'pending') AS stored,"
                " (SELECT count(*) FROM batch_target t"
                "   WHERE t.job_id = j.id AND t.status = 'failed') AS failed"
                " FROM batch_job j"
            )
        ).all()
    return [
        r
        for r in rows
        if (r.targets_total, r.targets_done, r.targets_failed) != (r.n, r.stored, r.failed)
    ]


# -- threads, every backend ----------------------------------------------------------------


def test_identical_racing_submits_create_exactly_one_job(db: DB) -> None:
    """Rule 1 under a race: a double-clicked submit from 16 threads is one job, reused 15 times."""
    # Round 0 races to create the caller's lock row too; round 1 queues on the existing one.
    for round_ in range(2):
        key = procs.idem("alice", str(round_))
        outs = race(N, lambda _i, key=key: submit(db, caller="alice", key=key))
        kinds = Counter(o.kind for o in outs)
        assert kinds == {"created": 1, "reused": N - 1}, round_
        ids = {o.job.id for o in outs if o.job is not None}
        assert len(ids) == 1
        assert len(db.list_jobs(now=T0)) == round_ + 1
    assert not counts_match_targets(db)


def test_racing_distinct_callers_never_exceed_the_total_cap(db: DB) -> None:
    """Rule 2 under a race: 16 different callers against jobs_total=3 get exactly 3 jobs."""
    outs = race(N, lambda i: submit(db, caller=f"c{i}", key=procs.idem(str(i)), total=3))
    kinds = Counter(o.kind for o in outs)
    assert kinds == {"created": 3, "busy": N - 3}
    assert all(o.live == 3 for o in outs if o.kind == "busy")
    assert db.live_batch_jobs_total() == 3


def test_racing_submits_of_one_caller_never_exceed_its_cap(db: DB) -> None:
    """Rule 2 under a race: one caller's 16 distinct jobs against jobs_per_caller=2 make 2."""
    outs = race(N, lambda i: submit(db, caller="alice", key=procs.idem(str(i)), per_caller=2))
    kinds = Counter(o.kind for o in outs)
    assert kinds == {"created": 2, "caller_busy": N - 2}
    assert all(o.live == 2 for o in outs if o.kind == "caller_busy")
    assert db.live_batch_jobs("alice") == 2


def test_racing_writers_of_one_target_store_it_once(db: DB) -> None:
    """Compare-and-set: two writers of the same target, one wins; counters count it once."""
    targets = N // 2
    job = submit(db, caller="alice", key=procs.idem("w"), n=targets).job
    assert job is not None

    def write(i: int) -> tuple[int, bool, str]:
        idx, side = divmod(i, 2)
        status = "done" if side == 0 else "failed"
        out = db.write_target(
            job.id,
            idx,
            status=status,
            result=f"writer {side}",
            ttl=TTL,
            now=T0 + dt.timedelta(seconds=1),
        )
        return idx, out.stored, status

    outs = race(N, write)
    winners = Counter(idx for idx, stored, _ in outs if stored)
    assert winners == dict.fromkeys(range(targets), 1)
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    stored_job, rows = found
    won = {idx: status for idx, stored, status in outs if stored}
    assert [r.status for r in rows] == [won[i] for i in range(targets)]
    failed = sum(1 for s in won.values() if s == "failed")
    assert (stored_job.targets_done, stored_job.targets_failed) == (targets, failed)
    expected = "done" if failed == 0 else "failed" if failed == targets else "partial"
    assert stored_job.status == expected
    assert stored_job.finished_at is not None


def test_racing_cancels_win_exactly_once(db: DB) -> None:
    """cancel is a compare-and-set: of 16 racing cancels exactly one reports it won."""
    job = submit(db, caller="alice", key=procs.idem("c")).job
    assert job is not None
    wins = race(N, lambda _i: db.cancel(job.id, now=T0))
    assert wins.count(True) == 1


def test_cancel_racing_the_last_write_leaves_one_consistent_story(db: DB) -> None:
    """Either the cancel won (job cancelled, write says so) or the write did (job done)."""
    for round_ in range(4):
        job = submit(db, caller=f"alice{round_}", key=procs.idem("last"), n=1).job
        assert job is not None

        def act(i: int, job_id: str = job.id) -> Any:
            if i == 0:
                return db.cancel(job_id, now=T0)
            return db.write_target(job_id, 0, status="done", result="r", ttl=TTL, now=T0)

        cancelled, wrote = race(2, act)
        assert wrote.stored
        assert wrote.finished
        stored = db.get_job(job.id, now=T0)
        assert stored is not None
        if cancelled:
            assert (stored.status, wrote.status) == ("cancelled", "cancelled")
        else:
            assert (stored.status, wrote.status) == ("done", "done")
        assert stored.targets_done == 1
        assert stored.finished_at is not None


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer"])
def test_the_postgresql_write_locks_the_target_before_the_job(db: DB) -> None:
    """PostgreSQL's per-target write is one statement: the target's compare-and-set in a
    CTE, the job's update filtered on it. Its plan must run the CTE first (a one-time
    filter above the job's scan), so it locks rows in purge's order, target then job."""
    job = submit(db, caller="alice", key=procs.idem("plan"), n=1).job
    assert job is not None
    prepared = db._group._job
    values = prepared.params(
        dict(
            job_id=job.id,
            idx=0,
            status="done",
            result=None,
            result_bytes=None,
            error="",
            hint="",
            now=T0,
            failures=0,
            expires_at=T0 + TTL,
            msg_id="msg_" + job.id,
        )
    )
    with db.engine.connect() as conn:
        plan = [row[0] for row in conn.exec_driver_sql(f"EXPLAIN {prepared.sql}", values).all()]
    at = {
        k: next(i for i, line in enumerate(plan) if re.search(k, line))
        for k in (
            "CTE changed",
            "Update on batch_target",
            "Update on batch_job",
            "One-Time Filter",
            # The job's row, by its key or (a table this small) by a scan of it.
            r"Scan (using batch_job_pkey )?on batch_job",
        )
    }
    assert at["CTE changed"] < at["Update on batch_target"] < at["Update on batch_job"], plan
    assert at["Update on batch_job"] < at["One-Time Filter"], plan
    assert at["One-Time Filter"] < at[r"Scan (using batch_job_pkey )?on batch_job"], plan


def test_purge_does_not_deadlock_with_a_late_write_to_a_lapsed_job(db: DB, backend: str) -> None:
    """A cancelled job's in-flight target may be stored after its lease lapsed, while a purge
    deletes the job: both must complete (lock order job row before target rows), no deadlock.
    """
    if backend in ("memory", "sqlite"):
        pytest.skip("SQLite serialises writers (BEGIN IMMEDIATE): no row-lock order to get wrong")
    job = submit(db, caller="alice", key=procs.idem("late"), n=2).job
    assert job is not None
    assert db.cancel(job.id, now=T0)  # lease: T0 + TTL
    late = T0 + 3 * TTL  # the in-flight fetch took longer than the lease

    writer_ident: list[int] = []
    target_locked = threading.Event()
    purger_done = threading.Event()

    def hold_target_lock(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        # In the writer, right after its UPDATE of the target row: keep that row lock
        # until the purge is waiting for it (or has finished), then let the write go on.
        # (On PostgreSQL that statement updates the job row too, after the target's: see
        # test_the_postgresql_write_locks_the_target_before_the_job.)
        if threading.get_ident() not in writer_ident or target_locked.is_set():
            return
        if "UPDATE BATCH_TARGET " not in statement.upper():
            return
        target_locked.set()
        # Poll no faster than every 0.2 s: InnoDB refreshes INNODB_TRX only when it was
        # not read for 0.1 s, so a tight loop would read a stale table forever.
        deadline = time.monotonic() + 10
        while lock_waiters(db) == 0 and time.monotonic() < deadline:
            if purger_done.wait(0.2):
                break

    results: dict[str, Any] = {}

    def write() -> None:
        writer_ident.append(threading.get_ident())
        try:
            results["write"] = db.write_target(
                job.id, 0, status="done", result="late", ttl=TTL, now=late
            )
        except BaseException as exc:
            results["write"] = exc
            target_locked.set()

    def purge() -> None:
        try:
            results["purge"] = db.purge_expired(now=late)
        except BaseException as exc:
            results["purge"] = exc
        finally:
            purger_done.set()

    event.listen(db.engine, "after_cursor_execute", hold_target_lock)
    try:
        writer = threading.Thread(target=write, name="late-writer")
        writer.start()
        assert target_locked.wait(JOIN_TIMEOUT)
        purger = threading.Thread(target=purge, name="purger")
        purger.start()
        writer.join(JOIN_TIMEOUT)
        purger.join(JOIN_TIMEOUT)
        assert not writer.is_alive()
        assert not purger.is_alive()
    finally:
        event.remove(db.engine, "after_cursor_execute", hold_target_lock)
    errors = {k: v for k, v in results.items() if isinstance(v, BaseException)}
    assert not errors, f"deadlock between write_target and purge_expired: {errors!r}"
    assert not counts_match_targets(db)


# -- processes: SQLite file, PostgreSQL, MariaDB -------------------------------------------


@attrs.frozen
class Workers:
    """A pool of spawned worker processes and a manager for their start barriers."""

    pool: Any
    manager: Any

    def run(self, fn: Callable[..., T], argsets: list[tuple[Any, ...]]) -> list[T]:
        """Run ``fn(*args)`` for every args tuple in the pool, all at once; collect results."""
        pending = [self.pool.apply_async(fn, args) for args in argsets]
        return [p.get(timeout=JOIN_TIMEOUT + 30) for p in pending]


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    """16 spawned processes, started once for this module (spawning costs seconds)."""
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    pool = ctx.Pool(N, initializer=procs.warm_up)
    try:
        workers = Workers(pool, manager)
        start = manager.Barrier(N)
        assert len(set(workers.run(procs.ready, [(start,)] * N))) == N
        yield workers
    finally:
        pool.terminate()
        pool.join()
        manager.shutdown()


def test_opening_a_fresh_sqlite_file_from_four_processes_at_once_is_safe(
    workers: Workers, tmp_path: Path
) -> None:
    """Several processes of a script start together on one new file: one schema, no error."""
    # The window is narrow (the WAL switch of the very first connections): try it often.
    for attempt in range(20):
        url = f"sqlite:///{tmp_path / f'fresh-{attempt}.sqlite3'}"
        start = workers.manager.Barrier(4)
        outs = workers.run(procs.open_fresh, [(url, start, f"p{i}") for i in range(4)])
        assert len({pid for pid, _, _ in outs}) == 4
        assert [(v, kind) for _, v, kind in outs] == [(dcache.SCHEMA_VERSION, "created")] * 4
        with DB.open(url) as db, db.engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM dcache_meta")).scalar_one() == 1
            assert (
                conn.execute(
                    text("SELECT count(*) FROM batch_lock WHERE name = 'global'")
                ).scalar_one()
                == 1
            )
            assert conn.execute(text("SELECT count(*) FROM batch_job")).scalar_one() == 4
            assert conn.execute(text("SELECT count(*) FROM batch_target")).scalar_one() == 4


def test_identical_submits_from_16_processes_create_one_job(
    workers: Workers, shared_url: str
) -> None:
    """Rule 1 across processes (gunicorn -w 16): the database's locks decide, one job."""
    start = workers.manager.Barrier(N)
    key = procs.idem("alice", "processes")
    outs = workers.run(
        procs.submit_once, [(shared_url, start, "alice", key, N, N) for _ in range(N)]
    )
    assert len({pid for pid, *_ in outs}) == N
    assert Counter(kind for _, kind, _, _ in outs) == {"created": 1, "reused": N - 1}
    assert len({job_id for _, _, job_id, _ in outs}) == 1
    with DB.open(shared_url) as db:
        assert db.live_batch_jobs_total() == 1
        assert not counts_match_targets(db)


def test_distinct_submits_from_16_processes_never_exceed_either_cap(
    workers: Workers, shared_url: str
) -> None:
    """Rule 2 across processes: 4 callers x 4 jobs against 2 per caller and 5 in all make 5."""
    start = workers.manager.Barrier(N)
    argsets = [(shared_url, start, f"caller-{i % 4}", procs.idem(str(i)), 2, 5) for i in range(N)]
    outs = workers.run(procs.submit_once, argsets)
    made = Counter(argsets[i][2] for i, (_, kind, _, _) in enumerate(outs) if kind == "created")
    # Greedy and order-free: with 4 submits per caller, the total cap is always what stops it.
    assert sum(made.values()) == 5
    assert max(made.values()) <= 2
    refused = Counter(kind for _, kind, _, _ in outs if kind != "created")
    assert set(refused) <= {"busy", "caller_busy"}
    with DB.open(shared_url) as db:
        assert db.live_batch_jobs_total() == 5
        assert all(db.live_batch_jobs(f"caller-{c}") <= 2 for c in range(4))


def test_a_mixed_load_from_several_processes_stays_consistent(
    workers: Workers, shared_url: str
) -> None:
    """Submits, drains, restarts and purges at once: no deadlock, no error, counters exact."""
    roles = ["drain"] * 5 + ["reap", "purge"]
    per_caller, total = 2, 5
    start = workers.manager.Barrier(len(roles))
    argsets = [
        (shared_url, start, role, seed, MIXED_SECONDS, per_caller, total)
        for seed, role in enumerate(roles)
    ]
    outs = workers.run(procs.mixed, argsets)
    stats: Counter[str] = Counter()
    for out in outs:
        stats.update(out)
    # Every role really ran (how much it found to do depends on the machine's speed).
    for kind in ("created", "write", "reaps", "purges", "checked"):
        assert stats[kind] > 0, (kind, dict(stats))
    with DB.open(shared_url) as db:
        assert not counts_match_targets(db)
        with db.engine.begin() as conn:
            orphans = conn.execute(
                text(
                    "SELECT count(*) FROM batch_target t"
                    " WHERE NOT EXISTS (SELECT 1 FROM batch_job j WHERE j.id = t.job_id)"
                )
            ).scalar_one()
        assert orphans == 0
        assert db.live_batch_jobs_total() <= total
        assert all(
            db.live_batch_jobs(f"caller-{c}") <= per_caller for c in range(procs.MIXED_CALLERS)
        )
        for job in db.list_jobs(limit=1000):
            procs.check_consistent(db, job.id)
