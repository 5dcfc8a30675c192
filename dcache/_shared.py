"""What the store's query modules share.

The clock and its checks, key checks, column lists, the one mapping from a job row to
:class:`JobRow`, and the visibility rule (a job is visible while its lease holds, and
always while it is live).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs
from sqlalchemy import Row, bindparam, func, literal_column, null, or_, select

from ._rows import JobRow
from ._schema import LIVE, UTCDateTime, jobs, result_bytes, targets


def utcnow() -> dt.datetime:
    """The library's default clock: aware UTC wall time."""
    return dt.datetime.now(dt.timezone.utc)


def findable(*keys: object) -> bool:
    """Whether keys could name a stored row: strings every backend can compare.

    A NUL (PostgreSQL refuses it) or a lone surrogate (not UTF-8) can be in no key the
    store wrote, so lookups answer "not found" without asking the database.
    """
    return all(isinstance(key, str) and _unstorable(key) is None for key in keys)


def check_storable(what: str, value: str) -> None:
    """Refuse text that some backend cannot store (see ``_unstorable``), on every
    backend alike."""
    reason = _unstorable(value)
    if reason is not None:
        raise ValueError(f"{what} {reason}")


def _unstorable(text: str) -> str | None:
    """Why some backend cannot store ``text`` (a NUL: PostgreSQL's text cannot hold one;
    a lone surrogate: not UTF-8), or ``None``. ASCII text is not encoded to tell."""
    if "\x00" in text:
        return "must not contain NUL characters"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "is not UTF-8 text (it holds a lone surrogate)"
    return None


def prefixed_id(prefix: str, job_id: str, length: int = 64) -> str:
    """``prefix + job_id``, or, when that would not fit a ``length``-character column (a
    caller's id of up to 64 characters), ``prefix`` and as many hex digits of the id's
    SHA-256 as fit: the same for the same id, distinct for distinct ids."""
    text = prefix + job_id
    if len(text) <= length:
        return text
    digest = hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()
    return prefix + digest[: length - len(prefix)]


def utf8_size(text: str) -> int:
    """A text's size in UTF-8 bytes (its length when it is ASCII, without encoding it)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def aware_now(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return utcnow()
    if not isinstance(now, dt.datetime):
        raise TypeError(f"now must be an aware UTC datetime or None, not {type(now).__name__}")
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"naive datetime {now!r}: pass an aware UTC datetime")
    return now.astimezone(dt.timezone.utc)


def job_from(values: Sequence[Any]) -> JobRow:
    """A job row from its columns' values in table order (see ``JOB_COLS``)."""
    if len(values) != len(JOB_NAMES):
        raise ValueError(f"a job row has {len(JOB_NAMES)} columns, not {len(values)}")
    v = list(values)
    ttl = v[_TTL] = dt.timedelta(microseconds=v[_TTL])
    if v[_STATUS] in LIVE:
        # A live job's lease is its last write + ttl; the per-target write does not store
        # it (the expiry index is left alone on the hot path, see dcache._writer).
        v[_EXPIRES] = v[_UPDATED] + ttl
    return JobRow(*[v[i] for i in _JOB_ROW_ORDER])


def job_row(row: Row[Any]) -> JobRow:
    return job_from(tuple(row))


JOB_COLS = [c for c in jobs.c]


JOB_NAMES = [c.name for c in JOB_COLS]
_TTL, _STATUS, _UPDATED, _EXPIRES = (
    JOB_NAMES.index(n) for n in ("ttl_us", "status", "updated_at", "expires_at")
)
# Each of JobRow's fields, in its order, by the position of its column ("ttl": "ttl_us").
_JOB_ROW_ORDER = [
    JOB_NAMES.index("ttl_us" if f.name == "ttl" else f.name) for f in attrs.fields(JobRow)
]


TARGET_COLS = [
    targets.c.idx,
    targets.c.url,
    targets.c.options,
    targets.c.status,
    targets.c.result,
    targets.c.error,
    targets.c.hint,
    targets.c.updated_at,
]


# "Live" with the statuses inlined: an expanding IN parameter is re-rendered per execute.
LIVE_IN = jobs.c.status.in_([literal_column(f"'{s}'") for s in LIVE])


def visible(now: Any) -> Any:
    """A job is visible while its lease holds, and always while it is live."""
    return or_(jobs.c.expires_at > now, LIVE_IN)


Q_STATUS = (
    select(*JOB_COLS, *TARGET_COLS)
    .select_from(jobs.outerjoin(targets, targets.c.job_id == jobs.c.id))
    .where(jobs.c.id == bindparam("job_id"), visible(bindparam("now", type_=UTCDateTime)))
    .order_by(targets.c.idx)
)


def result_size() -> Any:
    """A target's result size in UTF-8 bytes: stored with the result since version 3, and
    measured (the value read) only for a result stored before (COALESCE stops at the
    first value that is not NULL on every backend)."""
    return func.coalesce(targets.c.result_bytes, result_bytes(targets.c.result))


# A target without its result, but with its size (TargetRow.result_bytes).
TARGET_COLS_BRIEF = [
    *(null().label("result") if c is targets.c.result else c for c in TARGET_COLS),
    result_size().label("result_bytes"),
]


# The same without the results, but with their sizes.
Q_STATUS_BRIEF = Q_STATUS.with_only_columns(*JOB_COLS, *TARGET_COLS_BRIEF)
