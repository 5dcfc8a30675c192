"""Operators' reads: counts, filtered listings, cap usage and target summaries.

The dashboard and the metrics scrape read through these, never through raw SQL of their
own. Each method is one short read transaction built from the Core tables; each filters
on an indexed column (``status``, ``(caller, status)``) wherever the question allows.
"""

from __future__ import annotations

import datetime as dt
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import attrs
from sqlalchemy import Connection, func, select

from ._errors import wrap_errors
from ._rows import JobRow
from ._schema import LIVE, jobs, targets
from ._shared import JOB_NAMES, aware_now, findable, job_from, result_size, visible

__all__ = ["AdminQueries", "TargetSummary"]


@attrs.frozen
class TargetSummary:
    """One target as an operator's page shows it: everything but the result itself.

    ``result_bytes`` is the size of the stored result (its JSON text, UTF-8), ``None``
    when no result is stored.
    """

    idx: int
    url: str
    status: str
    error: str
    hint: str
    result_bytes: int | None
    updated_at: dt.datetime | None


def _job(row: Any) -> JobRow:  # a Row of the job columns (and maybe more)
    m = row._mapping
    return job_from([m[name] for name in JOB_NAMES])


_Q_LIVE_BY_CALLER = (
    select(jobs.c.caller, func.count()).where(jobs.c.status.in_(LIVE)).group_by(jobs.c.caller)
)


class AdminQueries:
    """Reads for operators (the dashboard, the metrics scrape), mixed into :class:`DB`."""

    if TYPE_CHECKING:

        def _read(self) -> AbstractContextManager[Connection]: ...

    @wrap_errors
    def live_by_caller(self) -> dict[str, int]:
        """Live (``queued``/``running``) jobs per caller, over the whole database.

        One query on the status index; it returns at most ``jobs_total`` rows' worth of
        callers, so it is cheap enough for every metrics scrape.
        """
        with self._read() as conn:
            return {caller: int(n) for caller, n in conn.execute(_Q_LIVE_BY_CALLER)}

    @wrap_errors
    def status_counts(
        self, *, caller: str | None = None, now: dt.datetime | None = None
    ) -> dict[str, int]:
        """Visible jobs per status, optionally one caller's (statuses with none left out)."""
        if caller is not None and not findable(caller):
            return {}
        now = aware_now(now)
        q = select(jobs.c.status, func.count()).where(visible(now)).group_by(jobs.c.status)
        if caller is not None:
            q = q.where(jobs.c.caller == caller)
        with self._read() as conn:
            return {status: int(n) for status, n in conn.execute(q)}

    @wrap_errors
    def jobs_page(
        self,
        *,
        status: str | None = None,
        caller: str | None = None,
        offset: int = 0,
        limit: int = 50,
        now: dt.datetime | None = None,
    ) -> list[JobRow]:
        """Visible jobs, newest first, filtered by status and/or caller; one page of them.

        Raises:
            ValueError: a negative ``offset`` or a ``limit`` below 1.
        """
        if offset < 0 or limit < 1:
            raise ValueError(f"offset must be >= 0 and limit >= 1, not {offset}, {limit}")
        for value in (status, caller):
            if value is not None and not findable(value):
                return []
        now = aware_now(now)
        q = select(*jobs.c).where(visible(now))
        if status is not None:
            q = q.where(jobs.c.status == status)
        if caller is not None:
            q = q.where(jobs.c.caller == caller)
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).offset(offset).limit(limit)
        with self._read() as conn:
            return [_job(r) for r in conn.execute(q)]

    @wrap_errors
    def job_summary(
        self, job_id: str, now: dt.datetime | None = None
    ) -> tuple[JobRow, list[TargetSummary]] | None:
        """The job and its targets without their results (sizes only), in index order.

        Read in one statement, so the job's counters and its targets agree. ``None`` when
        the job is unknown or its lease has lapsed.
        """
        if not findable(job_id):
            return None
        now = aware_now(now)
        q = (
            select(
                *jobs.c,
                targets.c.idx.label("t_idx"),
                targets.c.url.label("t_url"),
                targets.c.status.label("t_status"),
                targets.c.error.label("t_error"),
                targets.c.hint.label("t_hint"),
                result_size().label("t_bytes"),
                targets.c.updated_at.label("t_updated_at"),
            )
            .select_from(jobs.outerjoin(targets, targets.c.job_id == jobs.c.id))
            .where(jobs.c.id == job_id, visible(now))
            .order_by(targets.c.idx)
        )
        with self._read() as conn:
            rows = conn.execute(q).all()
        if not rows:
            return None
        return _job(rows[0]), [
            TargetSummary(
                idx=int(m["t_idx"]),
                url=m["t_url"],
                status=m["t_status"],
                error=m["t_error"],
                hint=m["t_hint"],
                result_bytes=None if m["t_bytes"] is None else int(m["t_bytes"]),
                updated_at=m["t_updated_at"],
            )
            for m in (r._mapping for r in rows)
            if m["t_idx"] is not None
        ]

    @wrap_errors
    def target_result(self, job_id: str, idx: int, now: dt.datetime | None = None) -> str | None:
        """One target's stored result (the runner's JSON text); ``None`` when there is none.

        ``None`` too when the job is unknown or its lease has lapsed.
        """
        if not findable(job_id) or isinstance(idx, bool) or not isinstance(idx, int):
            return None
        if not 0 <= idx < 2**31:  # an INTEGER column: anything else names no target
            return None
        now = aware_now(now)
        q = (
            select(targets.c.result)
            .select_from(targets.join(jobs, targets.c.job_id == jobs.c.id))
            .where(targets.c.job_id == job_id, targets.c.idx == idx, visible(now))
        )
        with self._read() as conn:
            value = conn.execute(q).scalar_one_or_none()
        return value if isinstance(value, str) else None
