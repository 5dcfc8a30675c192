"""Bodies for the multi-process store tests; run in spawned worker processes.

Each worker opens the store from its URL (never inherits one), keeps it for the next task
on the same URL, and returns plain picklable values. Start lines are ``Barrier`` proxies
from a ``multiprocessing.Manager``, so a batch of tasks begins together.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import random
import time
import traceback
import uuid
from collections import Counter
from typing import Any

from dcache import DB, NewTarget, StoreError

START_TIMEOUT = 60.0

_stores: dict[str, DB] = {}


def _store(url: str) -> DB:
    """This worker's store for ``url``; a worker keeps at most one SQLite file open."""
    db = _stores.get(url)
    if db is None:
        if url.startswith("sqlite"):
            for old in [u for u in _stores if u.startswith("sqlite")]:
                _stores.pop(old).close()
        db = _stores[url] = DB.open(url)
    return db


def idem(*parts: str) -> str:
    """An idempotency key shaped like the runner's (sha256 hex)."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def pid_tag() -> int:
    """Which worker process ran a task (lets the parent check tasks really spread out)."""
    return os.getpid()


def warm_up() -> None:
    """Pool initializer: pay the imports (SQLAlchemy, drivers) once per worker, up front."""
    import psycopg  # noqa: F401
    import pymysql  # noqa: F401
    from sqlalchemy.dialects import mysql, postgresql, sqlite  # noqa: F401


def ready(start: Any) -> int:
    """Meet the other workers at the start line (proves all are up and warm); say who ran."""
    start.wait(START_TIMEOUT)
    return pid_tag()


def open_fresh(url: str, start: Any, caller: str) -> tuple[int, int, str]:
    """Open a store on a fresh file at the same moment as the others, and submit one job."""
    start.wait(START_TIMEOUT)
    with DB.open(url) as db:
        out = db.submit(
            job_id=uuid.uuid4().hex,
            caller=caller,
            caller_class="proc",
            idem_key=idem(caller),
            targets=[NewTarget("https://example.com/")],
            ttl=dt.timedelta(hours=1),
            jobs_per_caller=1,
            jobs_total=100,
        )
        return pid_tag(), db.schema_version(), out.kind


def submit_once(
    url: str, start: Any, caller: str, key: str, per_caller: int, total: int
) -> tuple[int, str, str | None, int]:
    """Wait for the start line, then submit one job; report (pid, kind, job id, live)."""
    db = _store(url)
    job_id = uuid.uuid4().hex
    new = [NewTarget(f"https://example.com/{i}") for i in range(3)]
    start.wait(START_TIMEOUT)
    out = db.submit(
        job_id=job_id,
        caller=caller,
        caller_class="proc",
        idem_key=key,
        targets=new,
        ttl=dt.timedelta(hours=1),
        jobs_per_caller=per_caller,
        jobs_total=total,
    )
    return pid_tag(), out.kind, out.job.id if out.job else None, out.live


# -- the mixed load ------------------------------------------------------------------------

MIXED_TTL = dt.timedelta(seconds=2)
MIXED_CALLERS = 3
MIXED_KEYS = 30  # per caller: small enough that identical submits (reuse) happen


def check_consistent(db: DB, job_id: str) -> bool:
    """Read a job in one statement and insist its counters match its targets."""
    found = db.get_job_with_targets(job_id)
    if found is None:
        return False  # purged meanwhile
    job, targets = found
    stored = [t for t in targets if t.status != "pending"]
    failed = [t for t in targets if t.status == "failed"]
    assert len(targets) == job.targets_total, (job, targets)
    assert job.targets_done == len(stored), (job, targets)
    assert job.targets_failed == len(failed), (job, targets)
    if job.status in ("done", "partial") or (job.status == "failed" and not job.error):
        # Set by the last target write: every target is stored and the drain has stopped.
        assert len(stored) == job.targets_total, (job, targets)
        assert job.finished_at is not None, job
    return True


def _drain(db: DB, rnd: random.Random, stats: Counter[str], per_caller: int, total: int) -> None:
    """Submit a job and, if created, write its targets in order as a runner's drain would."""
    caller = f"caller-{rnd.randrange(MIXED_CALLERS)}"
    key = idem(caller, str(rnd.randrange(MIXED_KEYS)))
    n = rnd.randint(1, 4)
    since = time.time()  # <= the submit's own now, hence the job's first lease start
    out = db.submit(
        job_id=uuid.uuid4().hex,
        caller=caller,
        caller_class="proc",
        idem_key=key,
        targets=[NewTarget(f"https://example.com/{i}") for i in range(n)],
        ttl=MIXED_TTL,
        jobs_per_caller=per_caller,
        jobs_total=total,
    )
    stats[out.kind] += 1
    if out.kind != "created":
        return
    assert out.job is not None
    for idx in range(n):
        status = rnd.choice(("done", "done", "failed"))
        before = time.time()  # <= the write's own now, hence its lease start
        try:
            w = db.write_target(
                out.job.id,
                idx,
                status=status,
                result=f"result {idx} é漢😀" if status == "done" else None,
                error="fetch failed" if status == "failed" else "",
                ttl=MIXED_TTL,
            )
        except StoreError as exc:
            # Past the lease the job may be purged under this write: say if that was so.
            waited = time.time() - since
            raise AssertionError(
                f"write of {out.job.id}[{idx}] failed {waited:.2f}s after the job's "
                f"previous lease start (ttl {MIXED_TTL.total_seconds()}s): {exc!r}"
            ) from exc
        if not w.stored:
            # Only this drain writes this job's targets, so the job is gone: legitimate only
            # if it stopped being live and then its lease ran out, which every write and
            # status change pushes to at least the previous write's start + ttl.
            assert w.status == "", (out.job.id, idx, w)
            waited = time.time() - since
            assert waited >= MIXED_TTL.total_seconds(), (out.job.id, idx, f"purged {waited}s")
            stats["vanished"] += 1
            return
        since = before
        stats["write"] += 1
        if not w.running:
            assert w.finished, w
            stats["finished"] += 1
            return
        if rnd.random() < 0.1 and db.cancel(out.job.id):
            stats["self_cancel"] += 1


