"""Status changes: the drain's write and every compare-and-set.

Each change is a compare-and-set (``UPDATE ... WHERE status IN (...)``) that reports
whether it won, so a late writer never overwrites a terminal status.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, and_, or_, select, update

from ._errors import wrap_errors
from ._outbox import queue_notification
from ._rows import WriteOutcome
from ._schema import CANCELLED, LIVE, Status, jobs
from ._shared import aware_now, check_storable, findable, prefixed_id
from ._writer import GroupWriter


class JobChanges:
    """The status-changing methods of :class:`DB`."""

    if TYPE_CHECKING:

        def _check_size(self, result: str | None, *others: str) -> None: ...

        _group: GroupWriter

        def _write(self) -> AbstractContextManager[Connection]: ...

        def _check_open(self) -> None: ...

    @wrap_errors
    def write_target(
        self,
        job_id: str,
        idx: int,
        *,
        status: str,
        result: str | None = None,
        error: str = "",
        hint: str = "",
        ttl: dt.timedelta,
        now: dt.datetime | None = None,
        job_row: bool = False,
    ) -> WriteOutcome:
        """Store one target's outcome and move the job along, in one transaction.

        Compare-and-set: only a ``pending`` target is written. The job's counters advance
        and its lease moves to ``now + ttl``; if this was the last target of a running
        job, the terminal status (``done``/``failed``/``partial``) is set here, once. If
        the job is no longer live (cancelled, or failed by a reaper), the target is still
        stored and the job is marked finished, so its drain stops after this write.

        Writes of concurrent drains are committed together (group commit, see
        ``dcache._writer``); this returns once this write is committed.

        With ``job_row=True`` a write that leaves the job ended and finished also answers
        the job's row as its commit left it (``WriteOutcome.job``), from the same
        statements: a drain asks on its last target, so that whoever waits for the job
        needs no read of it.

        Raises:
            ValueError: ``status`` is not ``done``/``failed``, or ``result``, ``error`` or
                ``hint`` holds a NUL or a lone surrogate (no backend would store it alike).
            ResultTooLargeError: the result does not fit in one row on this backend.
        """
        if status not in (Status.DONE, Status.FAILED):
            raise ValueError(f"a target is written done or failed, not {status!r}")
        if result is not None:
            check_storable("result", result)
        check_storable("error", error)
        check_storable("hint", hint)
        self._check_size(result, error, hint, job_id)
        self._check_open()
        return self._group.write(
            job_id,
            idx,
            status=status,
            result=result,
            error=error,
            hint=hint,
            ttl=ttl,
            now=aware_now(now),
            whole=job_row,
        )

    def _ttl_of(self, conn: Connection, job_id: str) -> dt.timedelta | None:
        ttl_us = conn.execute(select(jobs.c.ttl_us).where(jobs.c.id == job_id)).scalar()
        return dt.timedelta(microseconds=ttl_us) if ttl_us is not None else None

    @wrap_errors
    def cancel(self, job_id: str, now: dt.datetime | None = None) -> bool:
        """Flip a live job to ``cancelled``; False if unknown or already terminal."""
        if not findable(job_id):
            return False
        now = aware_now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._cancel(conn, job_id, ttl, now)

    @staticmethod
    def _cancel(conn: Connection, job_id: str, ttl: dt.timedelta, now: dt.datetime) -> bool:
        """The cancel's compare-and-set (live -> cancelled) and its job-end notification."""
        won = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status.in_(LIVE))
            .values(status=CANCELLED, updated_at=now, expires_at=now + ttl)
        ).rowcount
        if won == 1:
            queue_notification(conn, job_id, now)  # the job's end, in its transaction
        return bool(won == 1)

    @wrap_errors
    def fail_job(
        self,
        job_id: str,
        reason: str,
        now: dt.datetime | None = None,
        *,
        release_key: bool = False,
    ) -> bool:
        """Mark a live job failed with ``error=reason`` and finished; False if not live.

        With ``release_key``, for a job that no drain ever ran, the job also gives up its
        idempotency key: the same submission made again creates a fresh job instead of
        being handed this one.
        """
        if not findable(job_id):
            return False
        now = aware_now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._fail(conn, job_id, reason, ttl, now, release_key=release_key)

    @staticmethod
    def _fail(
        conn: Connection,
        job_id: str,
        reason: str,
        ttl: dt.timedelta,
        now: dt.datetime,
        *,
        release_key: bool = False,
    ) -> bool:
        values: dict[str, Any] = {
            "status": Status.FAILED.value,
            "error": reason,
            "updated_at": now,
            "expires_at": now + ttl,
            "finished_at": now,
        }
        if release_key:
            # Keys are 64 hex digits: this one can never be looked up (and it fits the
            # key's column whatever the id's length).
            values["idem_key"] = prefixed_id("released:", job_id)
        won = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.status.in_(LIVE)).values(**values)
        ).rowcount
        if won == 1:
            queue_notification(conn, job_id, now)  # the job's end, in its transaction
        return bool(won == 1)

    @staticmethod
    def _close_cancelled(
        conn: Connection, job_id: str, ttl: dt.timedelta, now: dt.datetime
    ) -> bool:
        won = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.status.not_in(LIVE),
                jobs.c.finished_at.is_(None),
            )
            .values(finished_at=now, updated_at=now, expires_at=now + ttl)
        ).rowcount
        return bool(won == 1)

    @wrap_errors
    def mark_finished(self, job_id: str, now: dt.datetime | None = None) -> bool:
        """Record that a stopped (non-live) job's drain has ended; False if nothing to do."""
        if not findable(job_id):
            return False
        now = aware_now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._close_cancelled(conn, job_id, ttl, now)

    @wrap_errors
    def mark_in_flight_failed(self, reason: str, now: dt.datetime | None = None) -> int:
        """Mark every ``queued``/``running`` job failed with ``error=reason``.

        The single-process restart tool: call it at start, before any runner drains,
        when this process is the only one using the database. Stored targets stay
        readable, pending ones stay pending, nothing is resumed. Cancelled jobs whose
        drain died before finishing are marked finished too. Returns how many jobs were
        marked failed.
        """
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, not {type(reason).__name__}")
        now = aware_now(now)
        with self._write() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .where(
                    or_(
                        jobs.c.status.in_(LIVE),
                        and_(jobs.c.status == CANCELLED, jobs.c.finished_at.is_(None)),
                    )
                )
                .order_by(jobs.c.id)
            ).all()
            return self._reap(conn, rows, reason, now)

    def _reap(self, conn: Connection, rows: Sequence[Any], reason: str, now: dt.datetime) -> int:
        # One compare-and-set per job, by primary key in id order: on InnoDB an UPDATE
        # through a secondary index would deadlock against per-target writes.
        marked = 0
        for r in rows:
            ttl = dt.timedelta(microseconds=r.ttl_us)
            if r.status in LIVE:
                marked += self._fail(conn, r.id, reason, ttl, now)
            else:
                self._close_cancelled(conn, r.id, ttl, now)
        return marked
