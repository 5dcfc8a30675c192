"""The app the HTTP rows serve under gunicorn: the documented app, plus the floor view.

``create_app()`` is the tutorial's app factory (docs/tutorial/flask.md): the store from
``BATCH_DB``, one runner per process, the jobs API mounted by ``batch.flask.init_app``,
callers identified by a bearer token. ``GET /floor/<id>`` is the floor the issue measures
``GET /jobs/<id>`` against: a plain Flask view reading the same rows with one SQL statement
(the job joined to its targets) and answering them with ``jsonify``, no checks at all.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Request, abort, jsonify
from sqlalchemy import bindparam, select

import batch
import batch.flask
import dcache
from dcache._schema import jobs, targets

TOKEN = "bench-token"
CALLER = "bench"


def identify(request: Request) -> tuple[str, str] | None:
    token = request.headers.get("Authorization", "").removeprefix("Bearer ")
    return (CALLER, "web") if token == TOKEN else None


def _never(target: batch.Target) -> batch.Result:
    raise batch.FetchError("the bench serves stored jobs only")


def create_app() -> Flask:
    app = Flask(__name__)
    db = dcache.DB.open(os.environ["BATCH_DB"])
    runner = batch.Runner(db, _never)  # once per process, never per request
    batch.flask.init_app(app, runner, identify)

    floor = (
        select(jobs, targets.c.idx, targets.c.url, targets.c.status.label("t_status"))
        .add_columns(targets.c.result, targets.c.error, targets.c.hint)
        .select_from(jobs.join(targets, targets.c.job_id == jobs.c.id))
        .where(jobs.c.id == bindparam("id"))
        .order_by(targets.c.idx)
    )
    job_cols = [c.name for c in jobs.c]
    target_cols = ["idx", "url", "t_status", "result", "error", "hint"]

    @app.get("/floor/<job_id>")
    def floor_view(job_id: str) -> Any:
        with db.engine.connect() as conn:
            rows = conn.execute(floor, {"id": job_id}).mappings().all()
        if not rows:
            abort(404)
        job = {k: rows[0][k] for k in job_cols if k != "ttl_us"}
        return jsonify(job=job, targets=[{k: r[k] for k in target_cols} for r in rows])

    return app
