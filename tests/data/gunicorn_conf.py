"""gunicorn settings for tests/test_wsgi.py.

The heavy libraries are imported once, here in the master, so the forked workers start
fast; each worker still imports the app itself and builds its own runner after the fork
(no ``preload_app``: a runner's threads and connections must never cross a fork).
"""

from __future__ import annotations

import os

import flask  # noqa: F401
import psycopg  # noqa: F401
import sqlalchemy  # noqa: F401

import batch.flask  # noqa: F401
import dcache  # noqa: F401

workers = 3
worker_class = "sync"
graceful_timeout = 5
loglevel = "warning"


def worker_int(worker: object) -> None:
    """On the test's quick shutdown (SIGINT), leave at once: interpreter teardown of a
    worker full of libraries takes seconds on a busy machine, and nothing is left to save."""
    os._exit(0)
