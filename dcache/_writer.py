"""The per-target write: group commit on one connection per store.

A drain hands its target's outcome to :meth:`GroupWriter.write` and waits for the answer
before it starts the next target (the seed's rule: target ``i+1`` starts only after ``i``
is stored). A waiting thread that finds no commit running becomes the *leader*: it
takes every outcome queued at that moment, its own included, and commits them in ONE
transaction on the store's one write connection, each still a compare-and-set with its
lease bump, counters and terminal status; then it hands each outcome its own answer,
wakes exactly the drains it answered, and hands the lead to the first outcome queued
meanwhile (its drain commits the next batch). A lone drain is its own leader (no thread
hand-off); many drains share a commit (one WAL flush for many targets), and no drain
holds a connection while it fetches, so connections per process do not grow with live
jobs.
On SQLite every other write transaction of the store (the submit, cancels, job ends,
reaping, purge, the outbox's claims) takes its turn on the same connection between
batches (:meth:`GroupWriter.transaction`): SQLite lets one connection write at a time
anyway. The heartbeat's statements keep a connection of their own (``DB._control``), so
that a beat never waits behind drains; schema creation, at open, uses the pool's.

On PostgreSQL an outcome is one statement, and a batch one round trip: the statements
are pipelined in autocommit, one implicit transaction up to the Sync that ends them
(see :meth:`GroupWriter._in_pipeline`). SQLite and MariaDB run each batch in a
transaction of their own, statement by statement.

An outcome the database refuses (a permanent error on its own statements: a result too
large for the server, say) is answered with that error and the others are committed
without it. A transient failure (a lost connection, a deadlock, a COMMIT whose reply
never came) is answered to every outcome of the batch as ``StoreUnavailableError``: each
drain retries its own write, and the target's compare-and-set makes a retry of a write
that did commit a no-op.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import functools
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Boolean,
    Connection,
    and_,
    bindparam,
    case,
    false,
    func,
    literal,
    not_,
    or_,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy import exc as sa_exc

from . import _sql
from ._engine import lost_prepared
from ._errors import StoreError, is_row_wait, translate
from ._outbox import message_id, notify_statement
from ._prepared import Binder, Prepared
from ._reads import release_cursor, short_cursor, watched
from ._rows import JobRow, WriteOutcome
from ._schema import FAILED, LIVE, Status, UTCDateTime, jobs, targets
from ._shared import JOB_COLS, job_from, utf8_size

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.pool import PoolProxiedConnection

    from ._db import DB

__all__ = ["MAX_BATCH", "GroupWriter"]

MAX_BATCH = 256  # outcomes committed in one transaction at most
# In a forked child: the parent's connections the writers held, never used nor collected.
_INHERITED: list[Any] = []
# A leader waits for the outcomes of the other open drains (see GroupWriter._gather): at
# most GATHER_SLICE seconds for the next one to arrive, GATHER_MAX seconds in all.
GATHER_SLICE = 0.001
GATHER_MAX = 0.002


@functools.cache
def _shaped(together: bool, returning: bool, whole: bool = False) -> tuple[Any, Any, Any, Any]:
    """The write's statements as a dialect runs them: the target's compare-and-set, the
    job's update (with the target's in one statement where ``together``, with RETURNING
    where ``returning``), the job's state and the announcement. Built once for each
    shape, so that their compiled forms are shared by every store (see ``_prepared``).

    With ``whole`` the job's state comes back with the job's every column after them (a
    write that ends a job can answer the job as it ended, see ``GroupWriter.write``).
    """
    target, job = _statements()
    state = (jobs.c.status.label("w_status"), jobs.c.finished_at.label("w_finished_at"))
    rest = tuple(JOB_COLS) if whole else ()
    read = select(*state, *rest).where(jobs.c.id == bindparam("job_id"))
    if together:
        job = _together(target, job, whole)
    elif returning:
        job = job.returning(*state, *rest)
    return target, job, read, notify_statement()


def _statements() -> tuple[Any, Any]:
    """The write's two updates, from the Core tables (compiled per dialect later)."""
    now = bindparam("now", type_=UTCDateTime)
    failed = bindparam("failures", type_=jobs.c.targets_failed.type)  # 1 or 0
    target = (
        update(targets)
        .where(
            targets.c.job_id == bindparam("job_id"),
            targets.c.idx == bindparam("idx"),
            targets.c.status == literal(Status.PENDING.value),
        )
        .values(
            status=bindparam("status"),
            result=bindparam("result"),
            result_bytes=bindparam("result_bytes"),
            error=bindparam("error"),
            hint=bindparam("hint"),
            updated_at=now,
        )
    )
    live = jobs.c.status.in_([literal(s) for s in LIVE])
    last = and_(
        jobs.c.status == literal(Status.RUNNING.value),
        jobs.c.targets_done + 1 >= jobs.c.targets_total,
    )
    ends = or_(last, not_(live))  # this write ends the job, or the job ended before it
    # Every right-hand side reads only old values: MySQL evaluates SET assignments left to
    # right with the new values, PostgreSQL and SQLite with the old ones; ordering them so
    # that none reads a column set before it makes the three agree.
    job = (
        update(jobs)
        .where(jobs.c.id == bindparam("job_id"))
        .ordered_values(
            (
                jobs.c.finished_at,
                case((ends, func.coalesce(jobs.c.finished_at, now)), else_=jobs.c.finished_at),
            ),
            (
                jobs.c.expires_at,
                # The lease of a live job is its last write + ttl (see _rows.effective_lease);
                # it is stored only when the job stops being live, so the per-target write
                # leaves the expiry index alone.
                case((ends, bindparam("expires_at", type_=UTCDateTime)), else_=jobs.c.expires_at),
            ),
            (
                jobs.c.status,
                case(
                    (
                        last,
                        case(
                            (jobs.c.targets_failed + failed == 0, literal(Status.DONE.value)),
                            (
                                jobs.c.targets_failed + failed >= jobs.c.targets_total,
                                literal(Status.FAILED.value),
                            ),
                            else_=literal(Status.PARTIAL.value),
                        ),
                    ),
                    else_=jobs.c.status,
                ),
            ),
            (jobs.c.targets_done, jobs.c.targets_done + 1),
            (jobs.c.targets_failed, jobs.c.targets_failed + failed),
            (jobs.c.updated_at, now),
        )
    )
    return target, job