def _inspect(db: DB, rnd: random.Random, stats: Counter[str], per_caller: int, total: int) -> None:
    """Check the caps and a random visible job's counters while everything else runs."""
    live_total = db.live_batch_jobs_total()
    assert live_total <= total, live_total
    for c in range(MIXED_CALLERS):
        live = db.live_batch_jobs(f"caller-{c}")
        assert live <= per_caller, (c, live)
    jobs = db.list_jobs(limit=50)
    if jobs and check_consistent(db, rnd.choice(jobs).id):
        stats["checked"] += 1


def mixed(
    url: str, start: Any, role: str, seed: int, seconds: float, per_caller: int, total: int
) -> dict[str, int]:
    """Run one role of the mixed load until ``seconds`` have passed; return what it did."""
    db = _store(url)
    rnd = random.Random(seed)
    stats: Counter[str] = Counter()
    start.wait(START_TIMEOUT)
    end = time.monotonic() + seconds
    try:
        _mixed_loop(db, rnd, stats, role, end, per_caller, total)
    except Exception as exc:
        # Say which role failed and after what; the pool would only show the last frame.
        raise RuntimeError(
            f"{role} worker (seed {seed}) failed after {dict(stats)}: {exc!r}\n"
            + traceback.format_exc()
        ) from None
    return dict(stats)


def _mixed_loop(
    db: DB,
    rnd: random.Random,
    stats: Counter[str],
    role: str,
    end: float,
    per_caller: int,
    total: int,
) -> None:
    while time.monotonic() < end:
        if role == "drain":
            _drain(db, rnd, stats, per_caller, total)
        elif role == "reap":
            stats["iterations"] += 1
            if stats["iterations"] % 5 == 1:
                stats["marked"] += db.mark_in_flight_failed("restart")
                stats["reaps"] += 1
            else:
                _inspect(db, rnd, stats, per_caller, total)
        elif role == "purge":
            stats["purged"] += db.purge_expired(limit=3, max_batches=2)
            stats["purges"] += 1
            live = db.list_jobs(live_only=True, limit=10)
            if live and rnd.random() < 0.3 and db.cancel(rnd.choice(live).id):
                stats["cancelled"] += 1
            _inspect(db, rnd, stats, per_caller, total)
        else:
            raise ValueError(role)


def close_all() -> int:
    """Close this worker's stores (end of the module)."""
    n = len(_stores)
    for db in _stores.values():
        db.close()
    _stores.clear()
    return n
