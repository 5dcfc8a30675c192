"""The three ways a measurement talks to the database, behind one small interface.

- :class:`RawStore`, the *floor*: the statements our store issues, written by hand on one
  held DBAPI connection (``sqlite3`` in autocommit mode with an explicit ``BEGIN
  IMMEDIATE``; psycopg 3 or PyMySQL with autocommit off). Each call is its own committed
  transaction, exactly as durable as the store's; constants are inlined, values bound.
- :class:`CoreStore`: naive SQLAlchemy Core, the same statements built from the store's
  ``Table`` objects, ``engine.begin()`` per call, SQLite's ``BEGIN IMMEDIATE`` from the
  documented event recipe.
- :class:`StoreAdapter`: our store, ``dcache.DB``, called as the runner calls it.

Every implementation offers ``prepare(urls)`` (untimed: the targets in the form it takes),
``submit``, ``write_target``, ``status`` (the one-statement read of a job and its targets),
``end_job`` (untimed: make a job not live so caps never interfere) and ``close``.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from typing import Any

from sqlalchemy import and_, case, create_engine, event, func, insert, literal, or_, select, update

import dcache
from bench._env import LIVE_SQL, TTL, TTL_S, Backend, dbapi_connect, sqlite_path, utcnow
from dcache import NewTarget
from dcache._schema import GLOBAL_LOCK, LIVE, UTCDateTime, jobs, locks, targets
from dcache._shared import utf8_size

JOBS_PER_CALLER = 1  # batch.Config() defaults: the drains run one job at a time
JOBS_TOTAL = 8

TTL_US = int(TTL.total_seconds() * 1_000_000)

# Column lists come from the store's own tables, so a schema change moves the floors too.
JOB_COLS = ", ".join(c.name for c in jobs.c)
JOB_COLS_Q = ", ".join("batch_job." + c.name for c in jobs.c)
TARGET_COLS = ", ".join(c.name for c in targets.c)


def job_values(**given: Any) -> dict[str, Any]:
    """A ``batch_job`` row in column order: what the store's submit inserts.

    Raises ``KeyError`` naming a column this bench does not know yet (update it here).
    """
    row: dict[str, Any] = {
        "caller_class": "bench",
        "status": "running",
        "error": "",
        "targets_done": 0,
        "targets_failed": 0,
        "owner": "",
        "ttl_s": TTL_S,
        "ttl_us": TTL_US,
        "finished_at": None,
        **given,
    }
    return _fill_row(jobs, row)


def _fill_row(table: Any, row: dict[str, Any]) -> dict[str, Any]:
    """Values for every column: given, else a scalar default, else NULL if nullable."""
    out = {}
    for c in table.c:
        if c.name in row:
            out[c.name] = row[c.name]
        elif c.default is not None and getattr(c.default, "is_scalar", False):
            out[c.name] = c.default.arg
        elif c.nullable:
            out[c.name] = None
        else:
            raise KeyError(f"bench/_floors.py does not know column {table.name}.{c.name}")
    return out


def target_values(**given: Any) -> dict[str, Any]:
    """A ``batch_target`` row in column order, ``pending`` unless told otherwise."""
    row: dict[str, Any] = {
        "status": "pending",
        "result": None,
        "error": "",
        "hint": "",
        "updated_at": None,
        **given,
    }
    return _fill_row(targets, row)


def update_returning(kind: str) -> bool:
    """Whether the backend has ``UPDATE ... RETURNING`` (MariaDB has not)."""
    if kind == "sqlite":
        return sqlite3.sqlite_version_info >= (3, 35)
    return kind == "postgresql"


# The statements of the store's per-target write (dcache.Writer.write_target), by hand:
# the compare-and-set on the target, then the job's counters, lease and terminal status,
# read back with RETURNING where the backend has it (else a SELECT). The SET order
# matters on MySQL (assignments see earlier new values); it is the store's order.
SQL_WRITE_TARGET = (
    "UPDATE batch_target SET status = ?, result = ?, result_bytes = ?, error = ?, hint = ?, "
    "updated_at = ? "
    "WHERE job_id = ? AND idx = ? AND status = 'pending'"
)
SQL_WRITE_JOB = (
    "UPDATE batch_job SET "
    "finished_at = CASE WHEN (status = 'running' AND targets_done + 1 >= targets_total) "
    f"OR status NOT IN {LIVE_SQL} THEN coalesce(finished_at, ?) ELSE finished_at END, "
    "status = CASE WHEN status = 'running' AND targets_done + 1 >= targets_total THEN "
    "(CASE WHEN targets_failed + ? = 0 THEN 'done' WHEN targets_failed + ? >= targets_total "
    "THEN 'failed' ELSE 'partial' END) ELSE status END, "
    "targets_done = targets_done + 1, targets_failed = targets_failed + ?, "
    "updated_at = ?, expires_at = ? WHERE id = ?"
)
SQL_RETURNING = " RETURNING status, finished_at"
# PostgreSQL: the whole write in one statement, as dcache's writer runs it there (in
# autocommit: one round trip). The target's update in a data-modifying CTE, the job's
# only where it changed a row, the announcement queued where that ended the job, and one
# row back: the job's status, finish time and whether the target was written.
SQL_WRITE_BOTH = (
    f"WITH changed AS ({SQL_WRITE_TARGET} RETURNING job_id), "
    f"after AS ({SQL_WRITE_JOB} AND EXISTS (SELECT job_id FROM changed) "
    "RETURNING id, caller, notify_url, status, finished_at), "
    "notified AS (INSERT INTO batch_outbox (id, job_id, caller, url, job_status, status, "
    "attempts, next_attempt_at, claimed_by, last_answer, created_at, updated_at) "
    "SELECT ?, id, caller, notify_url, status, 'pending', 0, ?, '', '', ?, ? FROM after "
    f"WHERE notify_url IS NOT NULL AND status NOT IN {LIVE_SQL} "
    "AND NOT EXISTS (SELECT 1 FROM batch_outbox WHERE id = ?)) "
    "SELECT status, finished_at, true FROM after UNION ALL "
    "SELECT status, finished_at, false FROM batch_job "
    "WHERE id = ? AND NOT EXISTS (SELECT job_id FROM changed)"
)
SQL_JOB_STATE = "SELECT status, finished_at FROM batch_job WHERE id = ?"
# The statements of dcache.DB.submit.
SQL_LOCK = "SELECT name FROM batch_lock WHERE name = ?"
SQL_LOCK_INSERT = "INSERT INTO batch_lock (name) VALUES (?)"
SQL_BY_IDEM = (
    f"SELECT {JOB_COLS} FROM batch_job WHERE caller = ? AND idem_key = ? "
    f"AND (expires_at > ? OR status IN {LIVE_SQL}) ORDER BY created_at DESC LIMIT 1"
)
SQL_LIVE_CALLER = f"SELECT count(*) FROM batch_job WHERE status IN {LIVE_SQL} AND caller = ?"
SQL_LIVE_TOTAL = f"SELECT count(*) FROM batch_job WHERE status IN {LIVE_SQL}"
SQL_JOB_INSERT = f"INSERT INTO batch_job ({JOB_COLS}) VALUES ({', '.join(['?'] * len(jobs.c))})"
SQL_TARGET_INSERT = (
    f"INSERT INTO batch_target ({TARGET_COLS}) VALUES ({', '.join(['?'] * len(targets.c))})"
)
# dcache.DB.get_job_with_targets: the job and its targets in one statement.
SQL_STATUS = (
    f"SELECT {JOB_COLS_Q}, batch_target.idx, batch_target.url, batch_target.options, "
    "batch_target.status, batch_target.result, batch_target.error, batch_target.hint, "
    "batch_target.updated_at FROM batch_job "
    "LEFT OUTER JOIN batch_target ON batch_target.job_id = batch_job.id "
    f"WHERE batch_job.id = ? AND (batch_job.expires_at > ? OR batch_job.status IN {LIVE_SQL}) "
    "ORDER BY batch_target.idx"
)
SQL_END_JOB = "UPDATE batch_job SET status = 'failed', finished_at = ?, updated_at = ? WHERE id = ?"


def sqlite_ts(t: dt.datetime) -> str:
    """A UTC datetime as SQLAlchemy's SQLite ``DateTime`` stores it."""
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def naive_utc(t: dt.datetime) -> dt.datetime:
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None)


