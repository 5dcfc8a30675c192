"""The runner: submissions, one daemon drain thread per job, heartbeats and reaping."""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import stamina

import dcache
from dcache import JobRow, NewTarget, StoreError, StoreUnavailableError, TargetRow, WriteOutcome

from ._errors import (
    BusyError,
    CallerBusyError,
    FetchError,
    IdempotencyKeyMismatchError,
    InvalidTargetsError,
    RunnerClosedError,
    TooManyTargetsError,
)
from ._values import (
    MAX_CALLER_LENGTH,
    MAX_KEY_LENGTH,
    Config,
    Job,
    Options,
    Result,
    Target,
    TargetStatus,
    canonical,
    check_text,
    client_idem_key,
    idem_key,
    normalize_targets,
)

__all__ = ["Fetch", "Runner", "new_job_id"]

Fetch = Callable[[Target], Result]

_ORPHAN_BEATS = 3  # an owner is dead after this many missed heartbeats
MAX_MESSAGE_LENGTH = 8192  # a stored error or hint, in characters
_MAX_ID = 64


def new_job_id() -> str:
    """A fresh job id: 128 random bits from :mod:`secrets`, as 32 hex digits."""
    return secrets.token_hex(16)


def _plausible_id(job_id: object) -> bool:
    """Whether an id could name a job; anything else is unknown without a query."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= _MAX_ID:
        return False
    return job_id.isascii() and job_id.isprintable()


@attrs.define(eq=False)
class _Drain:
    """The in-process state of one job being drained."""

    job_id: str
    targets: list[Target]
    stop: threading.Event = attrs.Factory(threading.Event)  # cancel or shutdown asked
    done: threading.Event = attrs.Factory(threading.Event)  # the drain has ended
    shutdown: bool = False
    thread: threading.Thread | None = None


def _job(row: JobRow) -> Job:
    return Job(
        id=row.id,
        status=row.status,
        error=row.error,
        targets_total=row.targets_total,
        targets_done=row.targets_done,
        finished_at=row.finished_at,
        caller=row.caller,
        caller_class=row.caller_class,
        created_at=row.created_at,
        updated_at=row.updated_at,
        expires_at=row.expires_at,
        owner=row.owner,
        targets_failed=row.targets_failed,
    )


def _target_status(row: TargetRow, *, in_flight: bool) -> TargetStatus:
    result = None
    if row.result is not None:
        result = Result.from_json(json.loads(row.result))
    try:
        options = Options(**json.loads(row.options))
    except (TypeError, ValueError):
        options = Options()
    status = "running" if in_flight and row.status == "pending" else row.status
    return TargetStatus(
        idx=row.idx,
        url=row.url,
        status=status,
        result=result,
        error=row.error,
        hint=row.hint,
        options=options,
    )


class Runner:
    """Runs persistent, serial batch jobs: one daemon thread drains each job's targets.

    Args:
        db: the store (:class:`dcache.DB`); the runner does not close it.
        fetch: ``fetch(target) -> Result``, called once per target, one at a time per
            job. It may raise :class:`FetchError` to fail a target with a hint.
        config: limits and timings; ``None`` means ``Config()``.
        log: where to log; ``None`` means ``logging.getLogger("batch")``.
        clock: the time source (aware UTC); tests inject one.

    Building a runner registers it as a live *owner* with a heartbeat and fails, with
    error ``"restart"``, the live jobs of owners that stopped beating (dead processes),
    so the default path is safe with any number of processes sharing the database.
    """

    def __init__(
        self,
        db: dcache.DB,
        fetch: Fetch,
        config: Config | None = None,
        log: logging.Logger | None = None,
        *,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self._db = db
        self._fetch = fetch
        self._config = config if config is not None else Config()
        self._log = log if log is not None else logging.getLogger("batch")
        self._clock = clock if clock is not None else dcache.utcnow
        self.owner: str = secrets.token_hex(16)
        # Guards _drains, _closed and _abandoned only; never held across I/O.
        self._lock = threading.Lock()
        self._drains: dict[str, _Drain] = {}
        self._abandoned: set[str] = set()
        self._closed = False
        self._stopping = threading.Event()
        self._next_purge = 0.0
        self._stale_after = self._config.heartbeat * _ORPHAN_BEATS
        self._purging = False
        self._purge_thread: threading.Thread | None = None
        self._db.heartbeat(self.owner, now=self._clock(), stale_after=self._stale_after)
        self._reap()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, name=f"batch-heartbeat-{self.owner[:8]}", daemon=True
        )
        self._beat_thread.start()

    @property
    def config(self) -> Config:
        """The runner's settings."""
        return self._config

    @property
    def db(self) -> dcache.DB:
        """The store the runner writes to."""
        return self._db

    @property
    def fetch(self) -> Fetch:
        """The ``fetch`` callable the runner drains targets through."""
        return self._fetch

    # -- submit -------------------------------------------------------------------------

    def submit(
        self,
        caller: str,
        caller_class: str,
        targets: Sequence[Any],
        *,
        idempotency_key: str | None = None,
    ) -> tuple[str, bool]:
        """Submit a job and start draining it; return ``(job_id, reused)``.

        Idempotent: the same caller submitting the same targets (by canonical form)
        while an earlier job's lease holds gets that job back with ``reused=True``, in
        any status, and no caps are checked. Otherwise the caps apply and the new job is
        ``running`` when this returns.

        With ``idempotency_key`` (a client-chosen key, as HTTP's ``Idempotency-Key``
        header), the key instead of the content decides: the same caller and key return
        the same job, and the same key with different targets is refused.

        Raises:
            InvalidTargetsError: the targets, caller, caller class or key are malformed.
            IdempotencyKeyMismatchError: the key was used for different targets.
            TooManyTargetsError: more than ``Config.targets_per_job`` targets.
            CallerBusyError: the caller has ``Config.jobs_per_caller`` live jobs.
            BusyError: ``Config.jobs_total`` jobs are live in all.
            RunnerClosedError: :meth:`close` was called.
            dcache.StoreError: the database failed (``StoreUnavailableError``: retry).
        """
        if self._closed:
            raise RunnerClosedError("the runner is closed and takes no more submissions")
        for value, what in ((caller, "caller"), (caller_class, "caller_class")):
            try:
                check_text(value, what, limit=MAX_CALLER_LENGTH)
            except ValueError as exc:
                raise InvalidTargetsError(str(exc), field=what) from None
        items = normalize_targets(targets)
        cfg = self._config
        if idempotency_key is None:
            key = idem_key(caller, items)
        else:
            try:
                check_text(idempotency_key, "idempotency key", limit=MAX_KEY_LENGTH)
            except ValueError as exc:
                raise InvalidTargetsError(str(exc), field="idempotency_key") from None
            key = client_idem_key(caller, idempotency_key)
        now = self._clock()
        if len(items) > cfg.targets_per_job:
            # Idempotency comes first even here: an identical job that exists is returned.
            found = self._db.batch_job_by_idem(caller, key, now=now)
            if found is not None:
                self._check_same_payload(found.id, items, idempotency_key)
                return found.id, True
            raise TooManyTargetsError(len(items), cfg.targets_per_job)
        job_id = new_job_id()
        outcome = self._db.submit(
            job_id=job_id,
            caller=caller,
            caller_class=caller_class,
            idem_key=key,
            targets=[
                NewTarget(
                    t.url, json.dumps(t.options.to_json(), sort_keys=True, ensure_ascii=False)
                )
                for t in items
            ],
            ttl=cfg.ttl,
            jobs_per_caller=cfg.jobs_per_caller,
            jobs_total=cfg.jobs_total,
            owner=self.owner,
            now=now,
        )
        self._maybe_purge()
        if outcome.kind == "reused":
            assert outcome.job is not None
            self._check_same_payload(outcome.job.id, items, idempotency_key)
            return outcome.job.id, True
        if outcome.kind == "caller_busy":
            raise CallerBusyError(caller, outcome.live, cfg.jobs_per_caller)
        if outcome.kind == "busy":
            raise BusyError(outcome.live, cfg.jobs_total)
        self._start(job_id, items)
        self._log.info(
            "job %s submitted by %s: %d target(s)",
            job_id,
            caller,
            len(items),
            extra={"job_id": job_id},
        )
        return job_id, False

    def _check_same_payload(
        self, job_id: str, items: list[Target], idempotency_key: str | None
    ) -> None:
        """A client key reused for other targets is an error, not a silent reuse."""
        if idempotency_key is None:
            return  # the content decided, so the payload is the same by construction
        found = self._db.get_job_with_targets(job_id, now=self._clock())
        if found is None:
            return
        stored = [Target(t.url, Options(**json.loads(t.options))) for t in found[1]]
        if canonical(stored) != canonical(items):
            raise IdempotencyKeyMismatchError(idempotency_key)

    def _start(self, job_id: str, items: list[Target]) -> None:
        drain = _Drain(job_id, items)
        drain.thread = threading.Thread(
            target=self._drain, args=(drain,), name=f"batch-job-{job_id}", daemon=True
        )
        with self._lock:
            closed = self._closed
            if not closed:
                self._drains[job_id] = drain
        if closed:
            # close() raced this submit: the job exists but will not be drained here.
            self._db.fail_job(job_id, "shutdown", now=self._clock())
            raise RunnerClosedError("the runner was closed while the job was being submitted")
        drain.thread.start()

    # -- the drain ----------------------------------------------------------------------

    def _drain(self, drain: _Drain) -> None:
        job_id = drain.job_id
        extra = {"job_id": job_id}
        stopped_early = False
        try:
            with self._db.writer() as writer:
                for idx, target in enumerate(drain.targets):
                    if drain.stop.is_set():
                        stopped_early = True
                        break
                    fields = self._call_fetch(job_id, idx, target)
                    outcome = self._store(writer, job_id, idx, fields)
                    if outcome is None:  # the store gave up; the job is left to be failed
                        break
                    if not outcome.running:
                        if outcome.status and not outcome.finished:
                            stopped_early = True
                        break
            if stopped_early:
                self._finish_stopped(drain)
        except BaseException:
            # Only a bug of ours gets here; the job must not stay live with no drain.
            self._log.critical("drain of job %s crashed", job_id, exc_info=True, extra=extra)
            self._abandon(job_id)
        finally:
            with self._lock:
                self._drains.pop(job_id, None)
            drain.done.set()

    def _finish_stopped(self, drain: _Drain) -> None:
        now = self._clock()
        try:
            if drain.shutdown:
                self._db.fail_job(drain.job_id, "shutdown", now=now)
            self._db.mark_finished(drain.job_id, now=now)
        except StoreError:
            self._log.error(
                "could not record the end of job %s",
                drain.job_id,
                exc_info=True,
                extra={"job_id": drain.job_id},
            )

    def _call_fetch(self, job_id: str, idx: int, target: Target) -> dict[str, Any]:
        """Run ``fetch`` once and turn whatever happens into the fields to store."""
        try:
            res = self._fetch(target)
        except FetchError as exc:
            return {
                "status": "failed",
                "error": _storable(exc.message),
                "hint": _storable(exc.hint),
            }
        except BaseException as exc:  # SystemExit included: a fetch never kills the drain
            self._log.critical(
                "fetch crashed on job %s target %d (%s)",
                job_id,
                idx,
                target.url,
                exc_info=True,
                extra={"job_id": job_id},
            )
            return {"status": "failed", "error": _storable(_describe(exc))}
        if not isinstance(res, Result):
            return {
                "status": "failed",
                "error": f"TypeError: fetch returned {type(res).__name__}, not batch.Result",
            }
        if not isinstance(res.content, str) or not isinstance(res.meta, dict):
            return {
                "status": "failed",
                "error": "TypeError: Result.content must be str and Result.meta a dict",
            }
        try:
            payload = json.dumps(res.to_json(), ensure_ascii=False, allow_nan=False)
            size = len(payload.encode("utf-8"))
        except (TypeError, ValueError, RecursionError) as exc:
            return {
                "status": "failed",
                "error": _storable(f"{_describe(exc)} (result not storable)"),
            }
        if size > self._config.max_result_bytes:
            return {
                "status": "failed",
                "error": f"ResultTooLarge: result is {size} bytes, at most "
                f"{self._config.max_result_bytes} allowed",
            }
        return {"status": "done", "result": payload}

    def _store(
        self, writer: dcache.Writer, job_id: str, idx: int, fields: dict[str, Any]
    ) -> WriteOutcome | None:
        """Write one target, retrying through outages; the fetch is never repeated."""
        extra = {"job_id": job_id}
        budget = self._config.write_retry.total_seconds()
        ttl = self._config.ttl
        try:
            try:
                # The common case pays for no retry machinery.
                return writer.write_target(job_id, idx, ttl=ttl, now=self._clock(), **fields)
            except StoreUnavailableError:
                self._log.warning(
                    "storing job %s target %d failed; retrying for up to %.0f s",
                    job_id,
                    idx,
                    budget,
                    exc_info=True,
                    extra=extra,
                )
            for attempt in stamina.retry_context(
                on=StoreUnavailableError,
                attempts=None,
                timeout=budget,
                wait_initial=0.05,
                wait_max=2.0,
            ):
                with attempt:
                    return writer.write_target(job_id, idx, ttl=ttl, now=self._clock(), **fields)
        except StoreUnavailableError:
            self._log.critical(
                "gave up storing job %s target %d after %.0f s of outage",
                job_id,
                idx,
                budget,
                exc_info=True,
                extra=extra,
            )
        except StoreError as exc:
            if fields["status"] == "done":
                # The database refused this result: store the target as failed instead.
                self._log.error(
                    "job %s target %d: result refused by the store",
                    job_id,
                    idx,
                    exc_info=True,
                    extra=extra,
                )
                return self._store(
                    writer,
                    job_id,
                    idx,
                    {
                        "status": "failed",
                        "error": _storable(f"StoreError: result refused: {exc}", 2000),
                    },
                )
            self._log.critical(
                "could not store job %s target %d", job_id, idx, exc_info=True, extra=extra
            )
        self._abandon(job_id)
        return None

    def _abandon(self, job_id: str) -> None:
        """Remember a job whose drain gave up, so the heartbeat fails it once it can."""
        with self._lock:
            self._abandoned.add(job_id)
        self._retry_abandoned()

    def _retry_abandoned(self) -> None:
        with self._lock:
            pending = list(self._abandoned)
        for job_id in pending:
            try:
                self._db.fail_job(job_id, "store unavailable", now=self._clock())
            except StoreError:
                continue
            with self._lock:
                self._abandoned.discard(job_id)

    # -- reads and control --------------------------------------------------------------

    def status(self, job_id: str) -> tuple[Job, list[TargetStatus]] | None:
        """The job and its targets from one consistent read; ``None`` if unknown or lapsed.

        The target being fetched reads ``running`` (derived, not written).
        """
        if not _plausible_id(job_id):
            return None
        found = self._db.get_job_with_targets(job_id, now=self._clock())
        if found is None:
            return None
        row, rows = found
        in_flight = -1
        if row.status == "running":
            in_flight = next((t.idx for t in rows if t.status == "pending"), -1)
        return _job(row), [_target_status(t, in_flight=t.idx == in_flight) for t in rows]

    def job(self, job_id: str) -> Job | None:
        """The job without its targets; ``None`` if unknown or lapsed."""
        if not _plausible_id(job_id):
            return None
        row = self._db.get_job(job_id, now=self._clock())
        return _job(row) if row is not None else None

    def jobs(
        self, *, caller: str | None = None, live_only: bool = False, limit: int = 100
    ) -> list[Job]:
        """Visible jobs, newest first; optionally one caller's, optionally only live ones.

        Raises:
            ValueError: ``limit`` is not an ``int`` of 0 or more.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an int of 0 or more, not {limit!r}")
        if caller is not None:
            try:
                check_text(caller, "caller", limit=MAX_CALLER_LENGTH)
            except ValueError:
                return []  # no job can belong to a caller that submit would refuse
        rows = self._db.list_jobs(
            caller=caller, live_only=live_only, limit=limit, now=self._clock()
        )
        return [_job(r) for r in rows]

    def cancel(self, job_id: str) -> bool:
        """Cancel a live job; False for an unknown id or a job already terminal.

        Works for jobs drained by any process sharing the database. The drain stores the
        target in flight and stops before the next.
        """
        if not _plausible_id(job_id):
            return False
        if not self._db.cancel(job_id, now=self._clock()):
            return False
        with self._lock:
            drain = self._drains.get(job_id)
        if drain is not None:
            drain.stop.set()
        self._log.info("job %s cancelled", job_id, extra={"job_id": job_id})
        return True

    def wait(self, job_id: str, timeout: float | None = None) -> Job | None:
        """Block until the job has finished: terminal, its drain stopped.

        Returns the job (``finished_at`` set), or ``None`` for an unknown or lapsed id.
        A job drained here is awaited on its thread's end; one drained by another
        process is polled with backoff.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not _plausible_id(job_id):
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            drain = self._drains.get(job_id)
        if drain is not None:
            if not drain.done.wait(timeout):
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            _join(drain.thread, deadline)
        delay = 0.01
        pause = threading.Event()  # never set: an interruptible, Event-based sleep
        while True:
            job = self.job(job_id)
            if job is None or drain is not None or job.finished_at is not None:
                # A drain of ours has ended (even one that could not record it): done.
                return job
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            pause.wait(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 1.5, 0.5)

    # -- owner heartbeat, reaping, purging ----------------------------------------------

    def _reap(self) -> int:
        n = self._db.reap_orphans("restart", self._stale_after, now=self._clock())
        if n:
            self._log.warning("marked %d orphaned job(s) failed: their runner stopped", n)
        return n

    def _beat_loop(self) -> None:
        period = self._config.heartbeat.total_seconds()
        guard = self._stale_after.total_seconds()
        healthy_since = time.monotonic()
        while not self._stopping.wait(period):
            try:
                self._db.heartbeat(self.owner, now=self._clock(), stale_after=self._stale_after)
                # After an outage every peer's beat looks stale; reap only once our own
                # beats have gone through for a whole staleness window again.
                if time.monotonic() - healthy_since >= guard:
                    self._reap()
                self._retry_abandoned()
            except StoreError:
                healthy_since = float("inf")
                self._log.warning("heartbeat failed; retrying next period", exc_info=True)
            except BaseException:
                self._log.critical("heartbeat crashed; retrying next period", exc_info=True)
            else:
                if healthy_since == float("inf"):
                    healthy_since = time.monotonic()

    def _maybe_purge(self) -> None:
        """Purge lapsed jobs now and then (at most once per ``purge_interval``)."""
        mono = time.monotonic()
        with self._lock:
            if self._purging or mono < self._next_purge:
                return
            self._purging = True
            self._next_purge = mono + self._config.purge_interval.total_seconds()
        thread = threading.Thread(target=self._purge, name="batch-purge", daemon=True)
        self._purge_thread = thread
        thread.start()

    def _purge(self) -> None:
        try:
            n = self._db.purge_expired(now=self._clock())
            if n:
                self._log.info("purged %d lapsed job(s)", n)
        except StoreError:
            self._log.warning("purge failed; will retry later", exc_info=True)
        finally:
            with self._lock:
                self._purging = False

    # -- shutdown -----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop taking submissions and stop the runner's threads.

        Live jobs may finish within ``timeout`` seconds (``None``: wait for all). Each
        one still live then stops after its in-flight target is stored (waiting up to
        ``timeout`` again) and is marked failed with error ``"shutdown"``. Idempotent.
        """
        with self._lock:
            self._closed = True
            drains = list(self._drains.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for d in drains:
            d.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = [d for d in drains if not d.done.is_set()]
        for d in left:
            d.shutdown = True
            d.stop.set()
        grace = None if timeout is None else time.monotonic() + max(timeout, 1.0)
        for d in left:
            if not d.done.wait(None if grace is None else max(0.0, grace - time.monotonic())):
                self._log.error(
                    "job %s did not stop in time; marking it failed",
                    d.job_id,
                    extra={"job_id": d.job_id},
                )
                try:
                    self._db.fail_job(d.job_id, "shutdown", now=self._clock())
                except StoreError:
                    self._log.error("could not mark job %s failed", d.job_id, exc_info=True)
        for d in drains:
            if d.done.is_set():
                _join(d.thread, None)
        self._stopping.set()
        _join(self._beat_thread, time.monotonic() + 5)
        _join(self._purge_thread, time.monotonic() + 5)
        self._retry_abandoned()
        try:
            if not any(d.thread is not None and d.thread.is_alive() for d in left):
                self._db.remove_owner(self.owner)
        except StoreError:
            self._log.warning("could not remove owner row %s", self.owner, exc_info=True)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            n = len(self._drains)
        return f"<batch.Runner owner={self.owner[:8]} live={n} closed={self._closed}>"


def _join(thread: threading.Thread | None, deadline: float | None) -> None:
    """Join a thread (not the caller's own) by a monotonic deadline."""
    if thread is None or thread is threading.current_thread() or thread.ident is None:
        return
    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _describe(exc: BaseException) -> str:
    """``"TypeName: message"``, even for an exception whose ``str()`` itself fails."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except BaseException:
        text = "<unprintable>"
    return f"{name}: {text}" if text else name


def _storable(text: object, limit: int = MAX_MESSAGE_LENGTH) -> str:
    """Make untrusted text (an exception's message, a hint) safe for every backend.

    NUL characters (PostgreSQL text cannot hold them) and lone surrogates (not UTF-8)
    are escaped, and the length is capped so it fits any text column.
    """
    try:
        s = text if isinstance(text, str) else str(text)
    except BaseException:
        s = "<unprintable>"
    s = s.replace("\x00", "\\x00")
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(s) > limit:
        s = s[: limit - 14] + " [truncated]"
    return s
