"""The scenarios of the cut-point test (``test_cut_points.py``), shared with its child process.

Two tables:

- :data:`STORE` maps ``"DB.<method>"`` / ``"Writer.<method>"`` to a :class:`StoreScenario`:
  a function ``fn(db, ctx)`` that calls that one store method on the store under test
  (opened through the cut machinery) against the prepared store of :func:`prepare`, with
  the fixed instant ``ctx.now``, and returns what the method returned.
- :data:`RUNNER` maps ``"Runner.<method>"`` to a function ``fn(env)`` that drives a
  :class:`batch.Runner` on the store under test (``env.runner``), arms the cut around the
  call with ``env.arm()``/``env.disarm()``, and returns what happened as a plain dict.

Adding a store method's scenario is two lines: a function and its entry in ``STORE``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import attrs
from sqlalchemy import delete, insert, select, update

import batch
import dcache
from dcache._outbox import message_id
from dcache._schema import jobs, locks, outbox, owners, targets, tombstones

OWNER_LIVE = "owner-live"  # beats "now" and declares itself alive for an hour
OWNER_DEAD = "owner-dead"  # stopped beating two hours ago
TTL = dt.timedelta(hours=24)
J_RUN = "job-running"  # running, owner live: target 0 stored, 1 and 2 pending
J_ORPHAN = "job-orphan"  # running, owner dead: target 0 failed, 1 pending
J_LAPSED = "job-lapsed"  # done, its lease lapsed an hour ago: purge deletes it
J_CANCEL = "job-cancel"  # cancelled, its drain has not recorded its end yet
J_PARTIAL = "job-partial"  # partial, finished, one result of 200 kB
BIG = "\N{SNOWMAN}" * 70_000  # 210 kB of UTF-8: replies and rows that span many reads
BACKGROUND = ("batch-heartbeat", "batch-maintain", "batch-webhooks")  # threads on their own timer


def result_for(tag: str) -> str:
    """The exact result text stored for ``tag`` in the prepared store."""
    return json.dumps({"content": f"r\N{LATIN SMALL LETTER E WITH ACUTE}sultat {tag}"})


def prepare(db: dcache.DB, now: dt.datetime) -> None:
    """Build the prepared store with the public API (every job and owner kind once)."""
    db.heartbeat(OWNER_LIVE, now=now, stale_after=dt.timedelta(hours=1))
    # A short declared window: a recovery runner watching in real time reaps it in ~1 s.
    db.heartbeat(OWNER_DEAD, now=now - dt.timedelta(hours=2), stale_after=dt.timedelta(seconds=0.1))

    def submit(job_id: str, n: int, owner: str, at: dt.datetime, ttl: dt.timedelta = TTL) -> None:
        out = db.submit(
            job_id=job_id,
            caller="caller-" + job_id,
            caller_class="cls",
            idem_key="key-" + job_id,
            targets=[dcache.NewTarget(f"https://cut.example/{job_id}/{i}") for i in range(n)],
            ttl=ttl,
            jobs_per_caller=1,
            jobs_total=100,
            owner=owner,
            now=at,
            notify_url=f"https://hooks.example/{job_id}",  # every job end queues its row
        )
        assert out.kind == "created", out

    def write(job_id: str, idx: int, at: dt.datetime, ttl: dt.timedelta = TTL, **kw: Any) -> None:
        db.write_target(job_id, idx, ttl=ttl, now=at, **kw)

    sec = dt.timedelta(seconds=1)
    submit(J_RUN, 3, OWNER_LIVE, now - 10 * sec)
    write(J_RUN, 0, now - 9 * sec, status="done", result=result_for("run-0"))
    submit(J_ORPHAN, 2, OWNER_DEAD, now - dt.timedelta(hours=3))
    write(J_ORPHAN, 0, now - dt.timedelta(hours=3), status="failed", error="boom", hint="h")
    lapsed = now - dt.timedelta(hours=5)
    submit(J_LAPSED, 2, OWNER_LIVE, lapsed, ttl=dt.timedelta(hours=1))
    for i in range(2):
        write(
            J_LAPSED,
            i,
            lapsed,
            ttl=dt.timedelta(hours=1),
            status="done",
            result=result_for(f"l{i}"),
        )
    submit(J_CANCEL, 2, OWNER_LIVE, now - 20 * sec)
    write(J_CANCEL, 0, now - 19 * sec, status="done", result=result_for("c-0"))
    assert db.cancel(J_CANCEL, now=now - 18 * sec)
    submit(J_PARTIAL, 2, OWNER_LIVE, now - 30 * sec)
    write(J_PARTIAL, 0, now - 29 * sec, status="done", result=json.dumps({"content": BIG}))
    write(J_PARTIAL, 1, now - 28 * sec, status="failed", error="nope")
    # The ended jobs' notifications: claimed by the live owner for a minute (a claim
    # scenario two minutes on finds them lapsed), one of them delivered already.
    claimed = db.claim_notifications(OWNER_LIVE, now=now, lease=60 * sec)
    assert {r.job_id for r in claimed} == {J_LAPSED, J_CANCEL, J_PARTIAL}, claimed
    assert db.record_attempt(
        message_id(J_CANCEL),
        OWNER_LIVE,
        outcome="delivered",
        answer="HTTP 200",
        now=now - 100 * sec,
    )


# -- the state of the whole store, exactly ------------------------------------------------

TABLES = (
    locks,
    owners,
    jobs,
    targets,
    tombstones,
    outbox,
)  # in insert order (targets refer to jobs)
Snapshot = tuple[tuple[tuple[Any, ...], ...], ...]


def snapshot(db: dcache.DB) -> Snapshot:
    """Every row of every table, sorted: two snapshots are equal iff the stores are."""
    with db.engine.connect() as conn:
        return tuple(tuple(sorted(tuple(r) for r in conn.execute(select(t)).all())) for t in TABLES)


def restore(db: dcache.DB, snap: Snapshot) -> None:
    """Make the store hold exactly ``snap`` again (one transaction).

    Only the rows that differ are written, by primary key: the extra ones deleted
    (children first), the changed ones updated, the missing ones inserted (parents
    first). A trial changes a few rows; rewriting all of them (a 210 kB result among
    them) was most of a trial's time on MariaDB.
    """
    now = snapshot(db)
    if now == snap:
        return
    plans = []
    for table, rows_now, rows_then in zip(TABLES, now, snap):
        names = table.c.keys()
        pk = [names.index(c.name) for c in table.primary_key.columns]
        have = {tuple(r[i] for i in pk): r for r in rows_now}
        want = {tuple(r[i] for i in pk): r for r in rows_then}
        plans.append((table, names, pk, have, want))
    with db.engine.begin() as conn:

        def where(table: Any, names: list[str], pk: list[int], key: tuple[Any, ...]) -> Any:
            return [table.c[names[i]] == v for i, v in zip(pk, key)]

        for table, names, pk, have, want in reversed(plans):
            for key in have.keys() - want.keys():
                conn.execute(delete(table).where(*where(table, names, pk, key)))
        for table, names, pk, have, want in plans:
            for key in have.keys() & want.keys():
                if have[key] != want[key]:
                    row = dict(zip(names, want[key]))
                    conn.execute(update(table).where(*where(table, names, pk, key)).values(row))
            missing = [dict(zip(names, want[k])) for k in want.keys() - have.keys()]
            if missing:
                conn.execute(insert(table), missing)


# -- store scenarios ----------------------------------------------------------------------


@attrs.frozen
class Ctx:
    """What a store scenario may use besides the store: the instant, a way to open another."""

    now: dt.datetime
    open_db: Callable[[], dcache.DB]


@attrs.frozen
class StoreScenario:
    """One store method's call; ``atomic``: one transaction, so all or nothing."""

    fn: Callable[[dcache.DB, Ctx], Any]
    atomic: bool = True


