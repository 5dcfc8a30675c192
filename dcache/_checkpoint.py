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

__all__ = ["AUTOCHECKPOINT_PAGES", "EVERY_OUTCOMES", "Checkpointer"]

log = logging.getLogger("dcache")

# The store's connections' own checkpoint threshold, in pages (SQLite's default is 1,000):
# a commit checkpoints only if the thread has not kept the log below this (16 MiB of 4 KiB
# pages). The thread's checkpoints copy pages back, but only a writer that finds them all
# copied starts the log over, which a drain writing without a pause never does: the log
# then grows to this bound, and the commit that crosses it copies back the few pages left
# and lets the log start over.
AUTOCHECKPOINT_PAGES = 4_000
# Outcomes committed by the group writer between two wake-ups of the thread: each adds a
# few pages to the log, so this checkpoints about as often as SQLite's default would.
EVERY_OUTCOMES = 256


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

    def committed(self, outcomes: int) -> None:
        """The group writer committed a batch of ``outcomes`` (see the class docstring).

        Counted in outcomes, not commits: a batch of eight drains' outcomes adds about
        eight times the pages of one.
        """
        self._since += outcomes  # one writer at a time calls this: the group writer's leader
        if self._since >= EVERY_OUTCOMES:
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
            self.checkpoint()

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
