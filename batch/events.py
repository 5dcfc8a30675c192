"""The runner's event stream: typed events, delivered to subscribers off the drain's path.

Every moment that matters (a submission decided or refused, a target stored, a job's end,
a cancel, a reap, a store error) becomes one frozen event. The runner puts it on a bounded
queue (a non-blocking put: bounded work on the emitting thread) and one dispatcher thread
per runner hands it to each subscriber in turn. A subscriber that raises is logged and
skipped; one that is slow delays only later events, never a drain or a request. When the
queue is full, events are dropped and counted (``EventBus.dropped``) rather than
stalling anybody.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import attrs

__all__ = [
    "DeliveryAttempted",
    "Event",
    "EventBus",
    "JobCancelled",
    "JobFinished",
    "JobSubmitted",
    "JobsReaped",
    "StoreFailed",
    "SubmissionRefused",
    "Subscriber",
    "TargetStored",
    "log_events",
    "only",
]


@attrs.frozen
class JobSubmitted:
    """A submission was accepted: a new job (``reused`` False) or an existing one."""

    at: dt.datetime
    job_id: str
    caller: str
    caller_class: str
    targets: int
    reused: bool


@attrs.frozen
class SubmissionRefused:
    """A submission was refused.

    ``reason`` is one of ``"too_many_targets"``, ``"caller_busy"``, ``"busy"``,
    ``"invalid"``, ``"key_mismatch"``, ``"closed"`` or ``"store"`` (the store failed).
    """

    at: dt.datetime
    caller: str
    caller_class: str
    reason: str
    detail: str = ""


@attrs.frozen
class TargetStored:
    """A target's outcome was stored (``status`` ``"done"`` or ``"failed"``)."""

    at: dt.datetime
    job_id: str
    idx: int
    caller_class: str
    status: str
    fetch_seconds: float
    store_seconds: float
    result_bytes: int


@attrs.frozen
class JobFinished:
    """A job drained by this runner reached its end and its drain stopped.

    ``status`` is the terminal status; ``duration_seconds`` runs from the submit to the
    end as this runner's clock saw it.
    """

    at: dt.datetime
    job_id: str
    caller_class: str
    status: str
    error: str
    duration_seconds: float


@attrs.frozen
class JobCancelled:
    """This runner cancelled a live job (drained here or by another process)."""

    at: dt.datetime
    job_id: str


@attrs.frozen
class JobsReaped:
    """This runner failed ``count`` live jobs of owners it found dead."""

    at: dt.datetime
    count: int
    owners: tuple[str, ...]


@attrs.frozen
class DeliveryAttempted:
    """This runner tried to deliver a job's end notification (a webhook).

    ``outcome`` is ``"delivered"``, ``"pending"`` (to be retried) or ``"failed"`` (given
    up); ``http_status`` is 0 when no answer came; ``recorded`` is False when the
    sender's claim had lapsed and another sender owned the row by then.
    """

    at: dt.datetime
    job_id: str
    webhook_id: str
    attempt: int
    outcome: str
    http_status: int
    seconds: float
    recorded: bool


@attrs.frozen
class StoreFailed:
    """A store operation failed (``transient``: the kind a retry may cure)."""

    at: dt.datetime
    operation: str
    transient: bool
    error: str


Event = (
    JobSubmitted
    | SubmissionRefused
    | TargetStored
    | JobFinished
    | JobCancelled
    | JobsReaped
    | DeliveryAttempted
    | StoreFailed
)
"""Any one of the events above (a union of the event classes)."""
Subscriber = Callable[[Event], object]
"""The type of a subscriber, called with each event on the dispatcher thread (return ignored).

A subscriber may declare the event classes it wants in an ``event_types`` attribute (a
tuple; :func:`only` sets it): the bus then neither queues nor dispatches the others for
it, and an event no subscriber wants costs its emitter nothing (no queue, no wake-up of
the dispatcher thread). Without the attribute, a subscriber receives every event. It may
also declare, in an ``event_when`` attribute, a function of no arguments that tells whether
it wants any event right now (the runner's log subscriber: whether INFO is enabled); the
bus asks it at every emit, so an event only it would take is not queued while it says no.
It runs on the emitting thread (a drain's, a request's): it must answer at once, without
I/O or locks that could wait (a logger's ``isEnabledFor``). One that raises counts as a
yes (the event is queued; the error is logged once); ``event_types`` is read when the
subscriber is added (a class or an iterable of classes; anything else is a TypeError).
"""


def only(
    *types: type, fn: Callable[[Any], object], when: Callable[[], bool] | None = None
) -> Subscriber:
    """``fn`` as a subscriber of the given event classes only, and, with ``when``, only
    while ``when()`` is true (see :data:`Subscriber`)."""

    def subscriber(event: Event) -> object:
        return fn(event)

    subscriber.event_types = types  # type: ignore[attr-defined]
    if when is not None:
        subscriber.event_when = when  # type: ignore[attr-defined]
    return subscriber


_STOP = object()


