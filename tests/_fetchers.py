"""The runner tests' fake ``fetch`` (the kit's ScriptedFetch) and thread helpers.

Nothing here sleeps: a test holds a fetch with ``FakeFetch.block``, learns that it
started with ``FakeFetch.wait_entered``, and lets it go with ``FakeFetch.release``.
Every wait is bounded by :data:`WAIT`, so a broken runner fails a test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from batch.testing import WAIT, ScriptedFetch

__all__ = ["WAIT", "FakeFetch", "join_threads", "wait_for"]


# The project's tests use the kit it ships to apps (batch.testing): one fake fetch.
FakeFetch = ScriptedFetch


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