def _open(db: dcache.DB, ctx: Ctx) -> Any:
    other = ctx.open_db()  # creating a schema that exists: inspect, check, init meta
    try:
        return other.schema_version()
    finally:
        other.close()


def _submit(db: dcache.DB, ctx: Ctx) -> Any:
    return db.submit(
        job_id="job-new",
        caller="caller-new",
        caller_class="cls",
        idem_key="key-new",
        targets=[dcache.NewTarget("https://cut.example/new/0", '{"mode": "x"}')],
        ttl=TTL,
        jobs_per_caller=1,
        jobs_total=100,
        owner=OWNER_LIVE,
        now=ctx.now,
    )


def _write(db: dcache.DB, ctx: Ctx) -> Any:
    return db.write_target(
        J_RUN, 1, status="done", result=result_for("run-1"), ttl=TTL, now=ctx.now
    )


def _writer(db: dcache.DB, ctx: Ctx) -> Any:
    # Two writes on one held connection: a cut of the first leaves the second to reconnect.
    with db.writer() as w:
        first = w.write_target(
            J_RUN, 1, status="done", result=result_for("run-1"), ttl=TTL, now=ctx.now
        )
        last = w.write_target(J_RUN, 2, status="failed", error="e", ttl=TTL, now=ctx.now)
    return first, last


