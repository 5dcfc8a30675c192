"""The transactional outbox: each job end announced exactly once, delivered at least once.

A job may carry a notification URL (``batch_job.notify_url``). Whatever ends it (its last
target's write, a cancel, a reaper, ``fail_job``) inserts its outbox row in the same
transaction that sets the terminal status, with :func:`notify_statement`: no job end
without its row, no row without its job end. The row's id (``msg_<job id>``) is the
webhook id of every attempt, and the primary key: a second insert for the same job cannot
happen (the statement inserts only while none exists).

Senders (any live runner's) claim due rows for a while (:meth:`OutboxQueries.claim_notifications`,
``FOR UPDATE SKIP LOCKED`` on PostgreSQL and MariaDB, the write lock on SQLite), deliver
them, and record each attempt (:meth:`OutboxQueries.record_attempt`). A sender that dies
mid-delivery leaves its claim to lapse; another sender takes the row then.

A cancel ends its job (and queues the row) before the job has *finished*: its drain still
stores the target in flight, then sets ``finished_at`` (or a reaper does, if the drain's
process died). Senders ask the claim to hold such a row back until then (``finish_wait``),
so that the announcement shows the job as it finished; the row exists from the cancel on,
so it is never lost.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, bindparam, delete, exists, insert, literal, or_, select, update

from ._errors import wrap_errors
from ._rows import NotificationRow
from ._schema import DELIVERED, GIVEN_UP, LIVE, UNDELIVERED, UTCDateTime, jobs, outbox
from ._shared import aware_now, findable, prefixed_id

__all__ = [
    "OutboxQueries",
    "message_id",
    "notify_statement",
    "queue_notification",
]

_COLUMNS = [
    outbox.c.id,
    outbox.c.job_id,
    outbox.c.caller,
    outbox.c.url,
    outbox.c.job_status,
    outbox.c.status,
    outbox.c.attempts,
    outbox.c.next_attempt_at,
    outbox.c.claimed_by,
    outbox.c.last_answer,
    outbox.c.created_at,
    outbox.c.updated_at,
]


def message_id(job_id: str) -> str:
    """The webhook id of a job's end notification (the same for every attempt):
    ``msg_<job id>`` (for a job id over 60 characters, ``msg_`` and a digest of it)."""
    return prefixed_id("msg_", job_id)  # the id column holds 64 characters


def notify_statement(source: Any = jobs) -> Any:
    """Insert the job's outbox row if it has a notification URL and has ended.

    Parameters ``job_id``, ``msg_id`` (:func:`message_id`) and ``now``. Inserts nothing for
    a live job, a job without a URL, or one whose row exists already, so every path that
    ends a job can run it after its compare-and-set without counting who came first.
    ``source`` is where the job's row is read: the table, or the rows an ``UPDATE ...
    RETURNING`` of it gave in the same statement (PostgreSQL's per-target write).
    """
    now = bindparam("now", type_=UTCDateTime)
    msg = bindparam("msg_id", type_=outbox.c.id.type)
    taken = select(outbox.c.id).where(outbox.c.id == msg).exists()
    source = select(
        msg,
        source.c.id,
        source.c.caller,
        source.c.notify_url,
        source.c.status,
        literal(UNDELIVERED),
        literal(0),
        now,
        literal(""),
        literal(""),
        now,
        now,
    ).where(
        source.c.id == bindparam("job_id"),
        source.c.notify_url.is_not(None),
        source.c.status.not_in([literal(s) for s in LIVE]),
        ~taken,
    )
    return insert(outbox).from_select(_COLUMNS, source)


_NOTIFY = notify_statement()


def queue_notification(conn: Connection, job_id: str, now: dt.datetime) -> None:
    """In the caller's transaction, after it ended the job: queue its announcement."""
    conn.execute(_NOTIFY, {"job_id": job_id, "msg_id": message_id(job_id), "now": now})


def _row(r: Any) -> NotificationRow:
    return NotificationRow(**{c.name: r._mapping[c.name] for c in _COLUMNS})


# A notification whose job was purged while it was still pending: it is sent once more
# (the job's id and status only), and goes once it is delivered or given up.
_JOB_GONE = ~exists().where(jobs.c.id == outbox.c.job_id)


def read_notification(conn: Connection, job_id: str) -> NotificationRow | None:
    """The job's end notification read on ``conn`` (in its transaction), or ``None``."""
    r = conn.execute(select(*_COLUMNS).where(outbox.c.id == message_id(job_id))).first()
    return _row(r) if r is not None else None


class OutboxQueries:
    """The outbox methods of :class:`DB` (see the module docstring)."""

    if TYPE_CHECKING:
        dialect: str

        def _write(self) -> AbstractContextManager[Connection]: ...

        def _read(self) -> AbstractContextManager[Connection]: ...

        def _one_statement(self) -> Connection: ...

    @wrap_errors
    def claim_notifications(
        self,
        owner: str,
        *,
        now: dt.datetime | None = None,
        lease: dt.timedelta = dt.timedelta(seconds=60),
        limit: int = 16,
        finish_wait: dt.timedelta | None = None,
    ) -> list[NotificationRow]:
        """Claim up to ``limit`` due notifications for ``owner`` until ``now + lease``.

        Due: pending, its next attempt at or before ``now``, and not claimed by a sender
        whose claim still holds. Rows another transaction is claiming are skipped, so
        several senders share the work without waiting for each other.

        With ``finish_wait``, the row of a job that has ended but not finished (a
        cancelled job whose drain is still storing its target in flight) is held back
        until the job finishes, or until ``finish_wait`` after the row was queued.
        """
        now = aware_now(now)
        due = [
            outbox.c.status == UNDELIVERED,
            outbox.c.next_attempt_at <= now,
            or_(outbox.c.claimed_until.is_(None), outbox.c.claimed_until < now),
        ]
        with self._write() as conn:
            if finish_wait is not None:
                # First a plain read, which locks nothing: the due rows whose job has
                # finished (or is gone), or that waited long enough. The claim below then
                # locks only outbox rows, as without finish_wait: a subquery on the jobs
                # in a locking read may lock job rows on InnoDB (those a drain's write
                # holds among them). A job never unfinishes, so what this read passed
                # stays passed; the locking read re-checks the rest. It reads a few times
                # the limit, so that rows other senders are claiming leave this one some.
                unfinished = (
                    select(jobs.c.id)
                    .where(jobs.c.id == outbox.c.job_id, jobs.c.finished_at.is_(None))
                    .exists()
                )
                ready = (
                    conn.execute(
                        select(outbox.c.id)
                        .where(*due, or_(~unfinished, outbox.c.created_at <= now - finish_wait))
                        .order_by(outbox.c.next_attempt_at, outbox.c.id)
                        .limit(limit * 4)
                    )
                    .scalars()
                    .all()
                )
                if not ready:
                    return []
                due.append(outbox.c.id.in_(ready))
            q = (
                select(*_COLUMNS)
                .where(*due)
                .order_by(outbox.c.next_attempt_at, outbox.c.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
            rows = [_row(r) for r in conn.execute(q)]
            if rows:
                conn.execute(
                    update(outbox)
                    .where(outbox.c.id.in_([r.id for r in rows]))
                    .values(claimed_by=owner, claimed_until=now + lease, updated_at=now)
                )
        return rows

    @wrap_errors
    def release_notifications(self, owner: str, msg_ids: Sequence[str]) -> int:
        """Give back rows this ``owner`` claimed and will not attempt (a sender stopping,
        or a claim with no time left for them): the next claim takes them at once, not
        after the lease. Rows since recorded or claimed by another are left alone; how
        many were given back."""
        if not msg_ids:
            return 0
        with self._write() as conn:
            n = conn.execute(
                update(outbox)
                .where(
                    outbox.c.id.in_(list(msg_ids)),
                    outbox.c.claimed_by == owner,
                    outbox.c.status == UNDELIVERED,
                )
                .values(claimed_by="", claimed_until=None)
            ).rowcount
        return int(n)

    @wrap_errors
    def record_attempt(
        self,
        msg_id: str,
        owner: str,
        *,
        outcome: str,
        answer: str,
        next_attempt_at: dt.datetime | None = None,
        now: dt.datetime | None = None,
    ) -> bool:
        """Record one delivery attempt of a notification this ``owner`` claimed.

        ``outcome`` is ``"delivered"``, ``"failed"`` (given up) or ``"pending"`` (try
        again at ``next_attempt_at``). False when the claim was lost meanwhile (it
        lapsed and another sender took the row): the attempt is not recorded.
        """
        if outcome not in (UNDELIVERED, DELIVERED, GIVEN_UP):
            raise ValueError(f"outcome must be pending, delivered or failed, not {outcome!r}")
        now = aware_now(now)
        values: dict[str, Any] = {
            "status": outcome,
            "attempts": outbox.c.attempts + 1,
            "last_answer": answer[:2000],
            "claimed_by": "",
            "claimed_until": None,
            "updated_at": now,
        }
        if outcome == UNDELIVERED:
            if next_attempt_at is None:
                raise ValueError("a pending outcome needs next_attempt_at")
            values["next_attempt_at"] = next_attempt_at
        with self._write() as conn:
            won = conn.execute(
                update(outbox)
                .where(
                    outbox.c.id == msg_id,
                    outbox.c.claimed_by == owner,
                    outbox.c.status == UNDELIVERED,
                )
                .values(**values)
            ).rowcount
            if won == 1 and outcome != UNDELIVERED:
                conn.execute(delete(outbox).where(outbox.c.id == msg_id, _JOB_GONE))
        return bool(won == 1)

    @wrap_errors
    def notification(self, job_id: str) -> NotificationRow | None:
        """The job's end notification, or ``None`` (no URL, not ended, or purged)."""
        if not findable(job_id):
            return None
        with self._one_statement() as conn:
            r = conn.execute(
                select(*_COLUMNS).where(outbox.c.id == message_id(job_id), ~_JOB_GONE)
            ).first()
        return _row(r) if r is not None else None

    @wrap_errors
    def redeliver(self, job_id: str, now: dt.datetime | None = None) -> bool:
        """Send a delivered or failed notification again, now (same webhook id).

        Its attempts start over from 0: the redelivery gets the whole retry schedule,
        from its first step. False when the job has no notification, or it is still
        pending.
        """
        if not findable(job_id):
            return False
        now = aware_now(now)
        with self._write() as conn:
            won = conn.execute(
                update(outbox)
                .where(
                    outbox.c.id == message_id(job_id),
                    outbox.c.status != UNDELIVERED,
                    ~_JOB_GONE,  # a purged job's notification is not sent again
                )
                .values(
                    status=UNDELIVERED,
                    attempts=0,
                    next_attempt_at=now,
                    claimed_by="",
                    claimed_until=None,
                    updated_at=now,
                )
            ).rowcount
        return bool(won == 1)
