"""The runner: submissions, one daemon drain thread per job, heartbeats and reaping."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import logging
import math
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs

import dcache
from dcache import (
    LIVE,
    JobRow,
    NewTarget,
    PoolExhaustedError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
    TargetRow,
    WriteOutcome,
)
from dcache._queries import check_limit
from dcache._rows import as_shown, in_flight
from dcache._schema import CANCELLED, DONE, FAILED, RUNNING
from dcache._shared import utf8_size

from ._errors import (
    BusyError,
    CallerBusyError,
    FetchError,
    IdempotencyKeyMismatchError,
    InvalidTargetsError,
    RunnerClosedError,
    SubmitError,
    TooManyTargetsError,
)
from ._values import (
    MAX_CALLER_LENGTH,
    MAX_KEY_LENGTH,
    MAX_META_DEPTH,
    Config,
    Job,
    Result,
    Target,
    TargetStatus,
    canonical,
    check_text,
    client_idem_key,
    decode_options,
    encode_options,
    idem_key_of,
    normalize_targets,
    payload_key,
)
from ._webhooks import Sender, Webhooks
from .events import (
    Event,
    EventBus,
    JobCancelled,
    JobFinished,
    JobsReaped,
    JobSubmitted,
    StoreFailed,
    SubmissionRefused,
    Subscriber,
    TargetStored,
    log_events,
    only,
)

__all__ = ["Fetch", "RawStatus", "Runner", "new_job_id"]


Fetch = Callable[[Target], Result]
_R = TypeVar("_R", bound="Runner")
_T = TypeVar("_T")

_ORPHAN_BEATS = 3  # an owner is dead after this many missed heartbeats
_CANCEL_ANNOUNCED = 5.0  # how long a cancelled drain's end waits for cancels' events
_POLL_MAX = 0.25  # the longest pause between polls of a job drained elsewhere (docs say so)
_PURGE_WORK = 1.0  # seconds one purge goes on before it leaves the rest to the next beat
_FINISH_PATIENCE = 24 * 3600.0  # seconds on_finish waits for a job's end to be read
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
    caller_class: str = ""
    started: float = attrs.Factory(time.monotonic)
    announced: bool = False  # its JobFinished event went out
    stop: threading.Event = attrs.Factory(threading.Event)  # cancel or shutdown asked
    done: threading.Event = attrs.Factory(threading.Event)  # the drain has ended
    shutdown: bool = False
    thread: threading.Thread | None = None
    # The job as the drain's own last write ended it (WriteOutcome.job): what wait()
    # answers without reading it again.
    final: JobRow | None = None


@attrs.define(eq=False)
class _Unresolved:
    """A submission whose job may exist without a drain (its submit raised, or its
    drain thread could not start): the maintenance thread finds out and settles it."""

    items: list[Target]
    since: float  # monotonic
    misses: int = 0  # lookups that found no job
    # True while the submitting thread is still at work on it (waiting for the store's
    # reply, starting the drain): until then it is the submit's to settle, not ours.
    submitting: bool = True


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


def _target_status(row: TargetRow, job: JobRow) -> TargetStatus:
    """A stored target as the runner shows it: ``running`` while ``job``'s drain has it."""
    result = None
    error = row.error
    if row.result is not None:
        # Whatever is stored (a result written by an older version, nested past what
        # json can decode), reading it must not fail the whole status read.
        try:
            result = result_of_json(row.result)
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            error = error or f"stored result unreadable ({type(exc).__name__})"
    options = decode_options(row.options)
    status = row.status
    if in_flight(job.status, job.targets_done, row.idx, status):
        status = RUNNING
    return TargetStatus(
        idx=row.idx,
        url=row.url,
        status=status,
        result=result,
        error=error,
        hint=row.hint,
        options=options,
        result_bytes=row.result_bytes,
    )


