"""The client side of the partition test, run inside a network namespace.

``python _partition_child.py URL IO_TIMEOUT``: opens the store at URL (through the veth
pair), runs a job, fills its pool, prints ``ready``, and waits for a line on stdin. Then
(the parent has cut the link) it calls status, job, jobs, submit and cancel at once, each
on its own thread, and prints one JSON line: for each call, what it raised and how long
it took. A hung call shows as ``"hung"`` after ``IO_TIMEOUT + 10`` seconds.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import sys
import threading
import time
from typing import Any

import batch
import dcache


def main() -> None:
    url, io_timeout = sys.argv[1], float(sys.argv[2])
    db = dcache.DB.open(url, io_timeout=io_timeout, connect_timeout=io_timeout)
    runner = batch.Runner(
        db, lambda t: batch.Result(f"got {t.url}"), batch.Config(heartbeat=dt.timedelta(hours=1))
    )
    job_id, _ = runner.submit("alice", "user", [batch.Target("https://partition.example/0")])
    assert runner.wait(job_id, timeout=30) is not None
    with contextlib.ExitStack() as stack:  # pooled connections for the calls to meet
        for _ in range(6):
            stack.enter_context(db.engine.connect())
    print("ready", flush=True)
    sys.stdin.readline()

    calls = {
        "status": lambda: runner.status(job_id),
        "job": lambda: runner.job(job_id),
        "jobs": lambda: runner.jobs(),
        "submit": lambda: runner.submit(
            "bob", "user", [batch.Target("https://partition.example/1")]
        ),
        "cancel": lambda: runner.cancel(job_id),
    }
    out: dict[str, Any] = {}

    def call(name: str) -> None:
        t0 = time.monotonic()
        try:
            calls[name]()
        except BaseException as exc:
            out[name] = {
                "raised": f"{type(exc).__module__}.{type(exc).__name__}",
                "unavailable": isinstance(exc, dcache.StoreUnavailableError),
                "message": str(exc)[:300],
                "seconds": time.monotonic() - t0,
            }
        else:
            out[name] = {"raised": None, "seconds": time.monotonic() - t0}

    threads = [threading.Thread(target=call, args=(n,), daemon=True) for n in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + io_timeout + 10
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for name in calls:
        out.setdefault(name, "hung")
    print(json.dumps(out), flush=True)
    # The link is still cut: leave without closing the store (which would talk to it).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