def connect_sqlite(path: str, synchronous: str) -> sqlite3.Connection:
    """A connection set up as the store sets up its own: WAL, busy timeout, foreign keys."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 30000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


class RawStore:
    """The floor: the store's SQL on one held raw DBAPI connection."""

    def __init__(self, be: Backend, url: str) -> None:
        self.kind = be.kind
        if be.kind == "sqlite":
            self.conn: Any = connect_sqlite(sqlite_path(url), be.synchronous)
            self.ts: Any = sqlite_ts
            fix = _same
            lock = ""
        else:
            self.conn = dbapi_connect(be.kind, url)
            self.ts = naive_utc
            fix = _pyformat
            lock = " FOR UPDATE"  # SQLite's BEGIN IMMEDIATE already holds the write lock
        self.cur = self.conn.cursor()
        self.returning = update_returning(be.kind)
        self.q_target = fix(SQL_WRITE_TARGET)
        self.q_job = fix(SQL_WRITE_JOB + (SQL_RETURNING if self.returning else ""))
        self.q_state = fix(SQL_JOB_STATE)
        self.q_both = fix(SQL_WRITE_BOTH) if be.kind == "postgresql" else None
        self.q_lock = fix(SQL_LOCK + lock)
        self.q_lock_insert = fix(SQL_LOCK_INSERT)
        self.q_idem = fix(SQL_BY_IDEM)
        self.q_live_caller = fix(SQL_LIVE_CALLER)
        self.q_live_total = fix(SQL_LIVE_TOTAL)
        self.q_job_insert = fix(SQL_JOB_INSERT)
        self.q_target_insert = fix(SQL_TARGET_INSERT)
        self.q_status = fix(SQL_STATUS)
        self.q_end = fix(SQL_END_JOB)

    # sqlite3 in autocommit mode: the transaction is ours to open (BEGIN IMMEDIATE takes
    # the write lock up front, as the store's hook does); psycopg and PyMySQL open one
    # implicitly with the first statement.
    def _begin(self) -> None:
        if self.kind == "sqlite":
            self.cur.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if self.kind == "sqlite":
            self.cur.execute("COMMIT")
        else:
            self.conn.commit()

    def _rollback(self) -> None:
        if self.kind == "sqlite":
            if self.conn.in_transaction:
                self.cur.execute("ROLLBACK")
        else:
            self.conn.rollback()

    def prepare(self, urls: list[str]) -> list[tuple[str, str]]:
        return [(u, "{}") for u in urls]

    def submit(self, job_id: str, caller: str, idem: str, items: list[tuple[str, str]]) -> str:
        now = utcnow()
        ts = self.ts(now)
        cur = self.cur
        self._begin()
        try:
            lock = "caller:" + caller
            cur.execute(self.q_lock, (lock,))
            if cur.fetchone() is None:
                cur.execute(self.q_lock_insert, (lock,))
            cur.execute(self.q_idem, (caller, idem, ts))
            if cur.fetchone() is not None:
                self._commit()
                return "reused"
            cur.execute(self.q_live_caller, (caller,))
            if cur.fetchone()[0] >= JOBS_PER_CALLER:
                self._commit()
                return "caller_busy"
            cur.execute(self.q_lock, ("global",))
            cur.fetchone()
            cur.execute(self.q_live_total)
            if cur.fetchone()[0] >= JOBS_TOTAL:
                self._commit()
                return "busy"
            job = job_values(
                id=job_id,
                caller=caller,
                idem_key=idem,
                targets_total=len(items),
                created_at=ts,
                updated_at=ts,
                expires_at=self.ts(now + TTL),
            )
            cur.execute(self.q_job_insert, tuple(job.values()))
            cur.executemany(
                self.q_target_insert,
                [
                    tuple(target_values(job_id=job_id, idx=i, url=url, options=opts).values())
                    for i, (url, opts) in enumerate(items)
                ],
            )
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return "created"

    def write_target(self, job_id: str, idx: int, status: str, result: str | None) -> bool:
        now = utcnow()
        ts = self.ts(now)
        failed = 1 if status == "failed" else 0
        size = None if result is None else utf8_size(result)
        target_values = (status, result, size, "", "", ts, job_id, idx)
        job_values = (ts, failed, failed, failed, ts, self.ts(now + TTL), job_id)
        cur = self.cur
        if self.q_both is not None:  # one statement, its own transaction
            msg = "msg_" + job_id
            self.conn.autocommit = True
            try:
                cur.execute(
                    self.q_both, (*target_values, *job_values, msg, ts, ts, ts, msg, job_id)
                )
                row = cur.fetchone()
            finally:
                self.conn.autocommit = False
            return row is not None and row[2] and row[0] in ("queued", "running")
        self._begin()
        try:
            cur.execute(self.q_target, target_values)
            row = None
            if cur.rowcount == 1:
                cur.execute(self.q_job, job_values)
                if not self.returning:
                    cur.execute(self.q_state, (job_id,))
                row = cur.fetchone()
            if row is None:  # nothing written: the job's state as it is
                cur.execute(self.q_state, (job_id,))
                row = cur.fetchone()
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return row is not None and row[0] in ("queued", "running")

    def status(self, job_id: str) -> list[Any]:
        # One statement: on SQLite in autocommit mode it is its own (consistent) read
        # transaction, and on PostgreSQL too (as dcache reads it: one round trip); MariaDB
        # needs the COMMIT to end its transaction (PyMySQL's autocommit costs a SET).
        auto = self.kind == "postgresql"
        if auto:
            self.conn.autocommit = True
        try:
            self.cur.execute(self.q_status, (job_id, self.ts(utcnow())))
            rows = self.cur.fetchall()
        finally:
            if auto:
                self.conn.autocommit = False
        if self.kind not in ("sqlite", "postgresql"):
            self.conn.commit()
        return list(rows)

    def end_job(self, job_id: str) -> None:
        ts = self.ts(utcnow())
        self._begin()
        self.cur.execute(self.q_end, (ts, ts, job_id))
        self._commit()

    def close(self) -> None:
        self.cur.close()
        self.conn.close()


