"""The submit transaction and the seed's lookups.

Under the caller's lock row then the global one (always in that order): the
idempotency lookup, both caps, and the insert of the job and its targets.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, bindparam, func, insert, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from ._errors import StoreError, wrap_errors
from ._prepared import Prepared
from ._reads import release_cursor, short_cursor, watched
from ._rows import JobRow, NewTarget, SubmitOutcome
from ._schema import GLOBAL_LOCK, Status, UTCDateTime, jobs, locks, targets
from ._shared import JOB_COLS, LIVE_IN, aware_now, findable, job_from, job_row, visible
from ._writer import _as_sqlalchemy

_US = dt.timedelta(microseconds=1)
R = TypeVar("R")


class _LockRowRace(Exception):
    """Another transaction created the same caller lock row first; retry the submit."""


# The submit transaction's statements, built once (construction costs more than SQLite's
# own work for these reads).
_Q_LOCK = select(locks.c.name).where(locks.c.name == bindparam("n")).with_for_update()


_Q_IDEM = (
    select(*JOB_COLS)
    .where(
        jobs.c.caller == bindparam("c"),
        jobs.c.idem_key == bindparam("k"),
        visible(bindparam("now", type_=UTCDateTime)),
    )
    .order_by(jobs.c.created_at.desc())
    .limit(1)
)


_Q_LIVE_ALL = select(func.count()).select_from(jobs).where(LIVE_IN)


_Q_LIVE_CALLER = _Q_LIVE_ALL.where(jobs.c.caller == bindparam("c"))


_JOB_INSERT = insert(jobs).values({c.name: bindparam(c.name, type_=c.type) for c in jobs.c})


_LOCK_INSERT = insert(locks).values(name=bindparam("n"))
_TARGET_INSERT = insert(targets).values(
    {c.name: bindparam(c.name, type_=c.type) for c in targets.c}
)


class _Statements:
    """The submit transaction's statements compiled for one dialect (see ``_prepared``)."""

    def __init__(self, dialect: Dialect) -> None:
        self.lock = Prepared(_Q_LOCK, dialect)
        self.lock_insert = Prepared(_LOCK_INSERT, dialect)
        self.idem = Prepared(_Q_IDEM, dialect, [c.type for c in JOB_COLS])
        self.live_caller = Prepared(_Q_LIVE_CALLER, dialect)
        self.live_all = Prepared(_Q_LIVE_ALL, dialect)
        self.job_insert = Prepared(_JOB_INSERT, dialect)
        self.target_insert = Prepared(_TARGET_INSERT, dialect)


