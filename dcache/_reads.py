"""Reads for serving results at web scale: a streamed status read and a cancel that answers.

``DB`` inherits :class:`WebReads`. Both methods exist so an HTTP layer can answer each
request with one read of the store:

- :meth:`WebReads.get_job_with_targets_streamed` is :meth:`DB.get_job_with_targets` whose
  targets are converted one row at a time as they are iterated (SQLite steps its cursor
  row by row; psycopg and PyMySQL hold the rows as received), each result still the
  stored JSON text: a view splices those texts into its response, so a job of 32 large
  results is never decoded, nor held as Python strings all at once.
- :meth:`WebReads.cancel_job` is :meth:`DB.cancel` that also returns the job row it
  decided on (locked, so the answer is the state it changed), for any caller or one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from sqlalchemy import Connection, CursorResult, bindparam, select

from ._errors import is_store_failure, translate, wrap_errors
from ._outbox import read_notification
from ._prepared import Prepared
from ._rows import JobRow, NotificationRow, TargetRow
from ._schema import CANCELLED, LIVE, UTCDateTime, jobs
from ._shared import JOB_COLS, aware_now, findable, job_from, job_row, visible

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sqlalchemy import Engine

__all__ = ["JobStream", "WebReads"]

R = TypeVar("R")


def watched(engine: Engine) -> bool:
    """Whether anyone watches statements (``echo``, cursor events: tracing, tests)."""
    dispatch = engine.dispatch
    return bool(engine.echo or dispatch.before_cursor_execute or dispatch.after_cursor_execute)


def first(cursor: Any) -> Any:
    """The first row (a DBAPI cursor's or SQLAlchemy's result's)."""
    return cursor.fetchone()


def every(cursor: Any) -> list[Any]:
    """Every row (a DBAPI cursor's or SQLAlchemy's result's)."""
    return list(cursor.fetchall())


_HELD = "dcache.held_cursor"
# The job alone, as a cheap poll reads it (WebReads.poll_job).
_Q_POLL = select(*JOB_COLS).where(
    jobs.c.id == bindparam("job_id"), visible(bindparam("now", type_=UTCDateTime))
)


def short_cursor(pooled: Any) -> tuple[Any, bool]:
    """A DBAPI cursor for a statement whose rows are few and small, and whether it is
    held (then it is not closed after use).

    psycopg: one cursor kept with the pooled connection, in its ``info`` (which lasts as
    long as the driver connection and is cleared when that is invalidated). Making a
    psycopg cursor costs about a quarter of a keyed read on loopback; a held one keeps its
    last rows until its next statement, hence few and small rows only. Other drivers: a
    new cursor each time (on sqlite3 a held cursor could keep a statement, and with it a
    read snapshot, open).
    """
    info = pooled.info
    cursor = info.get(_HELD)
    if cursor is not None and not cursor.closed:
        return cursor, True
    dbapi: Any = pooled.driver_connection
    cursor = dbapi.cursor()
    if _driver_module(dbapi) == "psycopg":
        info[_HELD] = cursor
        return cursor, True
    return cursor, False


def _driver_module(dbapi: Any) -> str:
    return type(dbapi).__module__.partition(".")[0]


def release_cursor(pooled: Any, cursor: Any, held: bool, failed: bool) -> None:
    """After a statement on a :func:`short_cursor`: close it unless it is held; after a
    failure, a held one too (the next statement gets a new one)."""
    if held and not failed:
        return
    if held:
        pooled.info.pop(_HELD, None)
    with contextlib.suppress(Exception):
        cursor.close()


def driver_read(
    engine: Engine,
    read: Prepared,
    values: dict[str, Any],
    *,
    autocommit: bool,
    fetch: Callable[[Any], R],
    short: bool = False,
) -> R:
    """``fetch(cursor)`` after ``read`` ran on a pooled DBAPI connection, when nobody
    watches statements.

    SQLAlchemy's per-execute work (a ``Connection``, its execution context, result set-up,
    the isolation level set and reset around an autocommit read) costs several times
    SQLite's own for a short keyed read. The statement, its parameters' conversion, the
    pool (pre-ping, reset on return) and the error translation (a disconnect invalidates)
    are the same as through the engine (see ``dcache._writer``). ``autocommit`` runs it
    outside a transaction on the driver (psycopg: no BEGIN, no ROLLBACK; a local switch,
    no round trip), put back before the connection returns to the pool. ``short`` (a
    read of one small row) runs it on the connection's :func:`short_cursor`.
    """
    from ._writer import driver_error

    pooled = engine.raw_connection()
    dbapi: Any = pooled.driver_connection
    cursor = None
    held = failed = False
    try:
        if autocommit:
            dbapi.autocommit = True
        cursor, held = short_cursor(pooled) if short else (dbapi.cursor(), False)
        cursor.execute(read.sql, read.params(values))
        return fetch(cursor)
    except Exception as exc:
        failed = True
        raise driver_error(engine, pooled, exc, read.sql, cursor) from exc
    finally:
        if cursor is not None:
            release_cursor(pooled, cursor, held, failed)
        if autocommit and pooled.is_valid:
            try:
                dbapi.autocommit = False
            except Exception as exc:
                pooled.invalidate(exc)
        pooled.close()


class JobStream:
    """A job and its targets from one statement, the targets read as they are iterated.

    ``job`` is read before this is handed out; iterating yields each :class:`TargetRow`
    in index order (``result`` the stored JSON text, untouched). The read holds a pooled
    connection until the targets are exhausted or :meth:`close` is called (a ``with``
    block, or WSGI's ``close()`` on a response built from it, does that).

    Args:
        job: the job row.
        rows: its targets, read as they are iterated.
        close: ends the read and gives its connection back.
        notification: the job's end notification, when it was asked for and exists.
    """

    def __init__(
        self,
        job: JobRow,
        rows: Iterator[TargetRow],
        close: Callable[[], None],
        notification: NotificationRow | None = None,
    ) -> None:
        self.job = job
        self.notification = notification
        self._rows: Iterator[TargetRow] | None = rows
        self._close = close

    def __iter__(self) -> Iterator[TargetRow]:
        try:
            if self._rows is not None:
                yield from self._rows
        finally:
            self.close()

    def close(self) -> None:
        """End the read and give its connection back (idempotent)."""
        if self._rows is None:
            return
        self._rows = None
        self._close()

    def __enter__(self) -> JobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rows(
    result: CursorResult[Any], first: TargetRow | None, read: Prepared, t0: int
) -> Iterator[TargetRow]:
    if first is None:
        return
    yield first
    while True:
        try:
            raw = result.fetchone()
        except Exception as exc:
            if is_store_failure(exc):
                raise translate(exc) from exc
            raise
        if raw is None:
            return
        yield TargetRow(*read.convert(raw, start=t0)[t0:])


def _closer(conn: Connection, result: CursorResult[Any]) -> Callable[[], None]:
    def close() -> None:
        try:
            result.close()
            conn.close()
        except Exception as exc:
            if not is_store_failure(exc):
                raise
            # What was read stays read: a connection that died since (its ROLLBACK
            # failed) is dropped, not reported; the pool opens a fresh one when needed.
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    return close


class WebReads:
    """The web-scale reads of :class:`dcache.DB` (a mixin; see the module docstring)."""

    if TYPE_CHECKING:
        _engine: Engine
        dialect: str
        _status_read: Prepared
        _status_brief: Prepared

        def _write(self) -> AbstractContextManager[Connection]: ...

        def _one_statement(self) -> Connection: ...

        def _check_open(self) -> None: ...

        @staticmethod
        def _cancel(conn: Connection, job_id: str, ttl: dt.timedelta, now: dt.datetime) -> bool: ...

    def _prepared_read(
        self,
        read: Prepared,
        values: dict[str, Any],
        fetch: Callable[[Any], R],
        *,
        short: bool = False,
    ) -> R:
        """``fetch`` after a read of one prepared statement: on the pooled driver
        connection when nobody watches statements (:func:`driver_read`; PostgreSQL in
        autocommit), else through SQLAlchemy on :meth:`DB._one_statement`."""
        self._check_open()
        if watched(self._engine):
            with self._one_statement() as conn:
                return fetch(conn.exec_driver_sql(read.sql, read.params(values)))
        autocommit = self.dialect == "postgresql"
        return driver_read(
            self._engine, read, values, autocommit=autocommit, fetch=fetch, short=short
        )

    @wrap_errors
    def poll_job(self, job_id: str, now: dt.datetime | None = None) -> JobRow | None:
        """As :meth:`DB.get_job`, for the hottest read there is: a conditional poll.

        One prepared statement on the job's primary key (compiled once per store), on a
        pooled connection without a transaction around it: no target, no result read.
        ``None`` when the job is unknown or its lease has lapsed.
        """
        if not findable(job_id):
            return None
        now = aware_now(now)
        read = self.__dict__.get("_poll_read")
        if read is None:
            read = Prepared(_Q_POLL, self._engine.dialect, [c.type for c in JOB_COLS])
            self.__dict__["_poll_read"] = read
        row = self._prepared_read(read, {"job_id": job_id, "now": now}, first, short=True)
        return job_from(read.convert(row)) if row is not None else None

    @wrap_errors
    def get_job_with_targets_streamed(
        self,
        job_id: str,
        now: dt.datetime | None = None,
        *,
        results: bool = True,
        notification: bool = False,
    ) -> JobStream | None:
        """As :meth:`DB.get_job_with_targets`, the targets streamed one row at a time.

        One statement, so the job's counters and its targets agree. The job row (and the
        first target) is read before this returns; ``None`` (and no connection held) when
        the job is unknown or its lease has lapsed. With ``results=False`` the results are
        left out and their sizes read instead, as there. With ``notification=True`` an
        ended job's end notification is read too, on the same connection
        (``JobStream.notification``): never a second connection while the stream holds
        one (on SQLite without WAL that could wait for a commit that waits for the stream).
        """
        if not findable(job_id):
            return None
        now = aware_now(now)
        read = self._status_read if results else self._status_brief
        conn = self._one_statement()
        try:
            # No server-side cursor: on PostgreSQL a named cursor costs a round trip per
            # FETCH, which more than doubles a small job's read. The driver receives the
            # rows as the server sent them (one copy of the results, as bytes) and each
            # row is converted to Python only when it is iterated, so a reader holds the
            # payload once plus one result, never the payload twice.
            result = conn.exec_driver_sql(read.sql, read.params({"job_id": job_id, "now": now}))
            raw = result.fetchone()
            if raw is None:
                result.close()
                conn.close()
                return None
            t0 = len(jobs.c)
            row = read.convert(raw)
            job = job_from(row[:t0])
            first = TargetRow(*row[t0:]) if row[t0] is not None else None
            note = None
            if notification and job.announced:
                note = read_notification(conn, job_id)
        except BaseException:
            conn.close()
            raise
        return JobStream(job, _rows(result, first, read, t0), _closer(conn, result), note)

    @wrap_errors
    def cancel_job(
        self, job_id: str, now: dt.datetime | None = None, *, caller: str | None = None
    ) -> tuple[bool, JobRow | None]:
        """Flip a live job to ``cancelled`` and return the job as this decided it.

        One transaction: the job row is read under a lock, then a compare-and-set flips
        it if it is live. ``(True, job)`` when this cancelled it (``job`` as it is now);
        ``(False, job)`` when it was already terminal; ``(False, None)`` when it is
        unknown, its lease has lapsed, or ``caller`` is given and the job is not theirs
        (then nothing is changed).
        """
        if not findable(job_id) or (caller is not None and not findable(caller)):
            return False, None
        now = aware_now(now)
        with self._write() as conn:
            found = conn.execute(
                select(*JOB_COLS).where(jobs.c.id == job_id, visible(now)).with_for_update()
            ).first()
            if found is None:
                return False, None
            job = job_row(found)
            if caller is not None and job.caller != caller:
                return False, None
            if job.status not in LIVE:
                return False, job
            won = self._cancel(conn, job_id, job.ttl, now)
        if not won:  # cannot happen under the row lock; answer what is known
            return False, job
        cancelled = attrs.evolve(job, status=CANCELLED, updated_at=now, expires_at=now + job.ttl)
        return True, cancelled