def _same(q: str) -> str:
    return q


def _pyformat(q: str) -> str:
    return q.replace("?", "%s")


class CoreStore:
    """Naive SQLAlchemy Core: the store's statements, ``engine.begin()`` per call."""

    def __init__(self, be: Backend, url: str) -> None:

        if be.kind == "sqlite":
            engine = create_engine(url, connect_args={"timeout": 30})

            # The SQLite recipe of SQLAlchemy's docs: pysqlite's own BEGIN off, ours in
            # the "begin" event (IMMEDIATE for writes, so the write lock comes first).
            @event.listens_for(engine, "connect")
            def _connect(dbapi_conn: Any, _rec: Any) -> None:
                dbapi_conn.isolation_level = None
                dbapi_conn.execute("PRAGMA busy_timeout = 30000")
                dbapi_conn.execute("PRAGMA journal_mode = WAL")
                dbapi_conn.execute(f"PRAGMA synchronous = {be.synchronous}")
                dbapi_conn.execute("PRAGMA foreign_keys = ON")

            @event.listens_for(engine, "begin")
            def _begin(conn: Any) -> None:
                write = conn.get_execution_options().get("bench_write", False)
                conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        else:
            engine = create_engine(url, isolation_level="READ COMMITTED")
        self.engine = engine
        self.wengine = engine.execution_options(bench_write=True)
        self.returning = update_returning(be.kind)

    def prepare(self, urls: list[str]) -> list[tuple[str, str]]:
        return [(u, "{}") for u in urls]

    def submit(self, job_id: str, caller: str, idem: str, items: list[tuple[str, str]]) -> str:
        now = utcnow()
        with self.wengine.begin() as conn:
            lock = "caller:" + caller
            q = select(locks.c.name).where(locks.c.name == lock).with_for_update()
            if conn.execute(q).first() is None:
                conn.execute(insert(locks).values(name=lock))
            found = conn.execute(
                select(*jobs.c)
                .where(
                    jobs.c.caller == caller,
                    jobs.c.idem_key == idem,
                    or_(jobs.c.expires_at > now, jobs.c.status.in_(LIVE)),
                )
                .order_by(jobs.c.created_at.desc())
                .limit(1)
            ).first()
            if found is not None:
                return "reused"
            live = select(func.count()).select_from(jobs).where(jobs.c.status.in_(LIVE))
            if conn.execute(live.where(jobs.c.caller == caller)).scalar_one() >= JOBS_PER_CALLER:
                return "caller_busy"
            conn.execute(select(locks.c.name).where(locks.c.name == GLOBAL_LOCK).with_for_update())
            if conn.execute(live).scalar_one() >= JOBS_TOTAL:
                return "busy"
            conn.execute(
                insert(jobs),
                [
                    job_values(
                        id=job_id,
                        caller=caller,
                        idem_key=idem,
                        targets_total=len(items),
                        created_at=now,
                        updated_at=now,
                        expires_at=now + TTL,
                    )
                ],
            )
            conn.execute(
                insert(targets),
                [
                    target_values(job_id=job_id, idx=i, url=url, options=opts)
                    for i, (url, opts) in enumerate(items)
                ],
            )
        return "created"

    def write_target(self, job_id: str, idx: int, status: str, result: str | None) -> bool:

        now = utcnow()
        failed = 1 if status == "failed" else 0
        with self.wengine.begin() as conn:
            won = conn.execute(
                update(targets)
                .where(
                    targets.c.job_id == job_id,
                    targets.c.idx == idx,
                    targets.c.status == "pending",
                )
                .values(
                    status=status,
                    result=result,
                    result_bytes=None if result is None else utf8_size(result),
                    error="",
                    hint="",
                    updated_at=now,
                )
            ).rowcount
            if won != 1:
                st = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
                return st in LIVE
            last = and_(jobs.c.status == "running", jobs.c.targets_done + 1 >= jobs.c.targets_total)
            ended = or_(last, jobs.c.status.not_in(LIVE))
            new_failed = jobs.c.targets_failed + failed
            q_job = (
                update(jobs)
                .where(jobs.c.id == job_id)
                .ordered_values(
                    (
                        jobs.c.finished_at,
                        case(
                            (ended, func.coalesce(jobs.c.finished_at, literal(now, UTCDateTime))),
                            else_=jobs.c.finished_at,
                        ),
                    ),
                    (
                        jobs.c.status,
                        case(
                            (
                                last,
                                case(
                                    (new_failed == 0, literal("done")),
                                    (new_failed >= jobs.c.targets_total, literal("failed")),
                                    else_=literal("partial"),
                                ),
                            ),
                            else_=jobs.c.status,
                        ),
                    ),
                    (jobs.c.targets_done, jobs.c.targets_done + 1),
                    (jobs.c.targets_failed, new_failed),
                    (jobs.c.updated_at, now),
                    (jobs.c.expires_at, now + TTL),
                )
            )
            if self.returning:
                row = conn.execute(q_job.returning(jobs.c.status, jobs.c.finished_at)).one()
            else:
                conn.execute(q_job)
                row = conn.execute(
                    select(jobs.c.status, jobs.c.finished_at).where(jobs.c.id == job_id)
                ).one()
        return row.status in LIVE

    def status(self, job_id: str) -> list[Any]:

        now = utcnow()
        q = (
            select(
                *jobs.c,
                targets.c.idx,
                targets.c.url,
                targets.c.options,
                targets.c.status.label("t_status"),
                targets.c.result,
                targets.c.error.label("t_error"),
                targets.c.hint,
                targets.c.updated_at.label("t_updated_at"),
            )
            .select_from(jobs.outerjoin(targets, targets.c.job_id == jobs.c.id))
            .where(jobs.c.id == job_id, or_(jobs.c.expires_at > now, jobs.c.status.in_(LIVE)))
            .order_by(targets.c.idx)
        )
        with self.engine.begin() as conn:
            return list(conn.execute(q).all())

    def end_job(self, job_id: str) -> None:

        now = utcnow()
        with self.wengine.begin() as conn:
            conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id)
                .values(status="failed", finished_at=now, updated_at=now)
            )

    def close(self) -> None:
        self.engine.dispose()