class _Call:
    """A function queued to run on the dispatcher thread (:meth:`EventBus.call_soon`)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn


def _event_types(fn: Subscriber) -> tuple[type, ...] | None:
    """A subscriber's ``event_types`` as a tuple of classes (``None``: every event)."""
    types = getattr(fn, "event_types", None)
    if types is None:
        return None
    try:
        found = (types,) if isinstance(types, type) else tuple(types)
    except TypeError:  # not iterable
        found = (types,)
    if not all(isinstance(t, type) for t in found):
        raise TypeError(f"event_types must be a class or classes, not {types!r}")
    return found


_Entry = tuple[Subscriber, "tuple[type, ...] | None"]
_Wanted = dict[type, tuple[bool, tuple[Callable[[], bool], ...]]]


def _wants(types: tuple[type, ...] | None, kind: type) -> bool:
    return types is None or issubclass(kind, types)


class EventBus:
    """A bounded queue and one dispatcher thread that calls the subscribers."""

    def __init__(
        self,
        subscribers: list[Subscriber],
        log: logging.Logger,
        *,
        name: str,
        maxsize: int = 65536,
    ) -> None:
        self._log = log
        self._lock = threading.Lock()
        # (event class -> (does a subscriber always want it, the `event_when` of those
        # that want it only at times), each subscriber with its event classes, read once
        # when it was added): replaced whole when the subscribers change, so an emitter
        # reads the cache and the subscribers it is computed from in one step, no lock.
        self._view: tuple[_Wanted, tuple[_Entry, ...]] = (
            {},
            tuple((fn, _event_types(fn)) for fn in subscribers),
        )
        self._when_failed: set[int] = set()  # event_when functions whose error was logged
        self._queue: queue.Queue[object] = queue.Queue(maxsize)
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Add a subscriber; return a function that removes it again."""
        if not callable(fn):
            raise TypeError(f"a subscriber must be callable, not {type(fn).__name__}")
        entry = (fn, _event_types(fn))
        with self._lock:
            self._view = ({}, (*self._view[1], entry))

        def unsubscribe() -> None:  # this subscription only (fn may hold several)
            with self._lock:
                self._view = ({}, tuple(s for s in self._view[1] if s is not entry))

        return unsubscribe

    def wants(self, kind: type) -> bool:
        """Whether an event of this class would be queued (a subscriber wants it): an
        emitter may skip building one nobody wants. Never raises."""
        # The cache and the subscribers it is computed from are read together: a
        # subscribe meanwhile replaces both, and this answer then lands in the old dict.
        cache, subscribers = self._view
        wanted = cache.get(kind)
        if wanted is None:
            takers = [fn for fn, types in subscribers if _wants(types, kind)]
            whens = tuple(getattr(fn, "event_when", None) for fn in takers)
            wanted = (None in whens, tuple(w for w in whens if w is not None))
            cache[kind] = wanted
        always, at_times = wanted
        return (always or any(self._asks(when) for when in at_times)) and not self._closed

    def _asks(self, when: Callable[[], bool]) -> bool:
        """``when()``, or True (the event is queued) if it raises: a subscriber's error
        never reaches the drain or the request that emits."""
        try:
            return bool(when())
        except BaseException:
            if id(when) not in self._when_failed:
                self._when_failed.add(id(when))
                self._log.error("event_when %r failed; taken as yes", when, exc_info=True)
            return True

    def emit(self, event: Event) -> None:
        """Queue an event without blocking; drop (and count) it when the queue is full."""
        if not self.wants(type(event)):
            return  # nobody listens to this kind: no queue, no wake-up
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the dispatcher thread, in order with the events (dropped once
        the bus is closed; dropped and counted, as an event, when the queue is full)."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(_Call(fn))
        except queue.Full:
            self.dropped += 1

    def start(self) -> None:
        """Start the dispatcher thread (idempotent)."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None and not self._closed:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            if isinstance(event, _Call):
                try:
                    event.fn()
                except BaseException:
                    self._log.error("event-thread call %r failed", event.fn, exc_info=True)
                continue
            kind = type(event)
            for fn, types in self._view[1]:
                if not _wants(types, kind):
                    continue
                try:
                    fn(event)  # type: ignore[arg-type]
                except BaseException:
                    self._log.error(
                        "event subscriber %r failed on %s", fn, type(event).__name__, exc_info=True
                    )

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (within ``timeout``), then stop the dispatcher."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        thread.join(timeout)


def log_events(log: logging.Logger) -> Subscriber:
    """The subscriber behind the runner's INFO-level log lines about jobs."""

    def subscriber(event: Event) -> None:
        if isinstance(event, JobSubmitted) and not event.reused:
            log.info(
                "job %s submitted by %s: %d target(s)",
                event.job_id,
                event.caller,
                event.targets,
                extra={"job_id": event.job_id},
            )
        elif isinstance(event, JobCancelled):
            log.info("job %s cancelled", event.job_id, extra={"job_id": event.job_id})
        elif isinstance(event, JobFinished):
            log.info(
                "job %s finished: %s%s",
                event.job_id,
                event.status,
                f" ({event.error})" if event.error else "",
                extra={"job_id": event.job_id},
            )

    # Without INFO enabled the lines would be dropped: no event is queued for them, and
    # no dispatcher wake-up is paid at every submit and every job's end.
    return only(
        JobSubmitted,
        JobCancelled,
        JobFinished,
        fn=subscriber,
        when=lambda: log.isEnabledFor(logging.INFO),
    )
