"""A runner process that only sends webhooks, for tests/test_webhooks_procs.py.

``python tests/_webhook_child.py URL SECONDS LEASE``: opens the store at URL, runs a
Runner with webhooks (loopback allowed, the given claim lease) for SECONDS, then closes.
"""

from __future__ import annotations

import datetime as dt
import sys
import time

import batch
import dcache

SECRET = "whsec_a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s="  # base64 of b"k" * 32


def main() -> None:
    url, seconds, lease = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    hooks = batch.Webhooks(
        secret=SECRET,
        allow=["127.0.0.1"],
        poll=0.05,
        lease=dt.timedelta(seconds=lease),
        schedule=(dt.timedelta(milliseconds=50),) * 3,
    )
    db = dcache.DB.open(url)
    runner = batch.Runner(db, lambda t: batch.Result(""), webhooks=hooks)
    print("ready", flush=True)
    time.sleep(seconds)
    runner.close(timeout=5)
    db.close()


if __name__ == "__main__":
    main()