class StoreAdapter:
    """Our store, ``dcache.DB``: ``write_target`` is one call of ``DB.write_target``."""

    held = False

    def __init__(self, be: Backend, url: str) -> None:
        self.db = dcache.DB.open(url, synchronous=be.synchronous)
        self._write = self.db.write_target
        self._writer: Any = None
        if self.held:
            # The runner's path: one writer (one held connection) per drain.
            self._writer = self.db.writer()
            self._write = self._writer.write_target

    def prepare(self, urls: list[str]) -> list[Any]:
        return [NewTarget(u, "{}") for u in urls]

    def submit(self, job_id: str, caller: str, idem: str, items: list[Any]) -> str:
        return self.db.submit(
            job_id=job_id,
            caller=caller,
            caller_class="bench",
            idem_key=idem,
            targets=items,
            ttl=TTL,
            jobs_per_caller=JOBS_PER_CALLER,
            jobs_total=JOBS_TOTAL,
        ).kind

    def write_target(self, job_id: str, idx: int, status: str, result: str | None) -> bool:
        return bool(self._write(job_id, idx, status=status, result=result, ttl=TTL).running)

    def status(self, job_id: str) -> Any:
        return self.db.get_job_with_targets(job_id)

    def end_job(self, job_id: str) -> None:
        self.db.fail_job(job_id, "bench")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.db.close()


class WriterAdapter(StoreAdapter):
    """Our store through ``DB.writer()``: the held-connection path the runner drains with."""

    held = True


def has_writer() -> bool:
    return hasattr(dcache.DB, "writer")


IMPLS: dict[str, type[Any]] = {
    "raw": RawStore,
    "core": CoreStore,
    "store": StoreAdapter,
    "writer": WriterAdapter,
}


def make(variant: str, be: Backend, url: str) -> Any:
    return IMPLS[variant](be, url)
