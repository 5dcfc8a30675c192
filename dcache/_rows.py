"""Plain values the store hands back: rows and decision outcomes."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import attrs

from ._schema import LIVE, PENDING, RUNNING, Delivery

__all__ = [
    "JobRow",
    "Lookup",
    "NewTarget",
    "NotificationRow",
    "OwnerRow",
    "SubmitOutcome",
    "TargetRow",
    "WriteOutcome",
    "as_shown",
    "in_flight",
]


def in_flight(job_status: str, targets_done: int, idx: int, target_status: str) -> bool:
    """Whether target ``idx`` is the one its job's drain is fetching now.

    A running job's drain takes its targets in index order and stores each before it
    starts the next, so the target in flight is the pending one at index
    ``targets_done``. The runner, the HTTP API, the CLI and the dashboard show it as
    ``running`` (a status no stored target has): this is the one place that rule lives.
    """
    return job_status == RUNNING and idx == targets_done and target_status == PENDING


def as_shown(job_status: str, targets_done: int, row: TargetRow) -> TargetRow:
    """A stored target row as the reads show it: ``running`` while it is in flight."""
    if in_flight(job_status, targets_done, row.idx, row.status):
        return attrs.evolve(row, status=RUNNING)
    return row


@attrs.frozen
class NewTarget:
    """A target to insert: its URL and its options already encoded as JSON text."""

    url: str
    options: str = "{}"


@attrs.frozen
class JobRow:
    """One stored job."""

    id: str
    caller: str
    caller_class: str
    idem_key: str
    status: str
    error: str
    targets_total: int
    targets_done: int
    targets_failed: int
    owner: str
    ttl: dt.timedelta
    created_at: dt.datetime
    updated_at: dt.datetime
    expires_at: dt.datetime
    finished_at: dt.datetime | None
    payload_key: str | None = None
    notify_url: str | None = None  # where the job's end is announced (a webhook)

    @property
    def announced(self) -> bool:
        """True when the job has ended and asked for its end to be announced; only then
        can it have an end notification (see ``dcache._outbox``)."""
        return self.notify_url is not None and self.status not in LIVE


@attrs.frozen
class TargetRow:
    """One stored target of a job; ``result`` is the runner's JSON text or ``None``."""

    idx: int
    url: str
    options: str
    status: str
    result: str | None
    error: str
    hint: str
    updated_at: dt.datetime | None
    # The stored result's size in UTF-8 bytes, when the read left the result out.
    result_bytes: int | None = None


@attrs.frozen
class NotificationRow:
    """A job's end notification in the outbox (see ``dcache._outbox``).

    ``status`` is ``pending`` (``next_attempt_at`` says when), ``delivered`` or
    ``failed`` (given up); ``last_answer`` is what the last attempt got (an HTTP status
    and the start of the body, or the error).
    """

    id: str
    job_id: str
    caller: str
    url: str
    job_status: str
    status: str
    attempts: int
    next_attempt_at: dt.datetime
    claimed_by: str
    last_answer: str
    created_at: dt.datetime
    updated_at: dt.datetime

    def to_json(self) -> dict[str, object]:
        """The state a poll shows: status, attempts, next attempt, last answer."""
        return {
            "id": self.id,
            "url": self.url,
            "status": self.status,
            "attempts": self.attempts,
            "next_attempt_at": (
                self.next_attempt_at.isoformat() if self.status == Delivery.PENDING else None
            ),
            "last_answer": self.last_answer,
        }


@attrs.frozen
class SubmitOutcome:
    """What the submit transaction decided.

    ``kind`` is ``"created"`` or ``"reused"`` (``job`` set), or ``"caller_busy"`` /
    ``"busy"`` with ``live`` the count that hit the cap.
    """

    kind: Literal["created", "reused", "caller_busy", "busy"]
    job: JobRow | None = None
    live: int = 0


@attrs.frozen
class WriteOutcome:
    """What a per-target write did.

    ``stored`` is False when the target was not pending (already written, or unknown).
    ``status`` is the job's status after the write ("" for an unknown job), so a drain
    learns of a cancel made by another process; ``finished`` says the write closed the job.
    ``job`` is the job's row as the write left it, when the write was asked for it
    (``job_row=True``), stored the target and found the job ended and finished.
    """

    stored: bool
    status: str
    finished: bool = False
    job: JobRow | None = None

    @property
    def running(self) -> bool:
        """Whether the drain should go on to the next target."""
        return self.status in LIVE


@attrs.frozen
class OwnerRow:
    """A runner as the owners table shows it, or an owner named by live jobs but missing.

    ``token`` changes with every beat the owner makes: a judge that sees it unchanged for
    a whole staleness window, measured on the judge's own monotonic clock, may take the
    owner for dead. A missing owner (``present`` False) has the token ``None``.
    """

    owner: str
    present: bool
    beats: int = 0
    heartbeat_at: dt.datetime | None = None
    stale_after: dt.timedelta | None = None

    @property
    def token(self) -> tuple[int, dt.datetime | None] | None:
        """What changes when the owner beats (``None`` for a missing owner)."""
        return (self.beats, self.heartbeat_at) if self.present else None


@attrs.frozen
class Lookup:
    """What the store knows of a job id.

    ``state`` is ``"found"`` (readable), ``"expired"`` (its lease lapsed; ``expired_at``
    says when, and ``caller`` whose it was) or ``"unknown"`` (never seen, or forgotten
    since: tombstones are kept for a while only).
    """

    state: Literal["found", "expired", "unknown"]
    caller: str = ""
    expired_at: dt.datetime | None = None
