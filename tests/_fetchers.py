"""Fake ``fetch`` functions for the runner tests: a recorder with Event-gated URLs.

Nothing here sleeps: a test holds a fetch with :meth:`FakeFetch.block`, learns that it
started with :meth:`FakeFetch.wait_entered`, and lets it go with :meth:`FakeFetch.release`.
Every wait is bounded by :data:`WAIT`, so a broken runner fails a test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from batch import Result, Target

__all__ = ["WAIT", "FakeFetch", "join_threads", "wait_for"]

WAIT = 10.0  # seconds any handshake may take before the test fails instead of hanging


class FakeFetch:
    """A fetch that records every call and holds chosen URLs until a test releases them.

    Unless told otherwise it returns ``Result(f"content of {url}", {"url": url})``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[str] = []
        self.thread_names: list[str] = []
        self.in_flight = 0
        self.peak = 0
        self._entered: dict[str, threading.Event] = {}
        self._gates: dict[str, threading.Event] = {}
        self._behaviours: dict[str, Callable[[Target], object]] = {}

    def block(self, *urls: str) -> None:
        """Hold every fetch of these URLs until :meth:`release`."""
        for url in urls:
            self._entered[url] = threading.Event()
            self._gates[url] = threading.Event()

    def behave(self, url: str, fn: Callable[[Target], object]) -> None:
        """Make the fetch of ``url`` return (or raise) whatever ``fn(target)`` does."""
        self._behaviours[url] = fn

    def wait_entered(self, url: str, timeout: float = WAIT) -> None:
        """Block until a fetch of ``url`` has started (and is being held)."""
        assert self._entered[url].wait(timeout), f"the fetch of {url} never started"

    def release(self, *urls: str) -> None:
        """Let held fetches of these URLs (and later ones) return."""
        for url in urls:
            self._gates[url].set()

    def release_all(self) -> None:
        """Let every held fetch return (teardown)."""
        for gate in list(self._gates.values()):
            gate.set()

    def count(self, url: str | None = None) -> int:
        """How many fetches started, of one URL or of all."""
        with self._lock:
            return len(self.calls) if url is None else self.calls.count(url)

    def __call__(self, target: Target) -> Result:
        url = target.url
        with self._lock:
            self.calls.append(url)
            self.thread_names.append(threading.current_thread().name)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            entered = self._entered.get(url)
            if entered is not None:
                entered.set()
                if not self._gates[url].wait(WAIT):
                    raise RuntimeError(f"test gate for {url} was never released")
            fn = self._behaviours.get(url)
            if fn is not None:
                return fn(target)  # type: ignore[return-value]
            return Result(content=f"content of {url}", meta={"url": url})
        finally:
            with self._lock:
                self.in_flight -= 1


def join_threads(names: Iterable[str], timeout: float = WAIT) -> None:
    """Join every live thread whose name is in ``names``; fail if one outlives ``timeout``."""
    wanted = set(names)
    for thread in threading.enumerate():
        if thread.name in wanted and thread is not threading.current_thread():
            thread.join(timeout)
            assert not thread.is_alive(), f"thread {thread.name} did not end"


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Wait until ``predicate()`` holds, checking every few milliseconds; fail after timeout.

    Only for states the library exposes no event for (e.g. "close() has begun").
    """
    pause = threading.Event()  # never set: a bounded, Event-based pause
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        pause.wait(0.005)
