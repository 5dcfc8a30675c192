"""A WSGI app for the multi-worker metrics test: the JSON API and /metrics on one runner.

gunicorn imports it in each worker (no ``--preload``), so each worker has its own runner
on the database named by ``OPS_TEST_DB``; every answer names its worker's pid.
"""

from __future__ import annotations

import os

from flask import Flask, Response

import batch
import batch.flask
import dcache
from batch._metrics import metrics


def fetch(target: batch.Target) -> batch.Result:
    if "fail" in target.url:
        raise batch.FetchError("no such page", hint="check the URL")
    return batch.Result(f"content of {target.url}")


db = dcache.DB.open(os.environ["OPS_TEST_DB"])
runner = batch.Runner(db, fetch, batch.Config(jobs_per_caller=1000, jobs_total=1000))
app = Flask(__name__)
batch.flask.init_app(app, runner, lambda req: (req.headers.get("X-Caller", "c"), "gold"))
app.register_blueprint(metrics(runner))


@app.after_request
def name_the_worker(resp: Response) -> Response:
    resp.headers["X-Worker-Pid"] = str(os.getpid())
    return resp