class _Outcome:
    """One target's outcome waiting for its commit, and then its answer."""

    __slots__ = ("answer", "error", "lead", "values", "wake")

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.answer: WriteOutcome | None = None
        self.error: BaseException | None = None
        self.lead = False  # the lead was handed to it (set holding the mutex)
        # Held until its thread is to wake: answered, or handed the lead.
        self.wake = threading.Lock()
        self.wake.acquire()

    @property
    def answered(self) -> bool:
        return self.answer is not None or self.error is not None


class GroupWriter:
    """Group commit of per-target writes for one store (see the module docstring)."""

    def __init__(self, db: DB) -> None:
        self._db = db
        dialect = db.engine.dialect
        self._returning = bool(dialect.update_returning)
        # PostgreSQL runs an outcome as ONE statement (see _together); SQLite and MariaDB
        # as two or three (neither modifies data in a CTE).
        together = dialect.name == "postgresql"
        target, job, read, notify = _shaped(together, self._returning)
        # psycopg 3 with a libpq that pipelines: a batch is one round trip (_in_pipeline).
        self._pipelined = together and _can_pipeline(dialect)
        result_types = (jobs.c.status.type, jobs.c.finished_at.type)
        self._job = Prepared(job, dialect, result_types)
        # The other steps of an outcome where it is not one statement: the target's
        # compare-and-set, the job's state, and its announcement.
        self._steps = (
            None
            if together
            else (
                Prepared(target, dialect),
                Prepared(read, dialect, result_types),
                Prepared(notify, dialect),
            )
        )
        # The same statements answering the job's every column too (write(whole=True)):
        # its columns start at _whole_at in the row, converted by their types.
        _, job_w, read_w, _ = _shaped(together, self._returning, whole=True)
        self._whole_at = 3 if together else 2
        types_w = (*result_types, *((Boolean(),) if together else ()), *(c.type for c in JOB_COLS))
        self._job_whole = Prepared(job_w, dialect, types_w)
        self._read_whole = Prepared(read_w, dialect, types_w)
        # An outcome's values converted once for all of its statements (_one_by_one).
        self._binder = Binder([self._job, self._job_whole, self._read_whole, *(self._steps or ())])
        self._sqlite = dialect.name == "sqlite"
        # Behind a pooler the store was not told of, preparing stops on every connection
        # once a statement was lost (dcache._engine.LostPrepared): this writer's too,
        # which it keeps across batches rather than taking it from the pool each time.
        self._lost = lost_prepared(db.engine)
        self._fresh()
        self._wal = False  # SQLite in WAL mode: the checkpointer is told of commits
        self.commits = 0  # transactions committed (tests and benchmarks read it)

    def _fresh(self) -> None:
        """The writer's state with no connection, no batch, no drain: at start, and in a
        forked child (see :meth:`forked`)."""
        # _mutex guards _queued, _leading and _closers. The leader commits without holding
        # it, so drains queue behind a running commit. Each waiting drain sleeps on its own
        # outcome's lock: the leader wakes exactly the ones it answered, and hands the lead
        # to the first one still queued (waking every waiter at every commit cost each of
        # them a wake-up and a turn at the GIL to find it was not theirs). _lead_ended is
        # notified when the lead ends while a close() waits for it.
        self._mutex = threading.Lock()
        self._lead_ended = threading.Condition(self._mutex)
        self._queued: list[_Outcome] = []
        self._leading = False  # a thread is committing a batch
        self._closers = 0  # close() calls waiting for the lead to end
        self._open = 0  # drains with a writer open (DB.writer): the outcomes to expect
        self._dropped: collections.deque[None] = collections.deque()  # see dropped()
        self._gathering = False  # a leader waits on _arrived for the other drains' outcomes
        self._arrived = threading.Condition(self._mutex)
        self._conn: Connection | None = None
        self._cursor: Any = None  # a DBAPI cursor of _conn's, kept across batches
        # Held while the connection is in use: a batch's commit, or a transaction of the
        # store's on it (transaction()). Taken after _mutex where both are held.
        self._conn_lock = threading.Lock()
        self._current: _Outcome | None = None  # the outcome whose statements are running

    def forked(self) -> None:
        """In a child process just forked from this one (see ``DB._forked``).

        The parent's other threads do not exist here, so a lock one of them held (a
        batch being committed at the fork) would never be released, and the writer's
        connection is the parent's session: a write of the child on it would interleave
        with the parent's. The state starts over, and the parent's connection and cursor
        are kept referenced but never used: garbage-collected, the connection would be
        reset (rolled back) on the parent's session.
        """
        _INHERITED.append((self._conn, self._cursor))
        self._fresh()

    def write(
        self,
        job_id: str,
        idx: int,
        *,
        status: str,
        result: str | None,
        error: str,
        hint: str,
        ttl: dt.timedelta,
        now: dt.datetime,
        whole: bool = False,
    ) -> WriteOutcome:
        """Store one outcome (queued with others, committed together); see the module.

        With ``whole``, a write that ends the job (or finds it ended) answers the job's
        row as that commit left it (``WriteOutcome.job``): a drain's last target asks,
        so that waiting for the job needs no read of it.
        """
        mine = _Outcome(
            {
                "whole": whole,
                "job_id": job_id,
                "idx": idx,
                "status": status,
                "result": result,
                "result_bytes": None if result is None else utf8_size(result),
                "error": error,
                "hint": hint,
                "now": now,
                "expires_at": now + ttl,
                "msg_id": message_id(job_id),
                "failures": 1 if status == FAILED else 0,
            }
        )
        mutex = self._mutex
        with mutex:
            self._queued.append(mine)
            lead = not self._leading
            self._leading = True
            if self._gathering and len(self._queued) >= self._expected():
                self._arrived.notify()  # the batch is complete (see _gather)
        if not lead:
            try:
                mine.wake.acquire()  # answered, or handed the lead
            except BaseException:  # an interrupt (KeyboardInterrupt) of a waiting drain
                self._withdraw(mine)
                raise
        if not mine.answered:
            # This thread leads. Its outcome is first in the queue: the queue was empty when
            # the lead was free, and a lead is handed to the first one queued.
            batch: list[_Outcome] = []
            try:
                with mutex:
                    try:
                        self._gather()
                    finally:  # an interrupt too: the batch is answered (see _answered)
                        batch = self._queued[:MAX_BATCH]
                        del self._queued[:MAX_BATCH]
                self._commit(batch)  # answers every outcome of the batch
            finally:
                self._answered(batch)
        if mine.error is not None:
            raise mine.error
        assert mine.answer is not None
        return mine.answer

    def opened(self) -> None:
        """A drain's writer opened: the leader expects its outcomes (see _gather)."""
        with self._mutex:
            self._settle_dropped()
            self._open += 1

    def closed(self) -> None:
        """A drain's writer closed: a leader waiting for its outcome stops waiting."""
        with self._mutex:
            self._open = max(0, self._open - 1)  # one opened before a fork: see forked()
            if self._gathering:
                self._arrived.notify()

    def dropped(self) -> None:
        """A drain's writer was collected without being closed (its finalizer).

        The garbage collector may call this on a thread that holds _mutex already, so it
        takes no lock: the count is settled by the next thread that holds the mutex and
        reads or changes it (see _expected); a leader gathering meanwhile waits out one
        slice at most.
        """
        self._dropped.append(None)  # deque.append: atomic

    def _settle_dropped(self) -> None:
        """(Holding _mutex.) Count the writers collected without being closed (in a
        forked child, a parent's writer may be: the count does not go below zero)."""
        dropped = self._dropped
        while dropped:
            dropped.popleft()
            self._open = max(0, self._open - 1)

    def _expected(self) -> int:
        """(Holding _mutex.) The outcomes a complete batch holds: one from every open
        drain, at most MAX_BATCH."""
        self._settle_dropped()
        return min(self._open, MAX_BATCH)

    def _gather(self) -> None:
        """(Leader, holding _mutex.) Wait a moment for the other open drains' outcomes.

        Drains that were answered together come back together: each builds its next
        outcome, and the first to queue it would lead a commit of that one alone while
        the others queue behind it for the next (batches of 1, 7, 1, 7 with eight drains).
        So a leader that finds fewer outcomes queued than drains open waits while they
        keep arriving: at most GATHER_SLICE for the next one, GATHER_MAX in all, and not
        at all for a lone drain. A drain whose fetch is slow costs the others one slice.
        The leader is woken when the batch is complete (an outcome of every open drain
        queued) or a drain's writer closes, not at every arrival: each wake-up took a turn
        at the GIL from the drains still to arrive (eight drains on SQLite, 1,536
        outcomes: about 480 commits before, 330 after).
        """
        queued = self._queued
        if len(queued) >= self._expected():
            return
        deadline = time.monotonic() + GATHER_MAX
        self._gathering = True
        try:
            while len(queued) < self._expected():
                seen = len(queued)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.wait(min(GATHER_SLICE, left))
                if len(queued) == seen:
                    break  # nobody came within a slice
        finally:
            self._gathering = False

    def _answered(self, batch: list[_Outcome]) -> None:
        """After the leader's commit of ``batch``: wake the drains it answered (its own
        lock is released too, unused), and hand the lead to the first one still queued."""
        for outcome in batch:
            if not outcome.answered:  # an interrupt of the leader before its commit
                outcome.error = StoreError("the write's batch was interrupted before its commit")
            outcome.wake.release()
        with self._mutex:
            following = self._pass_lead()
        if following is not None:
            following.wake.release()

    def _pass_lead(self) -> _Outcome | None:
        """(Holding _mutex, the lead ending.) The first outcome queued, now leading (its
        thread is to be woken), or None: then the lead is free."""
        following = self._queued[0] if self._queued else None
        if following is None:
            self._leading = False
            if self._closers:
                self._lead_ended.notify_all()
        else:
            following.lead = True
        return following

    def _withdraw(self, mine: _Outcome) -> None:
        """A drain stopped waiting for its outcome (interrupted): take it off the queue,
        and pass the lead on if it had been handed to it; else the lead would wait for a
        thread that is gone, and every later write and close() with it."""
        with self._mutex:
            if mine.answered or mine not in self._queued:
                return  # its batch is being (or was) committed: the leader answers it
            self._queued.remove(mine)
            following = self._pass_lead() if mine.lead else None
        if following is not None:
            following.wake.release()

    def close(self) -> None:
        """Give the write connection back to the pool."""
        with self._mutex:
            self._closers += 1
            try:
                while self._leading:
                    self._lead_ended.wait()
            finally:
                self._closers -= 1
            with self._conn_lock:  # a transaction() on it ends first
                self._drop()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A write transaction of the store on the writer's connection, between batches.

        For SQLite, where only one connection at a time may write: every write
        transaction of the store but the heartbeat's runs here (``DB._write``). One on
        another connection of this process that met a batch (or a batch that met it)
        waited in SQLite's busy handler, which sleeps 1 ms, then 2, then 5 between tries,
        and a cancel racing eight drains waited 55 ms at the 99th percentile; here it
        waits on a lock that the batch releases as it ends (3 ms). And SQLite empties a
        connection's page cache whenever another connection has written: the submit and
        its job's first write, on one connection, find each other's pages cached.
        Not re-entrant: nothing run inside may start another write of the store.
        """
        with self._conn_lock:
            conn = self._connection()
            try:
                with conn.begin():
                    yield conn
            except BaseException:
                # The connection is given back, so the pool's reset rolls back what is
                # left (SQLAlchemy does not, after a failed COMMIT: SQLite would keep the
                # transaction and its write lock), or discards it if it is unusable (a
                # closed database, which the "begin" hook meets before SQLAlchemy could
                # tell it is gone); the next write takes a fresh one.
                self._drop()
                raise

    def _drop(self) -> None:
        self._forget_cursor()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa_exc.SQLAlchemyError):
                conn.close()

    def _connection(self) -> Connection:
        if self._conn is None or self._conn.invalidated or self._conn.closed:
            self._drop()
            self._conn = self._db._write_connection()
            if self._sqlite:
                self._wal = self._checkpoint_elsewhere(self._conn)
        return self._conn

    @staticmethod
    def _checkpoint_elsewhere(conn: Connection) -> bool:
        """SQLite: whether the database is in WAL mode, so that the store's checkpointer
        thread is to be told of this writer's commits (see ``dcache._checkpoint``)."""
        try:
            dbapi: Any = conn.connection.driver_connection
            mode = dbapi.execute(_sql.SQLITE_JOURNAL_MODE).fetchone()
        except Exception:
            return False  # the commit will tell what is wrong; the bound holds meanwhile
        return mode is not None and str(mode[0]).lower() == "wal"  # not an in-memory one

    def _commit(self, batch: list[_Outcome]) -> None:
        """Commit ``batch`` in one transaction; answer every outcome in it."""
        with self._conn_lock:
            self._commit_held(batch)

    def _commit_held(self, batch: list[_Outcome]) -> None:
        """(Holding _conn_lock.) See _commit."""
        pending = batch
        while pending:
            self._current = None
            try:
                conn = self._connection()
                if self._lost is not None and self._lost.seen:
                    conn.connection.driver_connection.prepare_threshold = None  # type: ignore[union-attr]
                if self._wal and self._db._checkpointer.restart_due:
                    self._db._checkpointer.restart(conn.connection.driver_connection)
                if self._watched():
                    answers = self._through_engine(conn, pending)
                else:
                    answers = self._on_cursor(conn, pending)
                self.commits += 1
                for outcome, answer in zip(pending, answers, strict=True):
                    outcome.answer = answer
                if self._wal:
                    self._db._checkpointer.committed(len(pending))
                return
            except sa_exc.SQLAlchemyError as exc:
                err = translate(exc)
                if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
                    self._drop()
                current = self._current
                own = not _transient(err) or is_row_wait(exc)
                if current is not None and own and len(pending) > 1:
                    # This outcome's own statements were refused, or waited too long for
                    # its own row (a lock another session holds): answer it, retry the
                    # rest (which would meet the same lock on every retry with it).
                    current.error = err
                    pending = [o for o in pending if o is not current]
                    continue
                for outcome in pending:
                    outcome.error = err
                return
            except StoreError as exc:
                # The store's own (closed meanwhile: StoreClosedError): told as itself.
                self._drop()
                for outcome in pending:
                    outcome.error = exc
                return
            except BaseException as exc:
                # Not a database error: a bug, or an interrupt of the leader thread. The
                # connection's state is unknown; every outcome is told, none is lost.
                self._drop()
                err = StoreError(f"the write of a batch failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                current = self._current
                if current is not None and isinstance(exc, Exception) and len(pending) > 1:
                    # Raised by this outcome's own statement (its values: a caller's index
                    # no integer column holds): answer it, retry the rest.
                    current.error = err
                    pending = [o for o in pending if o is not current]
                    continue
                for outcome in pending:
                    outcome.error = err
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit: the leader's own thread stops
                return

    def _watched(self) -> bool:
        """Whether anyone watches statements (``echo``, cursor events: tracing, tests).

        Asked of the store's engine, whose listeners the writer's engine shares (it is
        the engine with options and a pool of its own): 0.4 µs a commit, where asking the
        writer's engine walks its chain of listener collections (1.7 µs).
        """
        return watched(self._db._engine)

    def _through_engine(self, conn: Connection, pending: list[_Outcome]) -> list[WriteOutcome]:
        """The batch through SQLAlchemy's execution: every engine event sees it."""

        def run(statement: Prepared, values: dict[str, Any]) -> tuple[int, Any]:
            result = conn.exec_driver_sql(statement.sql, statement.params(values))
            return result.rowcount, result.first

        answers = []
        with conn.begin():
            for outcome in pending:
                self._current = outcome
                answers.append(self._apply(run, outcome.values))
            self._current = None  # a failure past here is the COMMIT's: the batch's
        return answers

    def _on_cursor(self, conn: Connection, pending: list[_Outcome]) -> list[WriteOutcome]:
        """The same statements on the connection's DBAPI cursor, when nobody watches.

        SQLAlchemy's per-execute work (execution context, events, result set-up) costs
        as much as SQLite's own work for this write; the statements, their parameters'
        conversion and the error translation are the same as through the engine.
        """
        if self._pipelined:
            answers = self._in_pipeline(conn, pending)
            if answers is not None:
                return answers
        return self._one_by_one(conn, pending)

    def _in_pipeline(self, conn: Connection, pending: list[_Outcome]) -> list[WriteOutcome] | None:
        """PostgreSQL: the whole batch in one round trip and one transaction.

        Each outcome is one statement (see _together). In autocommit, a lone statement is
        its own transaction; for more, psycopg's pipeline mode sends every statement and
        then one Sync, and the server runs the statements up to the Sync as one implicit
        transaction, committed at the Sync or rolled back whole if any statement fails.
        So the batch costs one round trip whatever its size, where a transaction of its
        own costs two more (BEGIN, COMMIT); the pipeline's own work is left out for a
        lone statement, where it would cost more than the statement's client side.

        A statement the server refuses returns None: nothing was written, and the caller
        runs the batch again one statement at a time to find the outcome at fault. A lost
        connection (the Sync's reply lost included) raises, as a lost COMMIT does.
        """
        pooled = conn.connection
        dbapi: Any = pooled.driver_connection
        sql = self._job.sql
        cursors = []
        held = failed = False
        try:
            dbapi.autocommit = True  # a local switch: no round trip
            if len(pending) == 1:
                cursor, held = short_cursor(pooled)
                cursors.append(cursor)
                statement = self._job_of(pending[0].values)
                sql = statement.sql
                cursor.execute(sql, statement.params(pending[0].values))
            else:
                with dbapi.pipeline():
                    for outcome in pending:
                        cursor = dbapi.cursor()  # each keeps its own statement's row
                        cursors.append(cursor)
                        statement = self._job_of(outcome.values)
                        cursor.execute(statement.sql, statement.params(outcome.values))
            rows = [cursor.fetchone() for cursor in cursors]
        except Exception as exc:
            failed = True
            err = _as_sqlalchemy(conn, exc, sql, None)
            if err is exc:
                raise  # not the driver's: the caller's handler for anything else
            if isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated:
                raise err from exc
            return None  # refused by the server: nothing of the batch was kept
        finally:
            for cursor in cursors:
                release_cursor(pooled, cursor, held, failed)
            try:
                dbapi.autocommit = False
            except Exception as exc:
                # Left in autocommit, the next batch's own transaction would not be one.
                with contextlib.suppress(Exception):
                    conn.invalidate(exc)
        return [
            self._answer(row, outcome.values["whole"])
            for row, outcome in zip(rows, pending, strict=True)
        ]

    def _job_of(self, values: dict[str, Any]) -> Prepared:
        """The job's statement for an outcome (the one answering every column if asked)."""
        return self._job_whole if values["whole"] else self._job

    def _one_by_one(self, conn: Connection, pending: list[_Outcome]) -> list[WriteOutcome]:
        """The batch in a transaction of its own, one statement at a time.

        Each outcome's values are converted once (``Binder.bind``) for its two or three
        statements, which take their parameters from them.
        """
        dbapi: Any = conn.connection.driver_connection
        cursor = self._cursor
        if cursor is None or cursor.connection is not dbapi:
            self._forget_cursor()
            cursor = self._cursor = dbapi.cursor()
        sql = ""

        def run(statement: Prepared, bound: dict[Any, Any]) -> tuple[int, Any]:
            nonlocal sql
            sql = statement.sql
            cursor.execute(sql, statement.bound(bound))
            return cursor.rowcount, cursor.fetchone

        bind = self._binder.bind
        try:
            if self._sqlite:
                sql = _sql.SQLITE_BEGIN_WRITE  # as the engine's "begin" hook does for writes
                cursor.execute(sql)
            answers = []
            for outcome in pending:
                self._current = outcome
                answers.append(self._apply(run, bind(outcome.values)))
            self._current = None  # a failure past here is the COMMIT's: the batch's
            sql = _sql.SQLITE_COMMIT
            if self._sqlite:
                cursor.execute(sql)
            else:
                dbapi.commit()
            return answers
        except Exception as exc:
            with contextlib.suppress(Exception):
                if self._sqlite:
                    cursor.execute(_sql.SQLITE_ROLLBACK)
                else:
                    dbapi.rollback()
            err = _as_sqlalchemy(conn, exc, sql, cursor)
            self._forget_cursor()  # a cursor that failed is not used again
            raise err from exc

    def _forget_cursor(self) -> None:
        """Close the kept cursor (the next batch opens one on its connection)."""
        cursor, self._cursor = self._cursor, None
        if cursor is not None:
            with contextlib.suppress(Exception):
                cursor.close()

    def _apply(self, run: Any, values: dict[str, Any]) -> WriteOutcome:
        """One outcome's statements inside the batch's transaction."""
        whole = values["whole"]
        if self._steps is None:  # one statement (see _together)
            _, fetch = run(self._job_of(values), values)
            return self._answer(fetch(), whole)
        target, read, notify = self._steps
        if whole:
            read = self._read_whole
        rowcount, _ = run(target, values)
        row = None
        if rowcount == 1:
            _, fetch = run(self._job_of(values), values)
            if not self._returning:
                _, fetch = run(read, values)
            row = fetch()
            assert row is not None, "a target's job row is missing"
        if row is None:  # the target was not pending: nothing written
            _, fetch = run(read, values)
            row = fetch()
            return WriteOutcome(False, row[0] if row is not None else "")
        if row[0] not in LIVE:
            # This write ended the job (or found it ended): its announcement, if it has a
            # URL and none is queued yet, commits with it (see dcache._outbox).
            run(notify, values)
        return WriteOutcome(
            True, row[0], finished=row[1] is not None, job=self._ended(row) if whole else None
        )

    def _answer(self, row: Any, whole: bool) -> WriteOutcome:
        """The outcome of PostgreSQL's one statement, from its row (see _together)."""
        if row is None:  # the job's row is gone (purged)
            return WriteOutcome(False, "")
        status, finished_at, written = row[:3]
        if not written:
            return WriteOutcome(False, status)
        job = self._ended(row) if whole else None
        return WriteOutcome(True, status, finished=finished_at is not None, job=job)

    def _ended(self, row: Any) -> JobRow | None:
        """The job's row from a whole answer, if the job has ended and finished."""
        if row[0] in LIVE or row[1] is None:
            return None
        at = self._whole_at
        return job_from(self._job_whole.convert(row, start=at)[at:])


def _together(target: Any, job: Any, whole: bool = False) -> Any:
    """PostgreSQL's per-target write as one statement, from the write's own statements.

    The target's compare-and-set in a data-modifying CTE; the job's update only where it
    changed a row; the job's announcement queued where that update ended the job (the
    outbox's own statement, reading the updated row); then one row back: the job's
    status, its finish time and whether the target was written. When it was not, the
    row is the job as it stands (every part of one statement reads the same snapshot,
    and nothing in it changed the job). With ``whole`` the job's every column follows.
    """
    changed = target.returning(targets.c.job_id).cte("changed")
    wrote = select(changed.c.job_id).exists()
    returned = (
        JOB_COLS
        if whole
        else (jobs.c.id, jobs.c.caller, jobs.c.notify_url, jobs.c.status, jobs.c.finished_at)
    )
    after = job.where(wrote).returning(*returned).cte("after")
    notified = notify_statement(after).cte("notified")
    rest_after = [after.c[c.name] for c in JOB_COLS] if whole else []
    rest_now = list(JOB_COLS) if whole else []
    unchanged = select(jobs.c.status, jobs.c.finished_at, false(), *rest_now).where(
        jobs.c.id == bindparam("job_id"), ~wrote
    )
    written = select(after.c.status, after.c.finished_at, true(), *rest_after)
    return union_all(written, unchanged).add_cte(notified)


def _can_pipeline(dialect: Any) -> bool:
    """Whether the driver is psycopg 3 and its libpq has pipeline mode (libpq 14+)."""
    if dialect.driver != "psycopg":
        return False
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def _as_sqlalchemy(conn: Connection, exc: Exception, sql: str, cursor: Any) -> Exception:
    """A driver error as SQLAlchemy raises it (invalidating a dead connection).

    Anything else (not the driver's) is returned unchanged.
    """
    err = driver_error(conn.engine, conn.connection, exc, sql, cursor)
    if isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated:
        with contextlib.suppress(Exception):
            conn.invalidate(exc)
    return err


def driver_error(
    engine: Engine, pooled: PoolProxiedConnection, exc: Exception, sql: str, cursor: Any
) -> Exception:
    """A driver error on a pooled connection as SQLAlchemy raises it.

    A disconnect invalidates the connection, and every pooled connection opened before
    now (as SQLAlchemy does for a disconnect under ``Connection.execute``: a server
    restart killed them all; each is replaced at its next checkout, not handed out to
    fail again). Anything else (not the driver's) is returned unchanged.
    """
    dialect = engine.dialect
    base = getattr(dialect.loaded_dbapi, "Error", ())
    if not (base and isinstance(exc, base)):
        return exc
    disconnect = bool(dialect.is_disconnect(exc, pooled.driver_connection, cursor))
    if disconnect:
        with contextlib.suppress(Exception):
            engine.pool._invalidate(pooled, exc)
    err: Exception = sa_exc.DBAPIError.instance(
        sql, None, exc, base, connection_invalidated=disconnect
    )
    return err


def _transient(err: StoreError) -> bool:
    from ._errors import StoreUnavailableError

    return isinstance(err, StoreUnavailableError)