def _reap_owners(db: dcache.DB, ctx: Ctx) -> Any:
    seen = {o.owner: o.token for o in db.owners() if o.owner == OWNER_DEAD}
    return db.reap_owners(seen, "restart", now=ctx.now)


def _streamed(db: dcache.DB, ctx: Ctx) -> Any:
    stream = db.get_job_with_targets_streamed(J_PARTIAL, now=ctx.now, notification=True)
    if stream is None:
        return None
    with stream:
        return stream.job, stream.notification, list(stream)


STORE: dict[str, StoreScenario] = {
    "DB.open": StoreScenario(_open, atomic=False),
    "DB.schema_version": StoreScenario(lambda db, c: db.schema_version()),
    "DB.submit": StoreScenario(_submit),
    "DB.batch_job_by_idem": StoreScenario(
        lambda db, c: db.batch_job_by_idem("caller-" + J_RUN, "key-" + J_RUN, now=c.now)
    ),
    "DB.live_batch_jobs": StoreScenario(lambda db, c: db.live_batch_jobs("caller-" + J_RUN)),
    "DB.live_batch_jobs_total": StoreScenario(lambda db, c: db.live_batch_jobs_total()),
    "DB.get_job": StoreScenario(lambda db, c: db.get_job(J_RUN, now=c.now)),
    "DB.get_job_with_targets": StoreScenario(
        lambda db, c: db.get_job_with_targets(J_PARTIAL, now=c.now)
    ),
    "DB.list_jobs": StoreScenario(lambda db, c: db.list_jobs(now=c.now)),
    "DB.write_target": StoreScenario(_write),
    "Writer.write_target": StoreScenario(_writer, atomic=False),
    "DB.cancel": StoreScenario(lambda db, c: db.cancel(J_RUN, now=c.now)),
    "DB.cancel_job": StoreScenario(
        lambda db, c: db.cancel_job(J_RUN, now=c.now, caller="caller-" + J_RUN)
    ),
    "DB.get_job_with_targets_streamed": StoreScenario(_streamed),
    "DB.poll_job": StoreScenario(lambda db, c: db.poll_job(J_RUN, now=c.now)),
    "DB.fail_job": StoreScenario(lambda db, c: db.fail_job(J_RUN, "stop", now=c.now)),
    "DB.mark_finished": StoreScenario(lambda db, c: db.mark_finished(J_CANCEL, now=c.now)),
    "DB.mark_in_flight_failed": StoreScenario(
        lambda db, c: db.mark_in_flight_failed("restart", now=c.now)
    ),
    "DB.heartbeat": StoreScenario(
        lambda db, c: db.heartbeat(OWNER_LIVE, now=c.now, stale_after=dt.timedelta(hours=1))
    ),
    "DB.remove_owner": StoreScenario(lambda db, c: db.remove_owner(OWNER_DEAD)),
    "DB.reap_orphans": StoreScenario(
        lambda db, c: db.reap_orphans("restart", dt.timedelta(seconds=30), now=c.now)
    ),
    "DB.get_target": StoreScenario(lambda db, c: db.get_target(J_PARTIAL, 0, now=c.now)),
    "DB.get_result_slice": StoreScenario(
        lambda db, c: db.get_result_slice(J_PARTIAL, 0, 1000, 5000)  # inside the 200 kB result
    ),
    "DB.read_result": StoreScenario(
        lambda db, c: db.read_result(J_PARTIAL, 0, 1000, 5000)  # in place on SQLite (a blob)
    ),
    "DB.lookup": StoreScenario(lambda db, c: db.lookup(J_PARTIAL, now=c.now)),
    # The outbox: claims of lapsed claims, an attempt of a claimed row, a re-send.
    "DB.claim_notifications": StoreScenario(
        lambda db, c: db.claim_notifications("owner-other", now=c.now + dt.timedelta(minutes=2))
    ),
    "DB.record_attempt": StoreScenario(
        lambda db, c: db.record_attempt(
            message_id(J_PARTIAL),
            OWNER_LIVE,
            outcome="pending",
            answer="HTTP 500",
            next_attempt_at=c.now + dt.timedelta(seconds=5),
            now=c.now,
        )
    ),
    # Given back: the live owner's claim on a row it will not attempt (a sender stopping).
    "DB.release_notifications": StoreScenario(
        lambda db, c: db.release_notifications(OWNER_LIVE, [message_id(J_PARTIAL)])
    ),
    "DB.notification": StoreScenario(lambda db, c: db.notification(J_PARTIAL)),
    "DB.redeliver": StoreScenario(lambda db, c: db.redeliver(J_CANCEL, now=c.now)),
    "DB.owners": StoreScenario(lambda db, c: db.owners()),
    # The dead owner, judged by its token as seen now: its live jobs are failed.
    "DB.reap_owners": StoreScenario(_reap_owners),
    "DB.live_by_caller": StoreScenario(lambda db, c: db.live_by_caller()),
    "DB.status_counts": StoreScenario(lambda db, c: db.status_counts(now=c.now)),
    "DB.jobs_page": StoreScenario(lambda db, c: db.jobs_page(now=c.now)),
    "DB.job_summary": StoreScenario(lambda db, c: db.job_summary(J_PARTIAL, now=c.now)),
    "DB.target_result": StoreScenario(lambda db, c: db.target_result(J_PARTIAL, 0, now=c.now)),
    # Several short transactions (batches of two jobs): all or nothing per batch.
    "DB.purge_expired": StoreScenario(
        lambda db, c: db.purge_expired(now=c.now, limit=1), atomic=False
    ),
}


