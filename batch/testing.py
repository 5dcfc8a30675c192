"""A testing kit for apps built on ``batch``: a scripted fetch, a clock, an immediate mode.

Installed with the ``[testing]`` extra, this module is also a pytest plugin (entry point
``pytest11``) with these fixtures:

- ``batch_db``: an in-memory store (:meth:`dcache.DB.memory`), closed after the test;
- ``batch_fetch``: a :class:`ScriptedFetch`, every gate opened after the test (before
  the runner fixtures below close: a test may end with a fetch held at a gate);
- ``batch_clock``: a :class:`Clock` at a fixed instant;
- ``batch_runner``: a real, threaded :class:`batch.Runner` on those three;
- ``batch_immediate_runner``: an :class:`ImmediateRunner` on those three.

Example::

    def test_my_view(batch_immediate_runner, batch_fetch):
        batch_fetch.result("https://example.org/a", "<html>…</html>")
        job_id, _ = batch_immediate_runner.submit("alice", "free", [{"url": "https://example.org/a"}])
        job, targets = batch_immediate_runner.status(job_id)
        assert job.status == "done"           # submit drained it before returning

The immediate mode is for tests only: it breaks the rule that ``submit`` returns with the
job running, on purpose, so a view under test returns with its job already terminal.
Every other rule still holds (order, caps, idempotency, one terminal status).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

import dcache

from ._errors import FetchError
from ._runner import Runner, _Drain
from ._values import Config, Job, Result, Target

__all__ = ["Clock", "Gate", "ImmediateRunner", "ScriptedFetch"]

WAIT = 10.0  # seconds a gate or a handshake may take before the test fails instead of hanging


class Clock:
    """A wall clock and a monotonic clock that move only when the test says so.

    Pass it as ``Runner(..., clock=clock, monotonic=clock.monotonic)``: leases, heartbeat
    judgements and purges then follow :meth:`advance`, not real time.
    """

    def __init__(self, start: dt.datetime | None = None) -> None:
        self.now = start or dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
        if self.now.tzinfo is None:
            raise ValueError("the clock's start must be an aware datetime")
        self._mono = 1_000.0

    def __call__(self) -> dt.datetime:
        return self.now

    def monotonic(self) -> float:
        """Seconds on the monotonic clock (moves with :meth:`advance`)."""
        return self._mono

    def advance(self, seconds: float = 0.0, **kw: float) -> dt.datetime:
        """Move both clocks forward by ``seconds`` (and/or ``timedelta`` keywords)."""
        step = dt.timedelta(seconds=seconds, **kw)
        if step < dt.timedelta(0):
            raise ValueError("time only moves forward; use step() for a wall-clock step")
        self.now += step
        self._mono += step.total_seconds()
        return self.now

    def step(self, seconds: float) -> dt.datetime:
        """Step the wall clock alone (an NTP step, a VM resume); monotonic time stays."""
        self.now += dt.timedelta(seconds=seconds)
        return self.now


@attrs.define(eq=False)
class Gate:
    """Holds fetches of one URL until the test opens it."""

    entered: threading.Event = attrs.Factory(threading.Event)
    opened: threading.Event = attrs.Factory(threading.Event)

    def open(self) -> None:
        """Let held fetches (and every later one) return."""
        self.opened.set()

    def wait_entered(self, timeout: float = WAIT) -> None:
        """Block until a fetch has reached the gate; fail the test after ``timeout``."""
        if not self.entered.wait(timeout):
            raise AssertionError("no fetch reached the gate in time")


class ScriptedFetch:
    """A ``fetch`` that does what the test scripts for each URL, and records every call.

    Unscripted URLs return ``Result(f"content of {url}", {"url": url})``. Per URL:
    :meth:`result`, :meth:`error` (a :class:`batch.FetchError`), :meth:`raises` (any
    exception), :meth:`delay`, :meth:`gate` (hold until the test opens it), or
    :meth:`behave` with any function of the target. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[str] = []
        self.thread_names: list[str] = []
        self.in_flight = 0
        self.peak = 0
        self._gates: dict[str, Gate] = {}
        self._delays: dict[str, float] = {}
        self._behaviours: dict[str, Callable[[Target], object]] = {}

    # -- scripting ------------------------------------------------------------------------

    def result(self, url: str, content: str, meta: dict[str, Any] | None = None) -> None:
        """Fetching ``url`` returns this result."""
        res = Result(content, dict(meta or {}))
        self._behaviours[url] = lambda _t: res

    def error(self, url: str, message: str, hint: str = "") -> None:
        """Fetching ``url`` raises ``FetchError(message, hint)`` (the target fails)."""

        def fail(_t: Target) -> object:
            raise FetchError(message, hint=hint)

        self._behaviours[url] = fail

    def raises(self, url: str, exc: BaseException) -> None:
        """Fetching ``url`` raises ``exc`` (a crash of the app's fetch)."""

        def fail(_t: Target) -> object:
            raise exc

        self._behaviours[url] = fail

    def behave(self, url: str, fn: Callable[[Target], object]) -> None:
        """Fetching ``url`` returns (or raises) whatever ``fn(target)`` does."""
        self._behaviours[url] = fn

    def delay(self, url: str, seconds: float) -> None:
        """Fetching ``url`` takes ``seconds`` (real time) before it does the rest."""
        self._delays[url] = seconds

    def gate(self, url: str) -> Gate:
        """Hold every fetch of ``url`` until the returned gate is opened.

        Asked again while the URL's gate is closed, the same gate; once it has been
        opened, a new closed one (the next fetch is held again)."""
        with self._lock:
            gate = self._gates.get(url)
            if gate is None or gate.opened.is_set():
                gate = self._gates[url] = Gate()
            return gate

    # -- the older names the project's own tests use --------------------------------------

    def block(self, *urls: str) -> None:
        """Gate each of these URLs (see :meth:`gate`)."""
        for url in urls:
            self.gate(url)

    def release(self, *urls: str) -> None:
        """Open the gates of these URLs."""
        for url in urls:
            self._gates[url].open()

    def wait_entered(self, url: str, timeout: float = WAIT) -> None:
        """Block until a fetch of ``url`` has reached its gate."""
        self._gates[url].wait_entered(timeout)

    def release_all(self) -> None:
        """Open every gate (teardown)."""
        for gate in list(self._gates.values()):
            gate.open()

    def count(self, url: str | None = None) -> int:
        """How many fetches started, of one URL or of all."""
        with self._lock:
            return len(self.calls) if url is None else self.calls.count(url)

    # -- the fetch ------------------------------------------------------------------------

    def __call__(self, target: Target) -> Result:
        url = target.url
        with self._lock:
            self.calls.append(url)
            self.thread_names.append(threading.current_thread().name)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            gate = self._gates.get(url)
            if gate is not None:
                gate.entered.set()
                if not gate.opened.wait(WAIT):
                    raise RuntimeError(f"test gate for {url} was never opened")
            pause = self._delays.get(url)
            if pause:
                threading.Event().wait(pause)
            fn = self._behaviours.get(url)
            if fn is not None:
                return fn(target)  # type: ignore[return-value]
            return Result(content=f"content of {url}", meta={"url": url})
        finally:
            with self._lock:
                self.in_flight -= 1