class RawStatus:
    """A job and its targets as stored (see :meth:`Runner.status_raw`); iterate once."""

    def __init__(self, stream: dcache.JobStream, results: bool = True) -> None:
        self._stream = stream
        self.job: Job = _job(stream.job)
        self.notify_url = stream.job.notify_url  # where the job's end is announced, if anywhere
        # Its end notification, read with the job (see Runner.status_raw), if it has one.
        self.notification: dcache.NotificationRow | None = stream.notification
        self.results = results  # False: every result left out, its size in result_bytes

    def __iter__(self) -> Iterator[dcache.TargetRow]:
        status, done = self.job.status, self.job.targets_done
        for row in self._stream:
            yield as_shown(status, done, row)

    def close(self) -> None:
        """Give the read's connection back (idempotent)."""
        self._stream.close()

    def __enter__(self) -> RawStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Runner:
    """Runs persistent, serial batch jobs: one daemon thread drains each job's targets.

    Args:
        db: the store (:class:`dcache.DB`); the runner does not close it.
        fetch: ``fetch(target) -> Result``, called once per target, one at a time per
            job. It may raise :class:`FetchError` to fail a target with a hint.
        config: limits and timings; ``None`` means ``Config()``.
        log: where to log; ``None`` means ``logging.getLogger("batch")``.
        clock: the wall-clock time source (aware UTC); tests inject one.
        monotonic: the monotonic time source (seconds) that owner liveness is judged
            by; tests inject one.
        observers: subscribers to the runner's event stream (see :meth:`subscribe`).
        webhooks: how to sign and send job-end webhooks (:class:`batch.Webhooks`): jobs
            submitted with ``notify=URL`` are announced when they end, from the store's
            outbox, by this runner's sender thread or any other live runner's.
        on_finish: ``on_finish(job)`` once per job end this process observes (a drain
            here ending, whatever ended it), after the commit, on the event dispatcher
            thread, with the job as the store has it (ended); if the store cannot be
            read then, it is asked again every heartbeat. Best-effort (a crash loses
            it): the webhook is the durable path.

    Building a runner registers it as a live *owner* with a heartbeat. Its maintenance
    thread watches every other owner's beat counter and fails, with error
    ``"restart"``, the live jobs of an owner whose counter this runner saw unchanged for
    that owner's staleness window on its own monotonic clock (a dead process): a step
    of any wall clock never makes a live peer look dead.
    """

    def __init__(
        self,
        db: dcache.DB,
        fetch: Fetch,
        config: Config | None = None,
        log: logging.Logger | None = None,
        *,
        clock: Callable[[], dt.datetime] | None = None,
        monotonic: Callable[[], float] | None = None,
        observers: Sequence[Subscriber] = (),
        webhooks: Webhooks | None = None,
        on_finish: Callable[[Job], object] | None = None,
    ) -> None:
        self._db = db
        self._webhooks = webhooks
        self._fetch = fetch
        self._config = config if config is not None else Config()
        self._log = log if log is not None else logging.getLogger("batch")
        self._clock = clock if clock is not None else dcache.utcnow
        self._mono = monotonic if monotonic is not None else time.monotonic
        self.owner: str = secrets.token_hex(16)
        self._events = EventBus(
            [log_events(self._log), *observers],
            self._log,
            name=f"batch-events-{self.owner[:8]}",
        )
        # Guards the registries of drains, abandoned and unresolved jobs and _closed only;
        # never held across I/O.
        self._lock = threading.Lock()
        self._drains: dict[str, _Drain] = {}
        self._ending: dict[str, _Drain] = {}  # drains whose thread may still be exiting
        self._abandoned: set[str] = set()
        self._cancels: dict[str, list[threading.Event]] = {}  # see _cancelling
        self._finish_pending: dict[str, float] = {}  # job id -> since (monotonic): on_finish
        self._finish_call: Callable[[str], None] | None = None
        self._unresolved: dict[str, _Unresolved] = {}
        self._closed = False
        self._stopping = threading.Event()
        self._next_purge = self._mono() + self._config.purge_interval.total_seconds()
        self._stale_after = self._config.heartbeat * _ORPHAN_BEATS
        # Owner liveness as this runner observed it: owner -> (token, monotonic when the
        # token was first seen). Used by the maintenance thread only.
        self._seen: dict[str, tuple[Any, float]] = {}
        self._beat_failed = False
        self._db.heartbeat(self.owner, now=self._clock(), stale_after=self._stale_after)
        self.check_owners()
        self._beat_thread = threading.Thread(
            target=self._beat_loop, name=f"batch-heartbeat-{self.owner[:8]}", daemon=True
        )
        self._maintain_thread = threading.Thread(
            target=self._maintain_loop, name=f"batch-maintain-{self.owner[:8]}", daemon=True
        )
        self._sender = Sender(self, webhooks) if webhooks is not None else None
        if self._sender is not None:
            self._events.subscribe(only(JobFinished, JobCancelled, fn=self._wake_sender))
        if on_finish is not None:
            self._events.subscribe(only(JobFinished, fn=self._finished_hook(on_finish)))
        self._events.start()
        self._beat_thread.start()
        self._maintain_thread.start()
        if self._sender is not None:
            self._sender.start()

    def _wake_sender(self, event: Event) -> None:
        if isinstance(event, (JobFinished, JobCancelled)) and self._sender is not None:
            self._sender.wake.set()

    def _finished_hook(self, on_finish: Callable[[Job], object]) -> Subscriber:
        """The subscriber that calls ``on_finish`` with the job as the store has it.

        The read may fail (the store blinked after the job's last commit), or find the job
        still live (its drain gave up storing; maintenance ends it once the store
        answers): then the job waits in ``_finish_pending`` and maintenance asks again,
        each time on the event thread, until the job has ended (or a day has passed)."""

        def call(job_id: str, retry: bool = False) -> None:
            if retry:
                with self._lock:
                    if job_id not in self._finish_pending:
                        return  # an earlier retry, queued before this one, handed it over
            try:
                job = self.job(job_id)
            except StoreError:
                job = None
                ended = False
            else:
                ended = job is None or job.status not in LIVE
            if not ended:
                with self._lock:
                    self._finish_pending.setdefault(job_id, time.monotonic())
                return
            with self._lock:
                self._finish_pending.pop(job_id, None)
            if job is not None:  # None: lapsed (purged) already; nothing to hand over
                on_finish(job)

        self._finish_call = functools.partial(call, retry=True)

        def subscriber(event: Event) -> None:
            if isinstance(event, JobFinished):
                call(event.job_id)

        return subscriber

    def _retry_finish_hooks(self) -> None:
        """Ask again, on the event thread, for the jobs ``on_finish`` still waits for."""
        call = self._finish_call
        now = time.monotonic()
        with self._lock:
            for job_id, since in list(self._finish_pending.items()):
                if now - since > _FINISH_PATIENCE:
                    del self._finish_pending[job_id]
                    self._log.error(
                        "on_finish of job %s given up: its end could not be read",
                        job_id,
                        extra={"job_id": job_id},
                    )
            pending = list(self._finish_pending)
        if call is not None:
            for job_id in pending:
                self._events.call_soon(functools.partial(call, job_id))

    @property
    def config(self) -> Config:
        """The runner's settings."""
        return self._config

    @property
    def db(self) -> dcache.DB:
        """The store the runner writes to."""
        return self._db

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call ``fn(event)`` for every event from now on; return an unsubscribe function.

        Events (``batch.events``) arrive in order on the runner's dispatcher thread, never
        on a drain or request thread: a subscriber that raises is logged and skipped, one
        that is slow delays only the events after it.
        """
        return self._events.subscribe(fn)

    @property
    def events_dropped(self) -> int:
        """Events dropped because subscribers fell more than 65,536 events behind."""
        return self._events.dropped

    def _emit(self, event: Event) -> None:
        self._events.emit(event)

    def _store_failed(self, operation: str, exc: BaseException) -> None:
        self._emit(
            StoreFailed(
                self._clock(),
                operation,
                isinstance(exc, StoreUnavailableError),
                _storable(_describe(exc), 500),
            )
        )

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
        notify: str | None = None,
    ) -> tuple[str, bool]:
        """Submit a job and start draining it; return ``(job_id, reused)``.

        Idempotent: the same caller submitting the same targets (by canonical form)
        while an earlier job's lease holds gets that job back with ``reused=True``, in
        any status, and no caps are checked. Otherwise the caps apply and the new job is
        ``running`` when this returns.

        With ``idempotency_key`` (a client-chosen key, as HTTP's ``Idempotency-Key``
        header), the key instead of the content decides: the same caller and key return
        the same job, and the same key with different targets is refused.

        With ``notify`` (a URL; the runner needs ``webhooks=``), the job's end is
        announced there by a signed webhook (see :class:`batch.Webhooks`); it is not part
        of the submission's identity (a reused job keeps its own).

        Raises:
            InvalidTargetsError: the targets, caller, caller class or key are malformed.
            IdempotencyKeyMismatchError: the key was used for different targets.
            TooManyTargetsError: more than ``Config.targets_per_job`` targets.
            CallerBusyError: the caller has ``Config.jobs_per_caller`` live jobs.
            BusyError: ``Config.jobs_total`` jobs are live in all.
            RunnerClosedError: :meth:`close` was called.
            dcache.StoreError: the database failed (``StoreUnavailableError``: retry).
        """
        job, reused = self.submit_job(
            caller, caller_class, targets, idempotency_key=idempotency_key, notify=notify
        )
        return job.id, reused

    def submit_job(
        self,
        caller: str,
        caller_class: str,
        targets: Sequence[Any],
        *,
        idempotency_key: str | None = None,
        notify: str | None = None,
    ) -> tuple[Job, bool]:
        """As :meth:`submit`, returning the job itself as the submit transaction saw it.

        For an HTTP layer that answers with the job: no second read.
        """
        try:
            row, reused = self._submit(caller, caller_class, targets, idempotency_key, notify)
        except (SubmitError, StoreError, RunnerClosedError) as exc:
            self._emit(
                SubmissionRefused(
                    self._clock(),
                    caller if isinstance(caller, str) else "",
                    caller_class if isinstance(caller_class, str) else "",
                    _refusal(exc),
                    _storable(str(exc), 500),
                )
            )
            if isinstance(exc, StoreError):
                self._store_failed("submit", exc)
            raise
        if reused:  # a new job's event went out before its drain started (see _submit)
            event = JobSubmitted(
                self._clock(), row.id, caller, caller_class, row.targets_total, True
            )
            self._emit(event)
        return _job(row), reused

    def _submit(
        self,
        caller: str,
        caller_class: str,
        targets: Sequence[Any],
        idempotency_key: str | None,
        notify: str | None = None,
    ) -> tuple[JobRow, bool]:
        if self._closed:
            raise RunnerClosedError("the runner is closed and takes no more submissions")
        if notify is not None:
            if self._webhooks is None:
                raise InvalidTargetsError(
                    "notifications are not enabled (Runner(webhooks=...))", field="notify"
                )
            notify = self._webhooks.check_url(notify)
        for value, what in ((caller, "caller"), (caller_class, "caller_class")):
            try:
                check_text(value, what, limit=MAX_CALLER_LENGTH)
            except ValueError as exc:
                raise InvalidTargetsError(str(exc), field=what) from None
        items = normalize_targets(targets)
        cfg = self._config
        canon = canonical(items)  # encoded once: the key, and the payload's own hash
        payload = payload_key(canon)
        if idempotency_key is None:
            key = idem_key_of(caller, canon)
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
                self._check_same_payload(found, canon, payload, idempotency_key)
                return found, True
            raise TooManyTargetsError(len(items), cfg.targets_per_job)
        job_id = new_job_id()
        # Until its drain has started, the job may exist with none: if the submit raises
        # after its COMMIT reached the server (the reply lost, an interrupt), the
        # maintenance thread looks the id up and drains or ends the job.
        entry = _Unresolved(items, self._mono())
        with self._lock:
            self._unresolved[job_id] = entry
        try:
            return self._submit_new(
                job_id,
                entry,
                caller=caller,
                caller_class=caller_class,
                key=key,
                canon=canon,
                payload=payload,
                idempotency_key=idempotency_key,
                now=now,
                notify=notify,
            )
        finally:
            entry.submitting = False  # if it is still unresolved, maintenance settles it

    def _submit_new(
        self,
        job_id: str,
        entry: _Unresolved,
        *,
        caller: str,
        caller_class: str,
        key: str,
        canon: str,
        payload: str,
        idempotency_key: str | None,
        now: dt.datetime,
        notify: str | None,
    ) -> tuple[JobRow, bool]:
        """Submit a new job (``_submit``'s second half); ``entry`` marks it unresolved."""
        cfg = self._config
        items = entry.items
        outcome = self._db.submit(
            job_id=job_id,
            caller=caller,
            caller_class=caller_class,
            idem_key=key,
            targets=[NewTarget(t.url, encode_options(t.options)) for t in items],
            ttl=cfg.ttl,
            jobs_per_caller=cfg.jobs_per_caller,
            jobs_total=cfg.jobs_total,
            owner=self.owner,
            now=now,
            payload_key=payload,
            notify_url=notify,
        )
        if outcome.kind != "created":
            with self._lock:
                self._unresolved.pop(job_id, None)
        if outcome.kind == "reused":
            assert outcome.job is not None
            self._adopt(outcome.job)
            self._check_same_payload(outcome.job, canon, payload, idempotency_key)
            return outcome.job, True
        if outcome.kind == "caller_busy":
            raise CallerBusyError(caller, outcome.live, cfg.jobs_per_caller)
        if outcome.kind == "busy":
            raise BusyError(outcome.live, cfg.jobs_total)
        announce = JobSubmitted(now, job_id, caller, caller_class, len(items), False)
        self._start(job_id, items, caller_class, announce)
        assert outcome.job is not None
        return outcome.job, False

    def _check_same_payload(
        self, job: JobRow, canon: str, payload: str, idempotency_key: str | None
    ) -> None:
        """A client key reused for other targets is an error, not a silent reuse."""
        if idempotency_key is None:
            return  # the content decided, so the payload is the same by construction
        if job.payload_key is not None:
            same = job.payload_key == payload  # one comparison, no targets read
        else:  # a row from before payload keys: compare the targets themselves
            found = self._db.get_job_with_targets(job.id, now=self._clock(), results=False)
            if found is None:
                return
            stored = [Target(t.url, decode_options(t.options)) for t in found[1]]
            same = canonical(stored) == canon
        if not same:
            raise IdempotencyKeyMismatchError(idempotency_key)

    def _adopt(self, row: JobRow) -> None:
        """Drain a reused job that an earlier, failed submit of ours left undrained."""
        if row.owner != self.owner or row.status not in LIVE:
            return
        with self._lock:
            pending = self._unresolved.get(row.id)
        if pending is not None:
            self._start(row.id, pending.items, row.caller_class, _announce(row))

    def _start(
        self,
        job_id: str,
        items: list[Target],
        caller_class: str,
        announce: JobSubmitted | None = None,
    ) -> None:
        """Start the job's drain thread; settle the job if it cannot start.

        Raises:
            RunnerClosedError: :meth:`close` came first; the job is failed with
                ``"shutdown"`` and its idempotency key released, so a retry of the same
                submission makes a fresh job instead of getting this never-run one.
        """
        drain = _Drain(job_id, items, caller_class)
        drain.thread = threading.Thread(
            target=self._drain, args=(drain,), name=f"batch-job-{job_id}", daemon=True
        )
        with self._lock:
            if job_id in self._drains:
                return  # another thread started it first
            settled = job_id not in self._unresolved  # close() or maintenance ended it
            closed = self._closed
            if not (closed or settled):
                # Resolved as it is registered: the drain may end (and leave _drains)
                # before _launch returns, and a reused submit adopting the job then must
                # find it settled, not start it again.
                self._drains[job_id] = drain
                entry = self._unresolved.pop(job_id)
        if closed:
            # close() raced this submit: the job exists but will not be drained here.
            if not settled:
                self._end_unstarted(job_id, "shutdown")
            raise RunnerClosedError("the runner was closed while the job was being submitted")
        if settled:
            return
        if announce is not None:  # before the drain starts: no TargetStored comes first
            self._emit(announce)
        try:
            self._launch(drain)
        except BaseException:
            # "can't start new thread": the maintenance thread tries again, then ends it.
            with self._lock:
                self._drains.pop(job_id, None)
                closed = self._closed
                if not closed:
                    self._unresolved[job_id] = entry
            if closed:  # no maintenance thread will try again: end it here
                self._end_unstarted(job_id, "shutdown")
            raise

    def _launch(self, drain: _Drain) -> None:
        """Start the drain's thread (``batch.testing.ImmediateRunner`` drains inline)."""
        assert drain.thread is not None
        drain.thread.start()

    def _end_unstarted(self, job_id: str, reason: str) -> bool:
        """Fail a job no drain ever ran and release its key; False if the store failed."""
        try:
            self._db.fail_job(job_id, reason, now=self._clock(), release_key=True)
        except StoreError:
            self._log.error(
                "could not end undrained job %s", job_id, exc_info=True, extra={"job_id": job_id}
            )
            return False
        with self._lock:
            self._unresolved.pop(job_id, None)
        return True

    def _resolve_unresolved(self) -> None:
        """Settle submissions that may have left a job without a drain (see submit)."""
        with self._lock:
            pending = [
                (k, v)
                for k, v in self._unresolved.items()
                if k not in self._drains and not v.submitting
            ]
        window = self._stale_after.total_seconds()
        for job_id, entry in pending:
            try:
                row = self._db.get_job(job_id, now=self._clock())
            except StoreError:
                continue  # the store is still away: try on the next beat
            if row is None:
                # Never committed, most likely. A COMMIT whose connection died may still
                # complete on the server a moment later, so forget the id only after a
                # few misses spread over a staleness window.
                entry.misses += 1
                if entry.misses >= _ORPHAN_BEATS and self._mono() - entry.since >= window:
                    with self._lock:
                        self._unresolved.pop(job_id, None)
                continue
            if row.owner != self.owner or row.status not in LIVE:
                with self._lock:
                    self._unresolved.pop(job_id, None)
                continue
            if self._closed:
                self._end_unstarted(job_id, "shutdown")
                continue
            self._log.warning(
                "job %s was committed but not drained (its submit failed); draining it now",
                job_id,
                extra={"job_id": job_id},
            )
            try:
                self._start(job_id, entry.items, row.caller_class, _announce(row))
            except RunnerClosedError:
                pass
            except BaseException as exc:
                self._end_unstarted(job_id, _storable(f"drain could not start: {_describe(exc)}"))

    # -- the drain ----------------------------------------------------------------------

    def _drain(self, drain: _Drain) -> None:
        job_id = drain.job_id
        extra = {"job_id": job_id}
        stopped_early = False
        period = self._config.heartbeat.total_seconds()
        try:
            with self._db.writer() as writer:
                fetched = self._mono()
                for idx, target in enumerate(drain.targets):
                    if drain.stop.is_set():
                        stopped_early = True
                        break
                    if self._mono() - fetched > period and not self._still_draining(job_id):
                        # This process stood still (stopped, paused) since its last fetch,
                        # long enough to be taken for dead: its job was ended meanwhile.
                        stopped_early = True
                        break
                    fetch_started = time.monotonic()
                    fields = self._call_fetch(job_id, idx, target)
                    fetched = self._mono()
                    store_started = time.monotonic()
                    last = idx == len(drain.targets) - 1
                    outcome = self._store(writer, job_id, idx, fields, last=last)
                    if outcome is None:  # the store gave up; the job is left to be failed
                        self._abandon(job_id)
                        break
                    if self._events.wants(TargetStored):  # nobody listens: nothing to build
                        self._emit(
                            TargetStored(
                                self._clock(),
                                job_id,
                                idx,
                                drain.caller_class,
                                fields["status"],
                                store_started - fetch_started,
                                time.monotonic() - store_started,
                                (
                                    utf8_size(fields.get("result") or "")
                                    if fields["status"] == DONE
                                    else 0
                                ),
                            )
                        )
                    if not outcome.running:
                        if outcome.status and not outcome.finished:
                            stopped_early = True
                        else:
                            drain.final = outcome.job
                            self._finished(drain, outcome.status)
                        break
            if stopped_early:
                self._finish_stopped(drain)
        except BaseException:
            # Only a bug of ours gets here; the job must not stay live with no drain.
            self._log.critical("drain of job %s crashed", job_id, exc_info=True, extra=extra)
            self._abandon(job_id)
        finally:
            if not drain.announced:
                # Its end could not be recorded (the store gave up, or a crash): announce
                # what the store will say once it answers, so every drain has one end.
                if drain.shutdown:
                    self._finished(drain, FAILED, "shutdown")
                elif drain.stop.is_set():
                    self._finished(drain, CANCELLED)
                else:
                    self._finished(drain, FAILED, "store unavailable")
            with self._lock:
                self._drains.pop(job_id, None)
                # The thread lives a moment longer: wait() joins it from here.
                self._ending = {
                    k: d for k, d in self._ending.items() if d.thread and d.thread.is_alive()
                }
                self._ending[job_id] = drain
            drain.done.set()

    def _still_draining(self, job_id: str) -> bool:
        """Whether the job is still live (not ended by a reaper or a cancel meanwhile); a
        read that fails says yes: the next write's compare-and-set tells for sure."""
        try:
            job = self._db.get_job(job_id, now=self._clock())
        except StoreError:
            return True
        return job is not None and job.status in LIVE

    def _finished(self, drain: _Drain, status: str, error: str = "") -> None:
        """Tell the drain's end, once: close() may tell it for a drain that outlives it."""
        with self._lock:
            if drain.announced:
                return
            drain.announced = True
        if status == CANCELLED:
            with self._lock:
                cancels = list(self._cancels.get(drain.job_id, ()))
            # A cancel of ours under way is announced first: one bound for them all (one
            # that will lose, the job cancelled already, costs no more than that).
            deadline = time.monotonic() + _CANCEL_ANNOUNCED
            for gate in cancels:
                gate.wait(max(0.0, deadline - time.monotonic()))
        self._emit(
            JobFinished(
                self._clock(),
                drain.job_id,
                drain.caller_class,
                status,
                error,
                time.monotonic() - drain.started,
            )
        )

    def _finish_stopped(self, drain: _Drain) -> None:
        now = self._clock()
        try:
            if drain.shutdown and self._db.fail_job(drain.job_id, "shutdown", now=now):
                self._finished(drain, FAILED, "shutdown")
                return
            # False when the job had finished already: a write whose COMMIT landed but
            # whose reply was lost (its retry then found the target stored), a reaper.
            # Either way the job's end is announced as the store has it.
            self._db.mark_finished(drain.job_id, now=now)
            job = self._db.get_job(drain.job_id, now=now)
            if job is not None and job.status not in LIVE:
                self._finished(drain, job.status, job.error)
        except StoreError as exc:
            self._store_failed("mark_finished", exc)
            self._log.error(
                "could not record the end of job %s; retrying from the maintenance thread",
                drain.job_id,
                exc_info=True,
                extra={"job_id": drain.job_id},
            )
            # Its finished_at must still be set, or every wait() on it hangs.
            with self._lock:
                self._abandoned.add(drain.job_id)

    def _call_fetch(self, job_id: str, idx: int, target: Target) -> dict[str, Any]:
        """Run ``fetch`` once and turn whatever happens into the fields to store."""
        timeout = self._config.fetch_timeout
        if timeout is None:
            try:
                res = self._fetch(target)
            except BaseException as exc:
                return self._fetch_failed(job_id, idx, target, exc)
            return self._fields_of(res)
        return self._call_fetch_bounded(job_id, idx, target, timeout.total_seconds())

    def _call_fetch_bounded(
        self, job_id: str, idx: int, target: Target, seconds: float
    ) -> dict[str, Any]:
        """``fetch`` on a thread of its own, given up on after ``seconds``.

        A fetch cannot be interrupted, so a hung one keeps its thread; its result, if it
        ever comes, is logged and dropped, never stored (the target is failed already).
        """
        lock = threading.Lock()
        done = threading.Event()
        box: list[tuple[bool, Any]] = []
        given_up = False

        def run() -> None:
            try:
                outcome: tuple[bool, Any] = (True, self._fetch(target))
            except BaseException as exc:
                outcome = (False, exc)
            with lock:
                if not given_up:
                    box.append(outcome)
                    done.set()
                    return
            self._log.warning(
                "job %s target %d: fetch returned after its %g s timeout; result discarded",
                job_id,
                idx,
                seconds,
                extra={"job_id": job_id},
            )

        thread = threading.Thread(target=run, name=f"batch-fetch-{job_id}-{idx}", daemon=True)
        try:
            thread.start()
        except BaseException as exc:
            return self._fetch_failed(job_id, idx, target, exc)
        done.wait(seconds)
        with lock:
            if not box:
                given_up = True
        if given_up:
            self._log.error(
                "job %s target %d: no result within %g s (%s)",
                job_id,
                idx,
                seconds,
                target.url,
                extra={"job_id": job_id},
            )
            return {"status": FAILED, "error": f"FetchTimeout: no result within {seconds:g} s"}
        ok, value = box[0]
        if not ok:
            return self._fetch_failed(job_id, idx, target, value)
        return self._fields_of(value)

    def _fetch_failed(
        self, job_id: str, idx: int, target: Target, exc: BaseException
    ) -> dict[str, Any]:
        """The fields to store for a fetch that raised (anything, SystemExit included)."""
        if isinstance(exc, FetchError):
            # A subclass may never have run FetchError.__init__ (a dataclass's generated
            # one does not): no message, no hint. Its own text, or its repr, is the error.
            message = getattr(exc, "message", None)
            if message is None:
                try:
                    message = str(exc) or repr(exc)
                except BaseException:
                    message = _describe(exc)
            hint = getattr(exc, "hint", None)
            return {
                "status": FAILED,
                "error": _storable(message),
                "hint": "" if hint is None else _storable(hint),
            }
        self._log.critical(
            "fetch crashed on job %s target %d (%s)",
            job_id,
            idx,
            target.url,
            exc_info=exc,
            extra={"job_id": job_id},
        )
        return {"status": FAILED, "error": _storable(_describe(exc))}

    def _fields_of(self, res: object) -> dict[str, Any]:
        """The fields to store for what a fetch returned."""
        if not isinstance(res, Result):
            return {
                "status": FAILED,
                "error": f"TypeError: fetch returned {type(res).__name__}, not batch.Result",
            }
        if not isinstance(res.content, str) or not isinstance(res.meta, dict):
            return {
                "status": FAILED,
                "error": "TypeError: Result.content must be str and Result.meta a dict",
            }
        # json encodes what it cannot decode again: refuse it here, not on every read
        # (a cyclic meta is reported as such by json.dumps below).
        too_deep = bool(res.meta) and _json_depth(res.meta, MAX_META_DEPTH) > MAX_META_DEPTH
        try:
            payload = result_json(res)
            size = utf8_size(payload)
        except RecursionError:
            too_deep = True
        except (TypeError, ValueError) as exc:
            return {
                "status": FAILED,
                "error": _storable(f"{_describe(exc)} (result not storable)"),
            }
        if too_deep:
            return {
                "status": FAILED,
                "error": f"ResultTooDeep: meta nests more than {MAX_META_DEPTH} levels",
            }
        # The smaller of the configured limit and what this backend holds with any content
        # (MariaDB's default max_allowed_packet holds less than the 8 MiB default).
        limit = min(self._config.max_result_bytes, self._db.max_result_bytes)
        if size > limit:
            return {
                "status": FAILED,
                "error": f"ResultTooLarge: result is {size} bytes, at most {limit} allowed",
            }
        return {"status": DONE, "result": payload}

    def _store(
        self,
        writer: dcache.Writer,
        job_id: str,
        idx: int,
        fields: dict[str, Any],
        *,
        last: bool = False,
    ) -> WriteOutcome | None:
        """Write one target, retrying through outages; the fetch is never repeated.

        The job's ``last`` target asks for the job's row as the write leaves it
        (``WriteOutcome.job``, kept for :meth:`wait`)."""
        extra = {"job_id": job_id}
        budget = self._config.write_retry.total_seconds()
        ttl = self._config.ttl
        outage_since: float | None = None  # monotonic start of the current outage
        delay = 0.05
        pause: threading.Event | None = None  # never set: an Event-based sleep
        try:
            while True:
                try:
                    return writer.write_target(
                        job_id, idx, ttl=ttl, now=self._clock(), job_row=last, **fields
                    )
                except PoolExhaustedError:
                    # Every pooled connection is busy (more live jobs than the pool holds):
                    # not an outage, so no budget runs down; the checkout itself waited.
                    self._log.warning(
                        "job %s target %d: waiting for a free connection",
                        job_id,
                        idx,
                        extra=extra,
                    )
                except StoreUnavailableError as exc:
                    now = time.monotonic()
                    if outage_since is None:
                        self._store_failed("write_target", exc)
                        outage_since = now
                        self._log.warning(
                            "storing job %s target %d failed; retrying for up to %.0f s",
                            job_id,
                            idx,
                            budget,
                            exc_info=True,
                            extra=extra,
                        )
                    left = outage_since + budget - now
                    if left <= 0:
                        raise
                    # Exponential backoff with full jitter, capped at 2 s.
                    pause = pause or threading.Event()
                    pause.wait(min(left, random.uniform(0, delay)))
                    delay = min(delay * 2, 2.0)
        except StoreUnavailableError:
            self._log.critical(
                "gave up storing job %s target %d after %.0f s of outage",
                job_id,
                idx,
                budget,
                exc_info=True,
                extra=extra,
            )
        except StoreClosedError:
            # The app closed the store after this runner's close() gave up waiting: the
            # job already ended ("shutdown"); this result has nowhere to go.
            self._log.warning(
                "job %s target %d: not stored, the store was closed before its drain ended",
                job_id,
                idx,
                extra=extra,
            )
        except StoreError as exc:
            self._store_failed("write_target", exc)
            if fields["status"] == DONE:
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
                        "status": FAILED,
                        "error": _storable(f"StoreError: result refused: {exc}", 2000),
                    },
                    last=last,
                )
            self._log.critical(
                "could not store job %s target %d", job_id, idx, exc_info=True, extra=extra
            )
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
                now = self._clock()
                # A job cancelled before its drain gave up is no longer live: its end
                # must still be recorded, or every wait() on it would hang.
                if not self._db.fail_job(job_id, "store unavailable", now=now):
                    self._db.mark_finished(job_id, now=now)
            except StoreError:
                continue
            with self._lock:
                self._abandoned.discard(job_id)

    # -- reads and control --------------------------------------------------------------

    def status(self, job_id: str, *, results: bool = True) -> tuple[Job, list[TargetStatus]] | None:
        """The job and its targets from one consistent read; ``None`` if unknown or lapsed.

        The target being fetched reads ``running`` (derived, not written). With
        ``results=False`` no result is read: each target's ``result`` is ``None`` and
        ``result_bytes`` its stored size (fetch one with :meth:`result`).
        """
        if not _plausible_id(job_id):
            return None
        found = self._db.get_job_with_targets(job_id, now=self._clock(), results=results)
        if found is None:
            return None
        row, rows = found
        return _job(row), [_target_status(t, row) for t in rows]

    def result(self, job_id: str, idx: int) -> TargetStatus | None:
        """One target with its result; ``None`` if the job or the target is unknown."""
        if not _plausible_id(job_id):
            return None
        found = self._db.get_target(job_id, idx, now=self._clock())
        if found is None:
            return None
        row, target = found
        return _target_status(target, row)

    def lookup(self, job_id: str) -> str:
        """``"found"``, ``"expired"`` (its lease lapsed, purged or not) or ``"unknown"``.

        ``status`` answers ``None`` for both of the last two; this tells them apart
        (HTTP's 410 against 404) for as long as the store keeps the tombstone.
        """
        if not _plausible_id(job_id):
            return "unknown"
        return self._db.lookup(job_id, now=self._clock()).state

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
            ValueError: ``limit`` is not an ``int`` from 0 to ``2**63 - 1``.
        """
        check_limit(limit)  # before the caller: a bad limit is refused whoever asks
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
        with self._cancelling(job_id):
            if not self._db.cancel(job_id, now=self._clock()):
                return False
            self._cancelled(job_id)
        return True

    @contextlib.contextmanager
    def _cancelling(self, job_id: str) -> Iterator[None]:
        """Mark a cancel of ours under way: the drain it stops, which may learn of it
        from its own write the moment it commits, announces its end only after the
        cancel was announced (``JobCancelled`` first; see :meth:`_finished`)."""
        gate = threading.Event()
        with self._lock:
            self._cancels.setdefault(job_id, []).append(gate)
        try:
            yield
        finally:
            with self._lock:
                gates = self._cancels[job_id]
                gates.remove(gate)
                if not gates:
                    del self._cancels[job_id]
            gate.set()

    def _cancelled(self, job_id: str) -> None:
        """After a cancel won: stop the job's drain if it runs here, and announce it."""
        with self._lock:
            drain = self._drains.get(job_id)
        if drain is not None:
            drain.stop.set()
        self._emit(JobCancelled(self._clock(), job_id))

    def wait(self, job_id: str, timeout: float | None = None) -> Job | None:
        """Block until the job has finished: terminal, its drain stopped.

        Returns the job (``finished_at`` set), or ``None`` for an unknown or lapsed id.
        A job drained here is awaited on its thread's end; one drained by another
        process is polled with backoff.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        timeout = _timeout(timeout)
        if not _plausible_id(job_id):
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            drain = self._drains.get(job_id) or self._ending.get(job_id)
        if drain is not None:
            if not drain.done.wait(timeout):
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            _join(drain.thread, deadline)
            final = drain.final
            if final is not None and final.expires_at > self._clock():
                # The drain's last write answered the job as it ended: ended jobs change
                # no more until their lease lapses, so a read would find the same row.
                return _job(final)
        delay = 0.01
        pause = threading.Event()  # never set: an interruptible, Event-based sleep
        while True:
            try:
                job = self.job(job_id)
            except StoreUnavailableError:
                # A poll that met an outage (a dropped session, a restart) is retried
                # until the deadline: waiting is what the caller asked for.
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {job_id} did not finish within {timeout} s") from None
                pause.wait(delay)
                delay = min(delay * 1.5, _POLL_MAX)
                continue
            if job is None or drain is not None or job.finished_at is not None:
                # A drain of ours has ended (even one that could not record it): done.
                return job
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            pause.wait(delay if remaining is None else min(delay, remaining))
            delay = min(delay * 1.5, _POLL_MAX)

    # -- reads for serving results at web scale (HTTP pass-through) ---------------------

    def status_raw(self, job_id: str, *, results: bool = True) -> RawStatus | None:
        """As :meth:`status`, with each result the stored JSON text, targets streamed.

        For a layer that writes the results straight into a response: nothing is decoded.
        The targets are :class:`dcache.TargetRow` (the one in flight reads ``running``),
        read one row at a time as the returned object is iterated; close it (or exhaust
        it) to give its connection back. An ended job's end notification, if it has one,
        is read with it (``RawStatus.notification``). ``None`` if unknown or lapsed.
        """
        if not _plausible_id(job_id):
            return None
        stream = self._db.get_job_with_targets_streamed(
            job_id, now=self._clock(), results=results, notification=True
        )
        return RawStatus(stream, results) if stream is not None else None

    def lookup_detail(self, job_id: str) -> dcache.Lookup:
        """As :meth:`lookup`, with whose job it was and when it expired (for HTTP's 410)."""
        if not _plausible_id(job_id):
            return dcache.Lookup("unknown")
        return self._db.lookup(job_id, now=self._clock())

    def result_raw(
        self, job_id: str, idx: int, *, results: bool = True
    ) -> tuple[Job, dcache.TargetRow] | None:
        """As :meth:`result`, the job too and the result as its stored JSON text.

        With ``results=False`` the result is left out (``None``) and its size in bytes is
        in ``result_bytes``; read it a slice at a time with :meth:`read_result` (bytes) or
        :meth:`result_slice` (characters).
        """
        if not _plausible_id(job_id):
            return None
        found = self._db.get_target(job_id, idx, now=self._clock(), results=results)
        if found is None:
            return None
        row, target = found
        return _job(row), as_shown(row.status, row.targets_done, target)

    def result_slice(self, job_id: str, idx: int, start: int, length: int) -> str | None:
        """Characters ``start`` to ``start + length`` of a target's stored result text.

        ``""`` past its end, ``None`` when it is not stored (or no longer); see
        :meth:`dcache.DB.get_result_slice`. Check the job first (:meth:`result_raw`).
        """
        if not _plausible_id(job_id):
            return None
        return self._db.get_result_slice(job_id, idx, start, length)

    def read_result(self, job_id: str, idx: int, offset: int, size: int) -> bytes | None:
        """Bytes ``offset`` to ``offset + size`` of a target's stored result text, UTF-8.

        ``b""`` past its end, ``None`` when it is not stored (or no longer); see
        :meth:`dcache.DB.read_result`. Check the job first (:meth:`result_raw`).
        """
        if not _plausible_id(job_id):
            return None
        return self._db.read_result(job_id, idx, offset, size)

    def cancel_job(self, job_id: str, *, caller: str | None = None) -> tuple[bool, Job | None]:
        """As :meth:`cancel`, returning the job as the cancel decided it (no second read).

        ``(False, None)`` for an unknown or lapsed id, or (with ``caller``) a job of
        another caller, which is left alone; ``(False, job)`` for a terminal job.
        """
        if not _plausible_id(job_id):
            return False, None
        with self._cancelling(job_id):
            won, row = self._db.cancel_job(job_id, now=self._clock(), caller=caller)
            if won:
                self._cancelled(job_id)
        return won, (_job(row) if row is not None else None)

    def poll(self, job_id: str) -> Job | None:
        """As :meth:`job`, on the store's cheapest read (for conditional polls)."""
        if not _plausible_id(job_id):
            return None
        row = self._db.poll_job(job_id, now=self._clock())
        return _job(row) if row is not None else None

    def poll_notified(self, job_id: str) -> tuple[Job, dcache.NotificationRow | None] | None:
        """As :meth:`poll`, with the job's end notification once it has ended, if it asked
        for one (a second keyed read then, and only then)."""
        if not _plausible_id(job_id):
            return None
        row = self._db.poll_job(job_id, now=self._clock())
        if row is None:
            return None
        return _job(row), self._db.notification(job_id) if row.announced else None

    def wait_change(
        self, job_id: str, unchanged: Callable[[Job], bool], timeout: float
    ) -> Job | None:
        """Poll the job row until ``unchanged(job)`` is false, for up to ``timeout`` s.

        Returns the last job read (``None`` once it is unknown or lapsed). Wakes at once on
        an event of a job drained here; a job drained elsewhere is polled with backoff.
        """
        return self._wait_change(job_id, lambda: self.poll(job_id), unchanged, timeout)

    def wait_change_notified(
        self,
        job_id: str,
        unchanged: Callable[[tuple[Job, dcache.NotificationRow | None]], bool],
        timeout: float,
    ) -> tuple[Job, dcache.NotificationRow | None] | None:
        """As :meth:`wait_change`, on what :meth:`poll_notified` reads."""
        return self._wait_change(job_id, lambda: self.poll_notified(job_id), unchanged, timeout)

    def _wait_change(
        self,
        job_id: str,
        read: Callable[[], _T | None],
        unchanged: Callable[[_T], bool],
        timeout: float,
    ) -> _T | None:
        deadline = time.monotonic() + max(0.0, timeout)
        wake = threading.Event()

        def on_event(event: Event) -> None:
            if getattr(event, "job_id", None) == job_id:
                wake.set()

        unsubscribe = self.subscribe(on_event)
        delay = 0.02
        try:
            while True:
                wake.clear()
                found = read()
                left = deadline - time.monotonic()
                if found is None or not unchanged(found) or left <= 0:
                    return found
                wake.wait(min(delay, left))
                delay = min(delay * 1.5, _POLL_MAX)
        finally:
            unsubscribe()

    # -- job-end notifications (webhooks) ----------------------------------------------

    def notification(self, job_id: str) -> dcache.NotificationRow | None:
        """The job's end notification (pending, delivered or failed), or ``None``."""
        if not _plausible_id(job_id):
            return None
        return self._db.notification(job_id)

    def redeliver(self, job_id: str) -> bool:
        """Send the job's delivered or failed notification again, now (same webhook id).

        False when the job has none, or it is still pending (it will be sent anyway).
        """
        if not _plausible_id(job_id):
            return False
        won = self._db.redeliver(job_id, now=self._clock())
        if won and self._sender is not None:
            self._sender.wake.set()
        return won

    # -- owner heartbeat, reaping, purging ----------------------------------------------

    def check_owners(self) -> int:
        """Observe every owner's beats once; reap those silent for their whole window.

        An owner is taken for dead when this runner has seen its beat token (see
        :class:`dcache.OwnerRow`) unchanged for at least the larger of this runner's
        staleness window (three heartbeats) and the window the owner declared, both
        measured on this runner's monotonic clock. Their live jobs are failed with
        ``"restart"`` (see :meth:`dcache.DB.reap_owners`). The maintenance thread calls
        this every heartbeat period; returns how many jobs were failed.

        A token that stood still while this runner's own beats failed or were held up
        (longer than a period), or while its read of the owners was, is no evidence: a
        lock held on the database (SQLite's write lock, a process stopped mid-commit)
        holds every owner's beat alike. The watch then starts over.

        Raises:
            dcache.StoreError: the store failed; what was observed so far is forgotten,
                so no owner is judged on a gap in this runner's own view.
        """
        try:
            if self._beat_failed:
                # Our own beats failed: peers' beats may have failed alike, and a gap in
                # our view is no evidence against them. Start the watch over.
                self._beat_failed = False
                self._seen.clear()
            started = self._mono()
            rows = self._db.owners()
        except BaseException:
            self._seen.clear()
            raise
        now = self._mono()
        if now - started > self._config.heartbeat.total_seconds():
            # The read itself waited (behind a lock, a stalled server): so may have the
            # peers' beats meanwhile. Watch afresh from what it found.
            self._seen.clear()
        mine = self._stale_after.total_seconds()
        seen: dict[str, tuple[Any, float]] = {}
        dead: dict[str, Any] = {}
        for row in rows:
            if row.owner == self.owner:
                continue
            token = row.token
            before = self._seen.get(row.owner)
            if before is None or before[0] != token:
                seen[row.owner] = (token, now)
                continue
            seen[row.owner] = before
            window = max(mine, row.stale_after.total_seconds() if row.stale_after else 0.0)
            if now - before[1] > window:
                dead[row.owner] = token
        self._seen = seen
        if not dead:
            return 0
        n = self._db.reap_owners(dead, "restart", now=self._clock())
        for owner in dead:
            self._seen.pop(owner, None)
        if n:
            self._emit(JobsReaped(self._clock(), n, tuple(sorted(dead))))
            self._log.warning("marked %d orphaned job(s) failed: their runner stopped", n)
        return n

    def _beat_loop(self) -> None:
        """Beat every period, and nothing else: no other work can delay a beat."""
        period = self._config.heartbeat.total_seconds()
        while not self._stopping.wait(period):
            self._beat_once()

    def _beat_once(self) -> None:
        """One beat. One that failed, or that took longer than a period (it waited for a
        lock, a stalled server), tells :meth:`check_owners` to start its watch over:
        peers' beats may have been held alike."""
        started = self._mono()
        try:
            self._db.heartbeat(self.owner, now=self._clock(), stale_after=self._stale_after)
        except StoreError as exc:
            self._beat_failed = True
            self._store_failed("heartbeat", exc)
            self._log.warning("heartbeat failed; retrying next period", exc_info=True)
            return
        except BaseException:
            self._beat_failed = True
            self._log.critical("heartbeat crashed; retrying next period", exc_info=True)
            return
        if self._mono() - started > self._config.heartbeat.total_seconds():
            self._beat_failed = True

    def _maintain_loop(self) -> None:
        """Every period: judge peers, end abandoned jobs, settle submissions, purge."""
        period = self._config.heartbeat.total_seconds()
        while not self._stopping.wait(period):
            steps = (
                self.check_owners,
                self._retry_abandoned,
                self._retry_finish_hooks,
                self._resolve_unresolved,
                self._purge_due,
            )
            for step in steps:
                try:
                    step()
                except StoreError as exc:
                    self._store_failed(step.__name__.strip("_"), exc)
                    self._log.warning("%s failed; retrying next period", step.__name__)
                except BaseException:
                    self._log.critical(
                        "%s crashed; retrying next period", step.__name__, exc_info=True
                    )

    def _purge_due(self) -> None:
        """Purge lapsed jobs once per ``purge_interval``, in short transactions.

        Runs on the maintenance thread, never in a submit. Each transaction deletes what
        fits in ``dcache``'s purge budget (a few MiB of results); a purge goes on for
        about a second (_PURGE_WORK), and if lapsed jobs are left then, again at the
        next beat rather than an interval later, so a backlog of large jobs is worked
        off between the drains' writes instead of falling behind for good.
        """
        mono = self._mono()
        if mono < self._next_purge:
            return
        self._next_purge = mono + self._config.purge_interval.total_seconds()
        n = 0
        while not self._stopping.is_set():
            got = self._db.purge_expired(now=self._clock(), limit=500, max_batches=4)
            n += got
            if not got:
                break
            if self._mono() - mono >= _PURGE_WORK:
                self._next_purge = self._mono()  # more may be left: the next beat goes on
                break
        if n:
            self._log.info("purged %d lapsed job(s)", n)

    # -- shutdown -----------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Stop taking submissions and stop the runner's threads.

        Live jobs may finish within ``timeout`` seconds (``None``: wait for all). Each
        one still live then stops after its in-flight target is stored (waiting up to
        ``timeout`` again) and is marked failed with error ``"shutdown"``. With
        webhooks, the attempts under way are then waited for (``Webhooks.timeout`` and
        up to 5 s to record them, at most), so that each is recorded. Idempotent.
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
                    if self._db.fail_job(d.job_id, "shutdown", now=self._clock()):
                        # Told here: the drain's own end would come after the bus closes.
                        self._finished(d, FAILED, "shutdown")
                except StoreError:
                    self._log.error("could not mark job %s failed", d.job_id, exc_info=True)
        for d in drains:
            if d.done.is_set():
                _join(d.thread, None)
        self._stopping.set()
        if self._sender is not None:
            # The attempts under way end within Webhooks.timeout and are recorded before
            # close returns (left mid-way, a delivered one would be sent again once its
            # claim lapsed); what the sender claimed and did not attempt is given back.
            self._sender.stop(timeout=self._sender.hooks.timeout + 5.0)
        _join(self._beat_thread, time.monotonic() + 5)
        _join(self._maintain_thread, time.monotonic() + 5)
        self._retry_abandoned()
        # A submission still unsettled (its submit raised) is ended here: no drain of
        # this runner will ever run it.
        self._resolve_unresolved()
        try:
            if not any(d.thread is not None and d.thread.is_alive() for d in left):
                self._db.remove_owner(self.owner)
        except StoreError:
            self._log.warning("could not remove owner row %s", self.owner, exc_info=True)
        self._events.close()

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        with self._lock:
            n = len(self._drains)
        return f"<batch.Runner owner={self.owner[:8]} live={n} closed={self._closed}>"


def _announce(row: JobRow) -> JobSubmitted:
    """The JobSubmitted event of a job whose submit failed but which is drained after all."""
    return JobSubmitted(
        row.updated_at, row.id, row.caller, row.caller_class, row.targets_total, False
    )


def _refusal(exc: BaseException) -> str:
    """The ``SubmissionRefused.reason`` for an exception that refused a submission."""
    for kind, reason in (
        (TooManyTargetsError, "too_many_targets"),
        (CallerBusyError, "caller_busy"),
        (BusyError, "busy"),
        (IdempotencyKeyMismatchError, "key_mismatch"),
        (InvalidTargetsError, "invalid"),
        (RunnerClosedError, "closed"),
    ):
        if isinstance(exc, kind):
            return reason
    return "store"


def _timeout(timeout: float | None) -> float | None:
    """A wait's timeout in seconds: ``None`` or infinity wait for ever; NaN is refused."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout):
        raise ValueError("timeout must be a number of seconds or None, not NaN")
    if timeout > threading.TIMEOUT_MAX:
        return None  # longer than any wait can be told apart from for ever
    return max(0.0, float(timeout))


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


_json_text = json.encoder.encode_basestring  # a str as a JSON string, non-ASCII kept


def result_json(res: Result) -> str:
    """A result as it is stored: ``json.dumps(res.to_json(), ensure_ascii=False,
    allow_nan=False)``.

    Most results have no meta: their text is the content's JSON string in the frame
    ``json.dumps`` puts around it, built directly (half the time: no encoder is set up
    for every target).
    """
    if not res.meta:
        return '{"content": ' + _json_text(res.content) + "}"
    return json.dumps(res.to_json(), ensure_ascii=False, allow_nan=False)


_CONTENT_ONLY = '{"content": "'  # what result_json writes before a meta-less content


def result_of_json(text: str) -> Result:
    """A stored result back, as ``Result.from_json(json.loads(text))``.

    The text :func:`result_json` writes for a result without meta is decoded as the one
    JSON string it holds (``json.decoder.scanstring``, as strict as ``json.loads``),
    without setting up a decoder for every target of a status read: 1.9 against 3.1 µs
    for 1 KiB of content. Any other text goes through ``json.loads``.

    Raises:
        ValueError: the text is not JSON (``json.JSONDecodeError``).
        TypeError, AttributeError: it is JSON but not a stored result.
    """
    if text.startswith(_CONTENT_ONLY) and text.endswith('"}'):
        content, end = _scan_string(text, len(_CONTENT_ONLY))
        if end == len(text) - 1:
            return Result(content)
    return Result.from_json(json.loads(text))


_scan_string = json.decoder.scanstring  # type: ignore[attr-defined]


def _json_depth(value: object, limit: int) -> int:
    """How deep lists and dicts nest in ``value``, counted up to ``limit + 1``.

    Iterative, so neither a deep value nor a cyclic one can exhaust the stack.
    """
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
