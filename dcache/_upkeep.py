"""Owners, reaping and purge: what the runners' heartbeat and maintenance threads call.

Owner rows live on the control pool, so drains holding every pooled connection can
never starve a heartbeat; purge works in bounded batches of short transactions.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    and_,
    delete,
    exists,
    func,
    insert,
    not_,
    or_,
    select,
    update,
)

from ._errors import wrap_errors
from ._rows import OwnerRow
from ._schema import CANCELLED, LIVE, UNDELIVERED, jobs, outbox, owners, targets, tombstones
from ._shared import LIVE_IN, aware_now

TOMBSTONE_TTL = dt.timedelta(days=7)  # how long a purged job's id still answers "expired"
# The longest period allowed (DB.open checks it): ``now - tombstone_ttl`` must stay a date.
MAX_TOMBSTONE_TTL = dt.timedelta(days=100 * 365)

# What one purge transaction deletes at most (stored results, plus a row's own weight each;
# always one job at least): on SQLite its write lock stops every writer of the file, and on
# MariaDB drains stalled behind it, for about 85 ms a MiB here (500 jobs of 100 KiB
# results: 8.5 s). A few MiB keep each transaction to a fraction of a second.
PURGE_BATCH_BYTES = 4 * 1024 * 1024
_ROW_BYTES = 512  # a target row's weight in that budget, beside its result


def _within_budget(ids: Sequence[str], sizes: Sequence[Any]) -> list[str]:
    """The oldest of ``ids`` (in their order) whose targets fit in PURGE_BATCH_BYTES
    together, by ``sizes`` (job id, targets, their results' bytes); the first one
    whatever its size."""
    weight: dict[str, int] = dict.fromkeys(ids, 0)
    for job_id, count, size in sizes:
        weight[job_id] += _ROW_BYTES * int(count) + int(size or 0)
    taken: list[str] = []
    total = 0
    for job_id in ids:
        total += weight[job_id]
        if taken and total > PURGE_BATCH_BYTES:
            break
        taken.append(job_id)
    return taken


# Jobs a drain may still be working on: live, or cancelled with the drain not yet ended.
_UNFINISHED = or_(LIVE_IN, and_(jobs.c.status == CANCELLED, jobs.c.finished_at.is_(None)))


class Upkeep:
    """The owner, reaping and purge methods of :class:`DB`."""

    if TYPE_CHECKING:
        tombstone_ttl: dt.timedelta

        def _control(self) -> AbstractContextManager[Connection]: ...

        def _reap(
            self, conn: Connection, rows: Sequence[Any], reason: str, now: dt.datetime
        ) -> int: ...

        def _write(self) -> AbstractContextManager[Connection]: ...

    @wrap_errors
    def heartbeat(
        self,
        owner: str,
        now: dt.datetime | None = None,
        *,
        stale_after: dt.timedelta | None = None,
    ) -> None:
        """Record that ``owner`` (a live runner) is alive at ``now``.

        ``stale_after`` is the owner's own word on how long after this beat it may be
        taken for dead; :meth:`reap_orphans` honours it, so runners with different
        heartbeat periods (a rolling deploy) never reap a punctual peer.
        """
        now = aware_now(now)
        stale_at = None if stale_after is None else now + stale_after
        # On a pool of its own: drains holding every pooled connection cannot starve it.
        with self._control() as conn:
            n = conn.execute(
                update(owners)
                .where(owners.c.owner == owner)
                .values(heartbeat_at=now, stale_at=stale_at, beats=owners.c.beats + 1)
            ).rowcount
            if n == 0:
                conn.execute(
                    insert(owners).values(
                        owner=owner, heartbeat_at=now, started_at=now, stale_at=stale_at, beats=1
                    )
                )

    @wrap_errors
    def remove_owner(self, owner: str) -> None:
        """Forget an owner that stopped cleanly."""
        with self._control() as conn:
            conn.execute(delete(owners).where(owners.c.owner == owner))

    @wrap_errors
    def owners(self) -> list[OwnerRow]:
        """Every owner row, and every owner named by an unfinished job but without a row.

        What a judge of liveness observes: see :class:`OwnerRow` and :meth:`reap_owners`.
        """
        with self._control() as conn:
            found = [
                OwnerRow(
                    owner=r.owner,
                    present=True,
                    beats=r.beats,
                    heartbeat_at=r.heartbeat_at,
                    stale_after=None if r.stale_at is None else r.stale_at - r.heartbeat_at,
                )
                for r in conn.execute(
                    select(owners.c.owner, owners.c.beats, owners.c.heartbeat_at, owners.c.stale_at)
                )
            ]
            missing = conn.execute(
                select(jobs.c.owner)
                .distinct()
                .select_from(jobs.outerjoin(owners, owners.c.owner == jobs.c.owner))
                .where(_UNFINISHED, owners.c.owner.is_(None))
            ).scalars()
            found.extend(OwnerRow(owner=o, present=False) for o in missing)
        return found

    @wrap_errors
    def reap_owners(
        self,
        dead: Mapping[str, tuple[int, dt.datetime | None] | None],
        reason: str,
        now: dt.datetime | None = None,
    ) -> int:
        """Fail the unfinished jobs of owners judged dead; return how many were failed.

        ``dead`` maps each owner to the :attr:`OwnerRow.token` the judge saw unchanged
        for its staleness window. Under the owner rows' locks, an owner whose token has
        changed since (it beat after all, or came back) is spared; the others' live jobs
        are failed with ``error=reason`` (compare-and-set each), their cancelled jobs are
        marked finished, and their rows are deleted, in one transaction.
        """
        if not dead:
            return 0
        now = aware_now(now)
        names = sorted(dead)
        with self._control() as conn:
            rows = conn.execute(
                select(owners.c.owner, owners.c.beats, owners.c.heartbeat_at)
                .where(owners.c.owner.in_(names))
                .with_for_update()
            ).all()
            current: dict[str, tuple[int, dt.datetime | None] | None] = dict.fromkeys(names)
            current.update({r.owner: (r.beats, r.heartbeat_at) for r in rows})
            confirmed = [o for o in names if current[o] == dead[o]]
            if not confirmed:
                return 0
            unfinished = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .where(jobs.c.owner.in_(confirmed), _UNFINISHED)
                .order_by(jobs.c.id)
            ).all()
            marked = self._reap(conn, unfinished, reason, now)
            conn.execute(delete(owners).where(owners.c.owner.in_(confirmed)))
        return marked

    @wrap_errors
    def reap_orphans(
        self, reason: str, stale_after: dt.timedelta, now: dt.datetime | None = None
    ) -> int:
        """Fail the live jobs whose owner stopped beating; return how many.

        An owner is stale when it has no row, or when its last heartbeat is older than
        ``now - stale_after`` and the ``stale_after`` it declared in :meth:`heartbeat`
        has passed too. Each job is a compare-and-set, so one that finished
        meanwhile is never touched. Cancelled jobs of stale owners are marked finished.
        Stale owner rows are removed after their jobs, in the same transaction.

        This compares the ``heartbeat_at`` each owner wrote on its own wall clock with
        ``now`` on the caller's: it is safe only where one clock writes and judges (one
        host whose clock does not step). A wall-clock step, or another host's clock
        ahead of the owner's, fails a live owner's jobs. :class:`batch.Runner` judges by
        observation on its monotonic clock instead: :meth:`owners`, then
        :meth:`reap_owners`.
        """
        now = aware_now(now)
        cutoff = now - stale_after
        # Dead by the reaper's measure AND past the owner's own declared deadline.
        dead = and_(
            owners.c.heartbeat_at < cutoff,
            or_(owners.c.stale_at.is_(None), owners.c.stale_at < now),
        )
        with self._write() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .select_from(jobs.outerjoin(owners, owners.c.owner == jobs.c.owner))
                .where(
                    or_(
                        jobs.c.status.in_(LIVE),
                        and_(jobs.c.status == CANCELLED, jobs.c.finished_at.is_(None)),
                    ),
                    or_(owners.c.owner.is_(None), dead),
                )
                .order_by(jobs.c.id)
            ).all()
            marked = self._reap(conn, rows, reason, now)
            gone = conn.execute(select(owners.c.owner).where(dead)).scalars().all()
            if gone:
                # Re-check in the DELETE: an owner that beat since the select keeps its row.
                conn.execute(delete(owners).where(owners.c.owner.in_(gone), dead))
        return marked

    @wrap_errors
    def purge_expired(
        self,
        now: dt.datetime | None = None,
        *,
        limit: int = 500,
        max_batches: int = 100,
        tombstone_ttl: dt.timedelta | None = None,
    ) -> int:
        """Delete jobs whose lease lapsed with their targets: never a live one, nor a
        cancelled one whose drain has not ended while its owner still beats (a fetch
        may outlast the lease, and its target is still to be stored). An owner that
        stopped, was reaped or has not beaten since the lease lapsed has no drain left.

        Each deleted job leaves a tombstone (its id, caller and expiry), so :meth:`lookup`
        can tell "expired" from "unknown" for ``tombstone_ttl`` after the lease lapsed (by
        default the store's, see :meth:`open`); older tombstones are deleted here too.
        Works in batches of at most ``limit`` jobs and ``PURGE_BATCH_BYTES`` (4 MiB) of
        stored results, each target row counting 512 bytes more (one job at least), each
        its own short transaction, so live writers are never blocked for long; at most
        ``max_batches`` of them a call (call again while it returns more than 0).
        Returns how many jobs were deleted.

        Raises:
            ValueError: ``limit`` or ``max_batches`` is not an ``int`` of 1 or more.
        """
        for name, bound in (("limit", limit), ("max_batches", max_batches)):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(f"{name} must be an int of 1 or more, not {bound!r}")
        now = aware_now(now)
        keep = self.tombstone_ttl if tombstone_ttl is None else tombstone_ttl
        self._forget_tombstones(now - keep, limit, max_batches)
        gone = 0
        # A cancelled job's drain may still be fetching (past the lease, even): its owner
        # beating since the lease lapsed says so. An owner gone (stopped cleanly, or
        # reaped) left no drain, and one silent since then is taken for dead here.
        draining = and_(
            jobs.c.status == CANCELLED,
            jobs.c.finished_at.is_(None),
            exists().where(
                owners.c.owner == jobs.c.owner, owners.c.heartbeat_at > jobs.c.expires_at
            ),
        )
        lapsed = and_(jobs.c.expires_at <= now, jobs.c.status.not_in(LIVE), not_(draining))
        # Oldest lease first, by the expiry index: a range that ends at ``now`` and stops
        # at ``limit`` rows, however many jobs the table holds (ordered by id, the same
        # query walked the whole primary key on SQLite and sorted a scan on PostgreSQL).
        oldest = select(jobs.c.id).where(lapsed).order_by(jobs.c.expires_at).limit(limit)
        for _ in range(max_batches):
            with self._write() as conn:
                ids = conn.execute(oldest).scalars().all()
                if not ids:
                    break
                # What each weighs first (a plain read of sizes, no result read), so
                # that only the jobs this transaction takes are locked.
                sizes = conn.execute(
                    select(
                        targets.c.job_id,
                        func.count(),
                        # A result stored before schema 3 has no size: its length.
                        func.coalesce(
                            func.sum(
                                func.coalesce(targets.c.result_bytes, func.length(targets.c.result))
                            ),
                            0,
                        ),
                    )
                    .where(targets.c.job_id.in_(ids))
                    .group_by(targets.c.job_id)
                ).all()
                taken = _within_budget(ids, sizes)
                # Lock in the per-target write's order, targets then job, so a late write
                # to a lapsed job waits (and then finds its target gone) instead of
                # deadlocking; then re-check each job under its lock: a job whose lease a
                # write just moved is kept whole.
                conn.execute(
                    select(targets.c.job_id, targets.c.idx)
                    .where(targets.c.job_id.in_(taken))
                    .with_for_update()
                ).all()
                found = conn.execute(
                    select(jobs.c.id, jobs.c.caller, jobs.c.expires_at)
                    .where(jobs.c.id.in_(taken), lapsed)
                    .with_for_update()
                ).all()
                confirmed = [r.id for r in found]
                if confirmed:
                    # A job id the store's caller used again after its first job's purge:
                    # the newer tombstone replaces the older.
                    conn.execute(delete(tombstones).where(tombstones.c.id.in_(confirmed)))
                    conn.execute(
                        insert(tombstones),
                        [
                            {"id": r.id, "caller": r.caller, "expired_at": r.expires_at}
                            for r in found
                        ],
                    )
                    conn.execute(delete(targets).where(targets.c.job_id.in_(confirmed)))
                    # Announcements already made go with their job; a pending one stays
                    # until it is delivered or given up (its sender reads the job's end
                    # from the row itself then).
                    conn.execute(
                        delete(outbox).where(
                            outbox.c.job_id.in_(confirmed),
                            outbox.c.status != UNDELIVERED,
                        )
                    )
                    gone += conn.execute(delete(jobs).where(jobs.c.id.in_(confirmed))).rowcount
            if len(taken) == len(ids) < limit:
                break
        return gone

    def _forget_tombstones(self, before: dt.datetime, limit: int, max_batches: int) -> None:
        """Delete the tombstones older than ``before``: batches of ``limit``, at most
        ``max_batches`` of them, each its own short transaction (the rest wait a call)."""
        old = (
            select(tombstones.c.id)
            .where(tombstones.c.expired_at < before)
            .order_by(tombstones.c.expired_at)
            .limit(limit)
        )
        for _ in range(max_batches):
            with self._write() as conn:
                ids = conn.execute(old).scalars().all()
                if ids:
                    conn.execute(delete(tombstones).where(tombstones.c.id.in_(ids)))
            if len(ids) < limit:
                break
