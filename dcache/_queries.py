"""Reads of jobs and targets: status polls, listings, lookups."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, func, select

from . import _sql
from ._errors import wrap_errors
from ._prepared import Prepared
from ._reads import every
from ._rows import JobRow, Lookup, TargetRow
from ._schema import LIVE, TARGET_ROWID, jobs, targets, tombstones, utf8
from ._shared import (
    JOB_COLS,
    TARGET_COLS,
    TARGET_COLS_BRIEF,
    aware_now,
    findable,
    job_from,
    job_row,
    visible,
)

R = TypeVar("R")

MAX_LIMIT = 2**63 - 1  # the largest LIMIT every backend takes (a signed 64-bit integer)


def check_limit(limit: object) -> None:
    """Refuse a list's ``limit`` that is not an ``int`` from 0 to ``2**63 - 1``.

    Raises:
        ValueError: it is not.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be an int of 0 or more, not {limit!r}")
    if limit > MAX_LIMIT:
        # No backend takes a LIMIT past a signed 64-bit integer: SQLite's driver
        # overflows, the servers refuse the statement's syntax.
        raise ValueError(f"limit must be at most 2**63 - 1 ({MAX_LIMIT}), not {limit}")


class JobReads:
    """The read methods of :class:`DB`."""

    if TYPE_CHECKING:
        _engine: Engine
        dialect: str
        tombstone_ttl: dt.timedelta

        def _read(self) -> AbstractContextManager[Connection]: ...

        def _one_statement(self) -> Connection: ...

        def _prepared_read(
            self,
            read: Prepared,
            values: dict[str, Any],
            fetch: Callable[[Any], R],
            *,
            short: bool = False,
        ) -> R: ...

        _status_brief: Prepared

        _status_read: Prepared

        def poll_job(self, job_id: str, now: dt.datetime | None = None) -> JobRow | None: ...

    def get_job(self, job_id: str, now: dt.datetime | None = None) -> JobRow | None:
        """The job, or ``None`` when unknown or its lease has lapsed.

        One prepared statement on the job's key (the conditional poll's, see
        :meth:`poll_job`): ``Runner.wait`` and ``Runner.job`` read it once per job.
        """
        return self.poll_job(job_id, now)

    @wrap_errors
    def get_job_with_targets(
        self, job_id: str, now: dt.datetime | None = None, *, results: bool = True
    ) -> tuple[JobRow, list[TargetRow]] | None:
        """The job and all its targets in index order, read in one statement (consistent).

        With ``results=False`` every target's ``result`` is left out (``None``) and its
        size in bytes is read instead (``TargetRow.result_bytes``): a poll of a job with
        large results reads a few hundred bytes. ``None`` when the job is unknown or its
        lease has lapsed.
        """
        if not findable(job_id):
            return None
        now = aware_now(now)
        read = self._status_read if results else self._status_brief
        # Status polling is the hot read: one prepared statement, the job's columns
        # converted once (from the first row), the targets' from every row.
        rows = self._prepared_read(read, {"job_id": job_id, "now": now}, every)
        if not rows:
            return None
        t0 = len(JOB_COLS)
        job = job_from(read.convert(rows[0])[:t0])
        out = [TargetRow(*read.convert(r, start=t0)[t0:]) for r in rows if r[t0] is not None]
        return job, out

    @wrap_errors
    def get_target(
        self, job_id: str, idx: int, now: dt.datetime | None = None, *, results: bool = True
    ) -> tuple[JobRow, TargetRow] | None:
        """The job and one of its targets (with its result), read in one statement.

        ``None`` when the job is unknown, its lease has lapsed, or it has no such target.
        With ``results=False`` the result is left out and its size read instead
        (``TargetRow.result_bytes``), as :meth:`get_job_with_targets` does.
        """
        if not findable(job_id) or isinstance(idx, bool) or not isinstance(idx, int):
            return None
        now = aware_now(now)
        q = (
            select(*JOB_COLS, *(TARGET_COLS if results else TARGET_COLS_BRIEF))
            .select_from(jobs.join(targets, targets.c.job_id == jobs.c.id))
            .where(jobs.c.id == job_id, targets.c.idx == idx, visible(now))
        )
        with self._one_statement() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        t0 = len(JOB_COLS)
        return job_from(tuple(row)[:t0]), TargetRow(*tuple(row)[t0:])

    @wrap_errors
    def get_result_slice(self, job_id: str, idx: int, start: int, length: int) -> str | None:
        """Characters ``start`` to ``start + length`` (from 0) of a target's stored result.

        One keyed read; the database cuts the text, so only the slice crosses the wire and
        is held here: a reader pulls a large result a slice at a time with bounded memory
        (``GET /jobs/<id>/targets/<idx>/content``). ``""`` past its end; ``None`` when the
        target or its result is not (or no longer) stored. Lease and owner are not checked:
        read the target first (:meth:`get_target`), then its slices.
        """
        if not findable(job_id) or isinstance(idx, bool) or not isinstance(idx, int):
            return None
        if start < 0 or length < 0:
            raise ValueError(f"a slice needs start >= 0 and length >= 0, not {start}, {length}")
        q = select(func.substr(targets.c.result, start + 1, length)).where(
            targets.c.job_id == job_id, targets.c.idx == idx
        )
        with self._one_statement() as conn:
            row = conn.execute(q).first()
        return None if row is None else row[0]

    @wrap_errors
    def read_result(self, job_id: str, idx: int, offset: int, size: int) -> bytes | None:
        """Bytes ``offset`` to ``offset + size`` (from 0) of a target's stored result, UTF-8.

        As :meth:`get_result_slice`, in bytes of the text's UTF-8 encoding, cut anywhere
        (a reader decodes incrementally). The servers cut the value and send only the
        slice; SQLite reads it in place through its incremental blob I/O (Python 3.11+),
        so not even the database library loads the whole value (``substr`` would, for
        each slice). ``b""`` past its end; ``None`` when the target or its result is not
        (or no longer) stored. Lease and owner are not checked: read the target first.
        """
        if not findable(job_id) or isinstance(idx, bool) or not isinstance(idx, int):
            return None
        if offset < 0 or size < 0:
            raise ValueError(f"a slice needs offset >= 0 and size >= 0, not {offset}, {size}")
        where = (targets.c.job_id == job_id, targets.c.idx == idx, targets.c.result.is_not(None))
        if self.dialect == "sqlite" and self._sqlite_blobs():
            # The row's rowid and the blob handle in one read transaction: the same row.
            with self._read() as conn:
                rowid = conn.execute(select(TARGET_ROWID).where(*where)).scalar()
                if rowid is None:
                    return None
                dbapi: Any = conn.connection.driver_connection
                with dbapi.blobopen(targets.name, targets.c.result.name, rowid) as blob:
                    end = len(blob)
                    if offset >= end or size == 0:
                        return b""
                    blob.seek(offset)
                    data: bytes = blob.read(min(size, end - offset))
                conn.exec_driver_sql(_sql.SQLITE_SHRINK_MEMORY)
                return data
        q = select(func.substr(utf8(targets.c.result), offset + 1, size)).where(*where)
        with self._one_statement() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        return bytes(row[0] or b"")  # SQLite's substr of an empty blob is NULL

    def _sqlite_blobs(self) -> bool:
        """Whether this SQLite store's values can be read as blobs holding their UTF-8:
        the driver has ``blobopen`` (Python 3.11+) and the file's encoding is UTF-8."""
        found = self.__dict__.get("_blobs")
        if found is None:
            found = False
            if hasattr(sqlite3.Connection, "blobopen"):
                with self._read() as conn:
                    encoding = conn.exec_driver_sql(_sql.SQLITE_ENCODING).scalar()
                found = str(encoding).upper() == "UTF-8"
            self.__dict__["_blobs"] = found
        return bool(found)

    @wrap_errors
    def lookup(self, job_id: str, now: dt.datetime | None = None) -> Lookup:
        """Whether a job id is readable, expired (purged or not yet) or unknown.

        One indexed read of the job row and, when it is gone, of its tombstone. A lapsed
        job answers "expired" for the store's ``tombstone_ttl`` after its lease lapsed,
        and no longer, whether :meth:`purge_expired` has deleted it yet or not.
        """
        if not findable(job_id):
            return Lookup("unknown")
        now = aware_now(now)
        since = now - self.tombstone_ttl  # a job lapsed before this is forgotten
        with self._read() as conn:
            row = conn.execute(
                select(jobs.c.caller, jobs.c.status, jobs.c.expires_at).where(jobs.c.id == job_id)
            ).first()
            if row is not None:
                if row.status in LIVE or row.expires_at > now:
                    return Lookup("found", row.caller)
                if row.expires_at >= since:
                    return Lookup("expired", row.caller, row.expires_at)
                return Lookup("unknown")  # lapsed longer ago than a tombstone is kept
            gone = conn.execute(
                select(tombstones.c.caller, tombstones.c.expired_at).where(
                    tombstones.c.id == job_id,
                    tombstones.c.expired_at >= since,
                )
            ).first()
        if gone is None:
            return Lookup("unknown")
        return Lookup("expired", gone.caller, gone.expired_at)

    @wrap_errors
    def list_jobs(
        self,
        *,
        caller: str | None = None,
        live_only: bool = False,
        limit: int = 100,
        now: dt.datetime | None = None,
    ) -> list[JobRow]:
        """Visible jobs, newest first, optionally one caller's and/or only live ones.

        Raises:
            ValueError: ``limit`` is not an ``int`` from 0 to ``2**63 - 1``.
        """
        check_limit(limit)
        if caller is not None and not findable(caller):
            return []
        now = aware_now(now)
        q = select(*JOB_COLS).where(visible(now))
        if caller is not None:
            q = q.where(jobs.c.caller == caller)
        if live_only:
            q = q.where(jobs.c.status.in_(LIVE))
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        with self._read() as conn:
            return [job_row(r) for r in conn.execute(q)]
