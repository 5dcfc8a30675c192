"""Fetch functions the CLI tests load with ``--fetch cli_fetch:NAME`` (PYTHONPATH=tests/data).

Driven by environment variables so a test controls a child process without sleeps:

- ``BATCH_TEST_LOG``: each call appends the URL as a line (fetch counting).
- ``BATCH_TEST_STARTED``: ``blocking`` creates ``<dir>/started-<idx>`` when it starts.
- ``BATCH_TEST_GO``: ``blocking`` waits until this file exists (at most 60 s).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import batch


def _log(url: str) -> None:
    path = os.environ.get("BATCH_TEST_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(url + "\n")


def counting(target: batch.Target) -> batch.Result:
    """Succeed at once, logging the call; URLs containing "fail" fail."""
    _log(target.url)
    if "fail" in target.url:
        raise batch.FetchError("failed on purpose", hint="it is a test")
    return batch.Result(f"content of {target.url}", {"len": len(target.url)})


def blocking(target: batch.Target) -> batch.Result:
    """Log, announce the start, then block until the GO file exists."""
    _log(target.url)
    started = os.environ.get("BATCH_TEST_STARTED")
    if started:
        Path(started, f"started-{target.url.rsplit('/', 1)[-1]}").touch()
    go = Path(os.environ["BATCH_TEST_GO"])
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return batch.Result(f"content of {target.url}")


not_callable = 42
