"""The app tests/test_wsgi.py runs under gunicorn with several worker processes.

Configured by environment variables:

- ``BATCH_WSGI_DB``: the database URL (PostgreSQL in the test).
- ``BATCH_WSGI_DIR``: a folder of marker files through which the test drives the workers.

Each worker builds its runner once, at import (gunicorn imports the app in every worker,
after the fork), and writes ``ready-<pid>``. The fetch writes ``started-<pid>-<name>`` and
blocks until ``go-<name>`` or ``go-all`` exists. ``GET /_hold?token=T`` keeps a worker busy
(it writes ``held-<T>-<pid>``) until ``release-<T>`` or ``go-all`` exists. A request with
``X-Test-Delay: S`` first sleeps S seconds, so concurrent requests spread over workers.
Every response says which worker served it in ``X-Worker-Pid``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flask import Flask, Request, Response, request

import batch
import batch.flask
import dcache

DIR = Path(os.environ["BATCH_WSGI_DIR"])
PID = os.getpid()


def _wait_for(*names: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not any((DIR / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.01)


def fetch(target: batch.Target) -> batch.Result:
    name = target.url.rsplit("/", 1)[-1]
    (DIR / f"started-{PID}-{name}").touch()
    _wait_for(f"go-{name}", "go-all")
    return batch.Result(f"content of {target.url}", {"pid": PID})


def identify(req: Request) -> tuple[str, str] | None:
    caller = req.headers.get("X-Caller")
    return (caller, "test") if caller else None


runner = batch.Runner(dcache.DB.open(os.environ["BATCH_WSGI_DB"]), fetch)
app = Flask(__name__)
batch.flask.init_app(app, runner, identify)


@app.before_request
def _delay() -> None:
    delay = request.headers.get("X-Test-Delay")
    if delay:
        time.sleep(float(delay))


@app.get("/_hold")
def hold() -> str:
    token = request.args["token"]
    (DIR / f"held-{token}-{PID}").touch()
    _wait_for(f"release-{token}", "go-all", limit=30)
    return str(PID)


@app.after_request
def _who(resp: Response) -> Response:
    resp.headers["X-Worker-Pid"] = str(PID)
    return resp


(DIR / f"ready-{PID}").touch()