class ImmediateRunner(Runner):
    """A :class:`batch.Runner` whose ``submit`` drains the new job before it returns.

    For tests only (see the module docstring): the drain runs on the caller's thread, so
    a gated or slow fetch blocks ``submit`` itself. Everything else is the real runner:
    the store, the rules, the events.
    """

    def _launch(self, drain: _Drain) -> None:
        self._drain(drain)

    def submit_job(
        self,
        caller: str,
        caller_class: str,
        targets: Sequence[Any],
        *,
        idempotency_key: str | None = None,
        notify: str | None = None,
    ) -> tuple[Job, bool]:
        """As :meth:`batch.Runner.submit_job`, the job read again once drained."""
        job, reused = super().submit_job(
            caller, caller_class, targets, idempotency_key=idempotency_key, notify=notify
        )
        # The submit transaction's row predates the drain this submit ran: the HTTP
        # layer answers with the job, and here it is already finished.
        return self.job(job.id) or job, reused


# -- the pytest plugin ----------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the kit's classes work without pytest
    pass
else:

    @pytest.fixture
    def batch_db() -> Iterator[dcache.DB]:
        """An in-memory store, closed after the test."""
        db = dcache.DB.memory()
        try:
            yield db
        finally:
            db.close()

    @pytest.fixture
    def batch_fetch() -> Iterator[ScriptedFetch]:
        """A scripted fetch; every gate is opened after the test (before the kit's runner
        fixtures close, so a test may end with a fetch held at a gate)."""
        fetch = ScriptedFetch()
        try:
            yield fetch
        finally:
            fetch.release_all()

    @pytest.fixture
    def batch_clock() -> Clock:
        """A clock that moves only when the test advances it."""
        return Clock()

    @pytest.fixture
    def batch_runner(
        batch_db: dcache.DB, batch_fetch: ScriptedFetch, batch_clock: Clock
    ) -> Iterator[Runner]:
        """A real, threaded runner on the kit's store, fetch and clock."""
        with Runner(
            batch_db, batch_fetch, Config(), clock=batch_clock, monotonic=batch_clock.monotonic
        ) as runner:
            try:
                yield runner
            finally:
                # Closing waits for the drains; a gate the test left closed holds one.
                batch_fetch.release_all()

    @pytest.fixture
    def batch_immediate_runner(
        batch_db: dcache.DB, batch_fetch: ScriptedFetch, batch_clock: Clock
    ) -> Iterator[ImmediateRunner]:
        """A runner whose submit returns with the job already drained."""
        with ImmediateRunner(
            batch_db, batch_fetch, Config(), clock=batch_clock, monotonic=batch_clock.monotonic
        ) as runner:
            try:
                yield runner
            finally:
                batch_fetch.release_all()  # as batch_runner: before closing waits for drains
