"""SQLite: WAL checkpoints on a thread of their own, off the per-target write's path.

In WAL mode every commit appends its pages to the ``-wal`` file, and by default the
connection whose commit takes the log past 1,000 pages copies them back into the database
file (a *checkpoint*, with an fsync) before its commit returns. On the group writer's
connection that is a drain waiting: one write in about a hundred took 3-4 ms, a fifth of
the mean write (one drain, 1 KiB results: mean 85-92 µs a write before, 69-73 after; the
measurements are in docs/performance.md).

So the store moves that work to a :class:`Checkpointer` thread: the store's connections
checkpoint on their own commits only past :data:`AUTOCHECKPOINT_PAGES` (a bound, should
the thread fall behind or not run), and every :data:`EVERY_OUTCOMES` outcomes the group
writer commits wake the thread, which runs a ``PASSIVE`` checkpoint on a connection of its
own. ``PASSIVE`` waits for no reader or writer: drains keep committing meanwhile, and SQLite
releases the GIL while it copies and syncs, so on a machine with a second core the work
overlaps theirs. Durability is unchanged: a commit is as durable as ``synchronous``
makes it whether or not its pages have been copied back yet.

Copying pages back does not shorten the log: SQLite starts it over only when a write
transaction begins with every page of it copied, which never happens while drains write
without a pause (each checkpoint ends behind the commits made during it). The log then
grew to the connections' bound, and the commit that crossed it copied back what was left
(about 1,700 pages: a drain's write stalled 5-7 ms every 450 outcomes). So when a
checkpoint of the thread leaves a log of :data:`RESTART_PAGES` or more wholly copied, it
marks the log for a restart (:attr:`Checkpointer.restart_due`), and the group writer's
leader, before its next batch, runs a ``PASSIVE`` checkpoint of its own
(:meth:`Checkpointer.restart`): it copies the few pages committed since, and the batch's
first write starts the log over. The drain that leads pays that small copy and its two
syncs (0.5-1 ms once every 1,000-2,000 pages) instead of the large one, and the log stays
near :data:`RESTART_PAGES` pages.

A store whose pool cannot be duplicated (a ``StaticPool``: one connection shared by all)
gets no thread: its connections checkpoint at the bound, as SQLite would at its default.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from . import _sql

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["AUTOCHECKPOINT_PAGES", "EVERY_OUTCOMES", "RESTART_PAGES", "Checkpointer"]

log = logging.getLogger("dcache")

# The store's connections' own checkpoint threshold, in pages (SQLite's default is 1,000):
# a commit checkpoints only if the thread has not kept the log below this (16 MiB of 4 KiB
# pages). The thread's checkpoints copy pages back, but only a writer that finds them all
# copied starts the log over, which a drain writing without a pause never does: the log
# then grows to this bound, and the commit that crosses it copies back the few pages left
# and lets the log start over.
AUTOCHECKPOINT_PAGES = 4_000
# Outcomes committed by the group writer between two wake-ups of the thread: each adds a
# few pages to the log (about nine with 1 KiB results), so this checkpoints about as
# often as SQLite's default would. Fewer outcomes a wake-up make each checkpoint shorter,
# so fewer pages are committed during it for the leader's restart to copy.
EVERY_OUTCOMES = 128
# A checkpoint of the thread that leaves at least this many log pages wholly copied marks
# the log for a restart by the group writer's leader (see the module docstring).
RESTART_PAGES = 1_000


class Checkpointer:
    """Runs ``PRAGMA wal_checkpoint(PASSIVE)`` on a daemon thread when woken.

    :meth:`committed` is called by the group writer after each of its commits (on a WAL
    database only: see ``GroupWriter._connection``); it costs a counter increment, and
    every :data:`EVERY_OUTCOMES` outcomes committed it wakes the thread, started on first
    need (and again in a forked child, where the parent's thread does not exist).
    """

    def __init__(self, engine: Engine | None) -> None:
        self._engine = engine  # None: no thread (see the module docstring)
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _thread and _closed
        self._thread: threading.Thread | None = None
        self._closed = False
        self._since = 0  # outcomes committed since the thread was last woken
        self.checkpoints = 0  # checkpoints run (tests read it)
        self.failures = 0  # checkpoints that raised (busy, I/O); tried again next time
        # Set by the thread, cleared by the leader's restart (see the module docstring).
        # A plain flag: one thread sets it, the group writer's leader clears it.
        self.restart_due = False
        self.restarts = 0  # the leader's checkpoints before a restart (tests read it)

    def committed(self, outcomes: int) -> None:
        """The group writer committed a batch of ``outcomes`` (see the class docstring).

        Counted in outcomes, not commits: a batch of eight drains' outcomes adds about
        eight times the pages of one.
        """
        self._since += outcomes  # one writer at a time calls this: the group writer's leader
        # While a restart is due the thread sleeps on: its checkpoint would hold the lock
        # that the leader's restart needs (which would find it busy and not restart).
        if self._since >= EVERY_OUTCOMES and not self.restart_due:
            self._since = 0
            self.wake()

    def wake(self) -> None:
        """Run a checkpoint soon (starting the thread if it is not running)."""
        with self._lock:
            if self._closed or self._engine is None:
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="dcache-checkpoint", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (a checkpoint under way finishes first). Idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            row = self.checkpoint()
            if row is not None and row[0] == 0 and row[2] == row[1] >= RESTART_PAGES:
                self.restart_due = True

    def checkpoint(self) -> tuple[int, int, int] | None:
        """One ``PASSIVE`` checkpoint now: SQLite's (busy, log pages, pages copied), or
        ``None`` if it failed (it is logged at DEBUG and counted in ``failures``)."""
        if self._engine is None:
            return None
        try:
            conn = self._engine.raw_connection()  # the driver's errors come unwrapped
            try:
                dbapi: Any = conn.driver_connection
                row = dbapi.execute(_sql.SQLITE_CHECKPOINT).fetchone()
            finally:
                conn.close()
        except Exception:
            # No connection, another process's checkpoint running (SQLITE_BUSY), a full
            # disk: the next wake-up tries again, and the connections' own threshold
            # bounds the log meanwhile.
            self.failures += 1
            log.debug("WAL checkpoint failed", exc_info=True)
            return None
        self.checkpoints += 1
        return (int(row[0]), int(row[1]), int(row[2])) if row is not None else None

    def restart(self, dbapi: Any) -> None:
        """(The group writer's leader, before a batch, on its own connection while no
        transaction is open.) Copy back what was committed since the thread's checkpoint,
        so that the batch's first write starts the log over (see the module docstring).

        Runs once for each mark, and never raises: a failure leaves the log as it was
        (the connections' bound still holds it) and is logged at DEBUG. Busy (another
        store's checkpoint on the file running), it is left to the thread's next
        checkpoint to mark the restart again.
        """
        self.restart_due = False  # the thread may be woken again (see committed)
        try:
            row = dbapi.execute(_sql.SQLITE_CHECKPOINT).fetchone()
        except Exception:
            log.debug("WAL checkpoint before a restart of the log failed", exc_info=True)
            return
        if row is not None and row[0] == 0:
            self.restarts += 1