class _Run:
    """Runs prepared statements in a transaction: on the connection's DBAPI cursor when
    nobody watches statements, else through SQLAlchemy's execution (every engine event
    sees them). Driver errors come out as SQLAlchemy raises them (see ``_writer``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.raw = not watched(conn.engine)

    def rows(self, statement: Prepared, values: dict[str, Any]) -> list[Any]:
        """The statement's rows (as the driver returned them)."""
        params = statement.params(values)
        if not self.raw:
            result = self.conn.exec_driver_sql(statement.sql, params)
            return list(result.all()) if result.returns_rows else []

        def work(cursor: Any) -> list[Any]:
            cursor.execute(statement.sql, params)
            return list(cursor.fetchall()) if cursor.description is not None else []

        return self._on_cursor(statement, work)

    def many(self, statement: Prepared, common: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """The statement once per row (the driver's executemany), with the values in
        ``common`` shared by every row (see ``Prepared.params_many``)."""
        params = statement.params_many(common, rows)
        if not self.raw:
            self.conn.exec_driver_sql(statement.sql, params)
            return
        self._on_cursor(statement, lambda cursor: cursor.executemany(statement.sql, params))

    def _on_cursor(self, statement: Prepared, work: Callable[[Any], R]) -> R:
        pooled = self.conn.connection
        cursor, held = short_cursor(pooled)  # the submit's rows are few and small
        failed = False
        try:
            return work(cursor)
        except Exception as exc:
            failed = True
            raise _as_sqlalchemy(self.conn, exc, statement.sql, cursor) from exc
        finally:
            release_cursor(pooled, cursor, held, failed)


class SubmitQueries:
    """The submit and lookup methods of :class:`DB`."""

    if TYPE_CHECKING:

        def _read(self) -> AbstractContextManager[Connection]: ...

        def _write(self) -> AbstractContextManager[Connection]: ...

        _engine: Engine

    @wrap_errors
    def submit(
        self,
        *,
        job_id: str,
        caller: str,
        caller_class: str,
        idem_key: str,
        targets: Sequence[NewTarget],
        ttl: dt.timedelta,
        jobs_per_caller: int,
        jobs_total: int,
        owner: str = "",
        now: dt.datetime | None = None,
        payload_key: str | None = None,
        notify_url: str | None = None,
    ) -> SubmitOutcome:
        """Decide a submission atomically.

        Under the caller's lock row: a job with this ``(caller, idem_key)`` whose lease
        holds is returned as ``reused`` (no caps checked). Otherwise the caller's live
        jobs are counted against ``jobs_per_caller``; then, under the global lock row,
        all live jobs against ``jobs_total``; then the job is inserted ``running`` with
        all its targets ``pending``. Racing submits from any number of threads,
        processes or hosts create at most one job per key and never exceed a cap.
        """
        if not targets:
            raise ValueError("a job needs at least one target")
        now = aware_now(now)
        caller_lock = "caller:" + caller
        for _attempt in range(8):
            try:
                with self._write() as conn:
                    return self._submit_tx(
                        conn,
                        caller_lock=caller_lock,
                        job_id=job_id,
                        caller=caller,
                        caller_class=caller_class,
                        idem_key=idem_key,
                        new_targets=targets,
                        ttl=ttl,
                        jobs_per_caller=jobs_per_caller,
                        jobs_total=jobs_total,
                        owner=owner,
                        now=now,
                        payload_key=payload_key,
                        notify_url=notify_url,
                    )
            except _LockRowRace:
                continue
        raise StoreError(f"could not create the lock row for caller {caller!r}")

    def _submit_tx(
        self,
        conn: Connection,
        *,
        caller_lock: str,
        job_id: str,
        caller: str,
        caller_class: str,
        idem_key: str,
        new_targets: Sequence[NewTarget],
        ttl: dt.timedelta,
        jobs_per_caller: int,
        jobs_total: int,
        owner: str,
        now: dt.datetime,
        payload_key: str | None,
        notify_url: str | None,
    ) -> SubmitOutcome:
        q = self._submit_statements()
        run = _Run(conn)
        if not run.rows(q.lock, {"n": caller_lock}):
            # First submit of this caller: create its lock row. Inserting locks it for the
            # rest of this transaction; a racing creator makes one of us retry.
            try:
                run.rows(q.lock_insert, {"n": caller_lock})
            except sa_exc.IntegrityError as exc:
                raise _LockRowRace from exc
        found = run.rows(q.idem, {"c": caller, "k": idem_key, "now": now})
        if found:
            return SubmitOutcome("reused", job_from(q.idem.convert(found[0])))
        live_caller = int(run.rows(q.live_caller, {"c": caller})[0][0])
        if live_caller >= jobs_per_caller:
            return SubmitOutcome("caller_busy", live=live_caller)
        run.rows(q.lock, {"n": GLOBAL_LOCK})
        live_total = int(run.rows(q.live_all, {})[0][0])
        if live_total >= jobs_total:
            return SubmitOutcome("busy", live=live_total)
        job: dict[str, Any] = {
            "id": job_id,
            "caller": caller,
            "caller_class": caller_class,
            "idem_key": idem_key,
            "status": Status.RUNNING.value,
            "error": "",
            "targets_total": len(new_targets),
            "targets_done": 0,
            "targets_failed": 0,
            "owner": owner,
            "ttl_us": ttl // _US,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + ttl,
            "finished_at": None,
            "payload_key": payload_key,
            "notify_url": notify_url,
        }
        run.rows(q.job_insert, job)
        run.many(
            q.target_insert,
            {
                "job_id": job_id,
                "status": Status.PENDING.value,
                "error": "",
                "hint": "",
                "updated_at": None,
                "result_bytes": None,
                "result": None,
            },
            [{"idx": i, "url": t.url, "options": t.options} for i, t in enumerate(new_targets)],
        )
        job["ttl"] = ttl
        del job["ttl_us"]
        return SubmitOutcome("created", JobRow(**job))

    def _submit_statements(self) -> _Statements:
        found: _Statements | None = self.__dict__.get("_submit_q")
        if found is None:
            found = self.__dict__["_submit_q"] = _Statements(self._engine.dialect)
        return found

    @staticmethod
    def _by_idem(conn: Connection, caller: str, idem_key: str, now: dt.datetime) -> JobRow | None:
        row = conn.execute(_Q_IDEM, {"c": caller, "k": idem_key, "now": now}).first()
        return job_row(row) if row is not None else None

    @staticmethod
    def _count_live(conn: Connection, caller: str | None) -> int:
        if caller is None:
            return int(conn.execute(_Q_LIVE_ALL).scalar_one())
        return int(conn.execute(_Q_LIVE_CALLER, {"c": caller}).scalar_one())

    @wrap_errors
    def batch_job_by_idem(
        self, caller: str, idem_key: str, now: dt.datetime | None = None
    ) -> JobRow | None:
        """The job for ``(caller, idem_key)`` whose lease has not lapsed, if any."""
        if not findable(caller, idem_key):
            return None
        now = aware_now(now)
        with self._read() as conn:
            return self._by_idem(conn, caller, idem_key, now)

    @wrap_errors
    def live_batch_jobs(self, caller: str) -> int:
        """How many ``queued``/``running`` jobs the caller has (by status, not lease)."""
        if not findable(caller):
            return 0
        with self._read() as conn:
            return self._count_live(conn, caller)

    @wrap_errors
    def live_batch_jobs_total(self) -> int:
        """How many ``queued``/``running`` jobs there are in all."""
        with self._read() as conn:
            return self._count_live(conn, None)