# -- runner scenarios ---------------------------------------------------------------------


def content_for(url: str) -> str:
    """The exact content ``fetch`` returns for ``url`` (non-ASCII on purpose)."""
    return f"contenu de {url} \N{CHECK MARK}"


class Fetch:
    """A fetch that records every call as ``(job id, url)``, in memory and in a log file.

    The job id comes from the drain thread's name (``batch-job-<id>``). The log is written
    with one unbuffered ``write`` per call before the result is returned, so a parent
    counting the calls of a killed child misses none. ``hold`` (a URL) blocks that fetch
    until :attr:`go` is set, and sets :attr:`entered` first.
    """

    def __init__(self, log: str | None = None, hold: str | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.hold = hold
        self.entered = threading.Event()
        self.go = threading.Event()
        self._fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if log else None
        self._lock = threading.Lock()

    def __call__(self, target: batch.Target) -> batch.Result:
        name = threading.current_thread().name
        job = name.removeprefix("batch-job-")
        with self._lock:
            self.calls.append((job, target.url))
            if self._fd is not None:
                os.write(self._fd, f"{job} {target.url}\n".encode())
        if target.url == self.hold:
            self.entered.set()
            if not self.go.wait(30):
                raise RuntimeError("the held fetch was never released")
        return batch.Result(content_for(target.url), {"url": target.url})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_fetch_log(path: str) -> list[tuple[str, str]]:
    """The ``(job id, url)`` calls a :class:`Fetch` logged to ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            return [tuple(line.split(" ", 1)) for line in f.read().splitlines()]  # type: ignore[misc]
    except FileNotFoundError:
        return []


@attrs.define
class Env:
    """What a runner scenario drives: a runner on the store under test, and the cut."""

    runner: batch.Runner
    fetch: Fetch
    tag: str  # unique per trial: it goes into the callers and URLs
    arm: Callable[[], None]
    disarm: Callable[[], None]
    wait: float  # how long a job may take to finish


def _targets(env: Env, n: int) -> list[batch.Target]:
    return [batch.Target(f"https://cut.example/{env.tag}/{i}") for i in range(n)]


def _err(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".splitlines()[0][:300]


def _runner_submit(env: Env) -> dict[str, Any]:
    """Submit a job of two targets and wait for it; after an error, submit it again."""
    caller, items = "caller-" + env.tag, _targets(env, 2)
    out: dict[str, Any] = {"caller": caller, "errors": []}
    env.arm()
    try:
        try:
            job_id, _reused = env.runner.submit(caller, "cls", items)
            out["job"] = job_id
        except Exception as exc:
            out["submit_error"] = exc
            return out
        try:
            out["waited"] = env.runner.wait(job_id, timeout=env.wait)
        except Exception as exc:
            out["wait_error"] = exc
        return out
    finally:
        env.disarm()
        if "submit_error" in out:
            # The same submission again: it must get a job that finishes.
            try:
                job_id, reused = env.runner.submit(caller, "cls", items)
                out["retry_job"], out["retry_reused"] = job_id, reused
            except Exception as exc:
                out["retry_error"] = exc
            else:
                try:
                    out["retry_waited"] = env.runner.wait(job_id, timeout=env.wait)
                except Exception as exc:
                    out["retry_wait_error"] = exc


def _runner_cancel(env: Env) -> dict[str, Any]:
    """Cancel a job while its first fetch is in flight, then let the drain store it."""
    caller, items = "caller-" + env.tag, _targets(env, 2)
    env.fetch.hold = items[0].url
    job_id, _ = env.runner.submit(caller, "cls", items)
    out: dict[str, Any] = {"caller": caller, "job": job_id}
    if not env.fetch.entered.wait(env.wait):
        out["setup_error"] = "the first fetch never started"
        env.fetch.go.set()
        return out
    env.arm()
    try:
        try:
            out["cancelled"] = env.runner.cancel(job_id)
        except Exception as exc:
            out["cancel_error"] = exc
        env.fetch.go.set()
        try:
            out["waited"] = env.runner.wait(job_id, timeout=env.wait)
        except Exception as exc:
            out["wait_error"] = exc
    finally:
        env.fetch.go.set()
        env.disarm()
    return out


RUNNER: dict[str, Callable[[Env], dict[str, Any]]] = {
    "Runner.submit": _runner_submit,  # DB.submit, then the drain's per-target writes
    "Runner.cancel": _runner_cancel,  # DB.cancel, then the cancelled drain's last write
}


class SplitDB(dcache.DB):
    """The store under test, whose background threads talk to a second, uncut store.

    A runner's heartbeat and purge run on their own timers: their statements would land
    at random places in the numbering and make a cut point mean a different statement
    each run. Calls made on those threads go to ``side`` (the same database, opened
    directly) instead; their own cut points are covered by the ``DB.heartbeat``,
    ``DB.reap_orphans`` and ``DB.purge_expired`` scenarios.
    """

    _side: dcache.DB | None = None

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            side = object.__getattribute__(self, "_side")
            if side is not None and threading.current_thread().name.startswith(BACKGROUND):
                return getattr(side, name)
        return object.__getattribute__(self, name)
