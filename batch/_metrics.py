"""Prometheus metrics, fed by the runner's event stream (extra ``[metrics]``).

Counters and histograms are updated by a subscriber on :meth:`batch.Runner.subscribe`
(so never on a drain's thread); the whole database's live jobs and cap usage are read from
the store at scrape time by a collector (one query on the status index). Labels are bounded:
outcomes, statuses, store operations and the caller *class*, never a caller, URL or id.

Under gunicorn with several workers, set ``PROMETHEUS_MULTIPROC_DIR`` (an empty directory,
wiped before each start) in the environment before the server starts, and call
``prometheus_client.multiprocess.mark_process_dead(worker.pid)`` from gunicorn's
``child_exit`` hook: every worker then writes its samples to that directory and a scrape
answered by any worker reports the sum over all of them.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flask import Blueprint, Request, Response, abort, request

import dcache

from ._runner import Runner
from ._values import MAX_CALLER_LENGTH, check_text
from .events import (
    Event,
    JobCancelled,
    JobFinished,
    JobsReaped,
    JobSubmitted,
    StoreFailed,
    SubmissionRefused,
    TargetStored,
)

try:
    import prometheus_client
    from prometheus_client import multiprocess as _multiprocess
    from prometheus_client import values as _values
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.exposition import choose_encoder
except ImportError:  # pragma: no cover - exercised only without the extra
    prometheus_client = None  # type: ignore[assignment]

__all__ = [
    "FETCH_BUCKETS",
    "JOB_BUCKETS",
    "STORE_BUCKETS",
    "RunnerMetrics",
    "StoreCollector",
    "instruments",
    "metrics",
    "multiprocess_mode",
]

FETCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Seconds: a fetch of a web page or a file."""
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds: one target's write (a commit, shared with other drains')."""
JOB_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
"""Seconds: a job from its submit to the end of its drain."""

_MAX_ENDED_FIRST = 4096

OTHER_CLASS = "other"
"""The ``caller_class`` label of classes beyond ``max_caller_classes``, and of classes
that are no valid text (a refused submission's)."""


def _labelable(caller_class: object) -> bool:
    """Whether a class is text a runner accepts, so a label value that always exposes."""
    try:
        check_text(caller_class, "caller_class", limit=MAX_CALLER_LENGTH)
    except ValueError:
        return False
    return True


def _require() -> None:
    if prometheus_client is None:
        raise ImportError(
            "batch metrics need prometheus_client: pip install 'batch-dcache[metrics]'"
        )


def multiprocess_mode() -> bool:
    """Whether prometheus_client runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).

    prometheus_client decides this once, when it is first imported.
    """
    _require()
    return bool(getattr(_values.ValueClass, "_multiprocess", False))


class RunnerMetrics:
    """The instruments, and the event subscriber that updates them.

    One instance per registry and process (see ``instruments()``); several runners may
    feed it. Call it with events, or subscribe it with :meth:`attach`.

    Args:
        registry: where the instruments are registered (``None``: the default registry).
        max_caller_classes: distinct ``caller_class`` label values kept; later classes
            are counted under ``"other"`` so no app can grow the series without bound.
            The bound holds per instance, so per process: in multiprocess mode each
            worker keeps its own first ``max_caller_classes``.
    """

    def __init__(self, registry: Any = None, *, max_caller_classes: int = 50) -> None:
        _require()
        from prometheus_client import Counter, Gauge, Histogram

        reg = prometheus_client.REGISTRY if registry is None else registry
        self._max_classes = max_caller_classes
        self._classes: set[str] = set()
        self._lock = threading.Lock()
        self._draining: set[str] = set()
        # runner -> its live subscription. Weak both ways: a subscription (held by the
        # runner's event bus, which may hold the runner) must not keep a closed runner
        # alive from this process-wide object.
        self._attached: weakref.WeakKeyDictionary[Runner, weakref.ref[_Subscription]] = (
            weakref.WeakKeyDictionary()
        )
        self._attach_lock = threading.Lock()
        self._ended_first: OrderedDict[str, None] = OrderedDict()
        self.submissions = Counter(
            "batch_submissions",
            "Submissions by outcome (created, reused, or the reason of a refusal).",
            ["outcome", "caller_class"],
            registry=reg,
        )
        self.targets = Counter(
            "batch_targets",
            "Targets stored, by status (done or failed).",
            ["status", "caller_class"],
            registry=reg,
        )
        self.jobs_finished = Counter(
            "batch_jobs_finished",
            "Jobs drained by this process that finished, by terminal status.",
            ["status", "caller_class"],
            registry=reg,
        )
        self.jobs_cancelled = Counter(
            "batch_jobs_cancelled", "Live jobs cancelled through this process.", registry=reg
        )
        self.fetch_seconds = Histogram(
            "batch_fetch_duration_seconds",
            "Time spent in fetch, per target.",
            buckets=FETCH_BUCKETS,
            registry=reg,
        )
        self.store_seconds = Histogram(
            "batch_store_write_duration_seconds",
            "Time to store one target's outcome.",
            buckets=STORE_BUCKETS,
            registry=reg,
        )
        self.result_bytes = Counter("batch_result_bytes", "Bytes of results stored.", registry=reg)
        self.job_seconds = Histogram(
            "batch_job_duration_seconds",
            "Time from a job's submit to the end of its drain, by terminal status.",
            ["status"],
            buckets=JOB_BUCKETS,
            registry=reg,
        )
        self.draining = Gauge(
            "batch_process_live_jobs",
            "Jobs being drained by this process (summed over live processes).",
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.store_errors = Counter(
            "batch_store_errors",
            "Store operations that failed, by operation and kind (transient or permanent).",
            ["operation", "kind"],
            registry=reg,
        )
        self.reaped = Counter(
            "batch_orphaned_jobs_reaped",
            "Live jobs of dead runners that this process marked failed.",
            registry=reg,
        )

    def _class(self, caller_class: str) -> str:
        """The label for ``caller_class``: itself while slots last, else ``other``.

        A class that is no valid text (a refused submission's, as sent) is ``other``
        and takes no slot: a lone surrogate in a label fails every later scrape, and
        refused junk would use up the slots.
        """
        with self._lock:
            if caller_class in self._classes:
                return caller_class
            if not _labelable(caller_class):
                return OTHER_CLASS
            if len(self._classes) < self._max_classes:
                self._classes.add(caller_class)
                return caller_class
        return OTHER_CLASS

    def attach(self, runner: Runner) -> Callable[[], None]:
        """Subscribe to ``runner``'s events; return the unsubscribe function.

        Once per runner: attaching to a runner this is attached to already returns the
        same unsubscribe function, so no event is counted twice. After it was called, a
        later attach subscribes again.
        """
        with self._attach_lock:
            ref = self._attached.get(runner)
            found = ref() if ref is not None else None
            if found is not None and found.active:
                return found.detach
            sub = _Subscription(self)
            sub.unsubscribe = runner.subscribe(sub)
            self._attached[runner] = weakref.ref(sub)
            return sub.detach

    def __call__(self, event: Event) -> None:
        """Update the instruments for one event."""
        if isinstance(event, TargetStored):
            self.targets.labels(event.status, self._class(event.caller_class)).inc()
            self.fetch_seconds.observe(event.fetch_seconds)
            self.store_seconds.observe(event.store_seconds)
            if event.result_bytes:
                self.result_bytes.inc(event.result_bytes)
        elif isinstance(event, JobSubmitted):
            outcome = "reused" if event.reused else "created"
            self.submissions.labels(outcome, self._class(event.caller_class)).inc()
            if not event.reused:
                self._drain_started(event.job_id)
        elif isinstance(event, SubmissionRefused):
            self.submissions.labels(event.reason, self._class(event.caller_class)).inc()
        elif isinstance(event, JobFinished):
            self.jobs_finished.labels(event.status, self._class(event.caller_class)).inc()
            self.job_seconds.labels(event.status).observe(event.duration_seconds)
            self._drain_ended(event.job_id)
        elif isinstance(event, JobCancelled):
            self.jobs_cancelled.inc()
        elif isinstance(event, StoreFailed):
            kind = "transient" if event.transient else "permanent"
            self.store_errors.labels(event.operation, kind).inc()
        elif isinstance(event, JobsReaped):
            self.reaped.inc(event.count)

    # A set, not inc/dec: a JobFinished for a job whose submit this process never saw
    # (a drain adopted by the maintenance thread) must not drive the gauge below zero.
    # And a fast drain's JobFinished can reach the stream before its JobSubmitted (the
    # drain starts before submit() emits), so ends seen first are remembered, boundedly.
    def _drain_started(self, job_id: str) -> None:
        with self._lock:
            if job_id in self._ended_first:
                del self._ended_first[job_id]
            else:
                self._draining.add(job_id)
            self.draining.set(len(self._draining))

    def _drain_ended(self, job_id: str) -> None:
        with self._lock:
            if job_id in self._draining:
                self._draining.discard(job_id)
            else:
                self._ended_first[job_id] = None
                while len(self._ended_first) > _MAX_ENDED_FIRST:
                    self._ended_first.popitem(last=False)
            self.draining.set(len(self._draining))


class _Subscription:
    """One :class:`RunnerMetrics`' subscription to one runner's events."""

    __slots__ = ("__weakref__", "active", "metrics", "unsubscribe")

    def __init__(self, metrics: RunnerMetrics) -> None:
        self.metrics = metrics
        self.active = True
        self.unsubscribe: Callable[[], None] = lambda: None

    def __call__(self, event: Event) -> None:
        self.metrics(event)

    def __repr__(self) -> str:
        return f"<batch metrics subscription of {self.metrics!r}>"

    def detach(self) -> None:
        """Unsubscribe (idempotent)."""
        self.active = False
        self.unsubscribe()


_instruments: dict[int, tuple[Any, RunnerMetrics]] = {}
_instruments_lock = threading.Lock()


def instruments(registry: Any = None) -> RunnerMetrics:
    """The process's :class:`RunnerMetrics` on ``registry`` (default: the global one).

    Created on first use; metric names can be registered only once per registry.
    """
    _require()
    reg = prometheus_client.REGISTRY if registry is None else registry
    with _instruments_lock:
        found = _instruments.get(id(reg))
        if found is None or found[0] is not reg:
            found = (reg, RunnerMetrics(reg))
            _instruments[id(reg)] = found
        return found[1]


class StoreCollector:
    """Scrape-time gauges read from the store: the whole database, not one process.

    One query (live jobs per caller, on the status index) per scrape gives the live jobs,
    the callers with live jobs and the callers at their cap; the caps come from the
    runner's :class:`batch.Config`. ``batch_store_up`` is 0 when that query failed.
    """

    def __init__(self, runner: Runner) -> None:
        _require()
        self._runner = runner

    def describe(self) -> Iterable[Metric]:
        """No fixed description: the gauges are produced at scrape time only."""
        return ()

    def collect(self) -> Iterator[Metric]:
        """Read the store once and yield the gauges."""
        config = self._runner.config
        try:
            per_caller = self._runner.db.live_by_caller()
        except dcache.StoreError:
            yield GaugeMetricFamily(
                "batch_store_up", "Whether the scrape-time store read worked.", value=0
            )
            return
        yield GaugeMetricFamily(
            "batch_store_up", "Whether the scrape-time store read worked.", value=1
        )
        yield GaugeMetricFamily(
            "batch_live_jobs",
            "Live (queued or running) jobs in the whole database.",
            value=sum(per_caller.values()),
        )
        yield GaugeMetricFamily(
            "batch_live_jobs_limit",
            "The cap on live jobs in all (Config.jobs_total).",
            value=config.jobs_total,
        )
        yield GaugeMetricFamily(
            "batch_live_callers",
            "Callers with at least one live job.",
            value=len(per_caller),
        )
        yield GaugeMetricFamily(
            "batch_callers_at_cap",
            "Callers whose live jobs reach the per-caller cap.",
            value=sum(1 for n in per_caller.values() if n >= config.jobs_per_caller),
        )
        yield GaugeMetricFamily(
            "batch_caller_live_jobs_limit",
            "The cap on one caller's live jobs (Config.jobs_per_caller).",
            value=config.jobs_per_caller,
        )


class _Forward:
    """A collector that re-exports everything one registry holds."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()


def metrics(
    runner: Runner,
    *,
    path: str = "/metrics",
    url_prefix: str | None = None,
    name: str = "batch_metrics",
    registry: Any = None,
    authorize: Callable[[Request], bool] | None = None,
) -> Blueprint:
    """A blueprint serving Prometheus metrics for ``runner`` at ``path``.

    Subscribes the process's instruments (see ``instruments()``) to the runner's
    events, once per runner and registry: mounting it again (an app factory run twice,
    two apps in one process) counts every event once. A scrape reports them (in
    multiprocess mode: every worker's, from ``PROMETHEUS_MULTIPROC_DIR``) and the
    store's gauges (``StoreCollector``). Content negotiation follows prometheus_client
    (OpenMetrics when asked for).

    Args:
        runner: the process's runner.
        path: the route of the metrics page.
        url_prefix: a prefix for ``path``, if any.
        name: the blueprint's name.
        registry: where the instruments live and, outside multiprocess mode, what is
            exported (``None``: prometheus_client's default registry, so the process
            and platform collectors come along).
        authorize: ``authorize(request) -> bool``, as for the dashboard: when given,
            only a True answer gets in; anything else (False, None, a truthy string)
            answers 403. It may also raise an ``HTTPException``, which is the answer
            (e.g. a 401 with ``WWW-Authenticate`` for HTTP Basic auth).

    Raises:
        ImportError: prometheus_client is not installed (extra ``[metrics]``).
    """
    _require()
    source = prometheus_client.REGISTRY if registry is None else registry
    instruments(source).attach(runner)
    store = StoreCollector(runner)
    bp = Blueprint(name, __name__, url_prefix=url_prefix)

    def view() -> Response:
        if authorize is not None and authorize(request) is not True:
            abort(403)  # only True, as the dashboard: a truthy "denied: ..." is no yes
        scrape = prometheus_client.CollectorRegistry()
        if multiprocess_mode():
            _multiprocess.MultiProcessCollector(scrape)  # type: ignore[no-untyped-call]
        else:
            scrape.register(_Forward(source))
        scrape.register(store)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        resp = Response(encoder(scrape), status=200)
        resp.headers["Content-Type"] = content_type
        resp.headers["Cache-Control"] = "no-store"
        return resp

    bp.add_url_rule(path, "metrics", view, methods=["GET"])
    return bp
