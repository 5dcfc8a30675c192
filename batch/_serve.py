"""``python -m batch serve``: the dashboard and the JSON API on loopback, for a local look.

For a script's user who wants to see (and cancel) the jobs in a database, not for
production: it binds 127.0.0.1 only, runs werkzeug's development server, and lets in any
request whose ``Host`` names the loopback address it listens on (refusing other hosts
defends against DNS rebinding from a web page). Mount :func:`batch.flask.dashboard`
behind your own authorization in a real app instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import dcache

from ._runner import Fetch, Runner

__all__ = ["add_parser", "build_app", "main"]

HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DB = "sqlite:///batch.sqlite3"
# Like the CLI's: the machine's own user may fetch local files and private addresses.
DEFAULT_FETCH = "batch._cli:local_fetch"
LOCAL_CALLER = ("local", "local")
"""The caller and caller class of every JSON API request to the local server."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` command to an ``argparse`` sub-parsers object; return its parser."""
    serve: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve the dashboard and the JSON API on 127.0.0.1 (local use, not production)",
        description="Serve the operators' dashboard (/batch/) and the JSON API (/jobs) for "
        "the database on 127.0.0.1 only, with werkzeug's development server. Every local "
        "request is let in without authentication: this is for a local look at a "
        "database, not for production. Ctrl-C stops it.",
    )
    serve.add_argument(
        "--db",
        metavar="URL",
        default=argparse.SUPPRESS,
        help=f"the database URL (default: $BATCH_DB, else {DEFAULT_DB})",
    )
    serve.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the port on 127.0.0.1 (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    serve.add_argument(
        "--fetch",
        metavar="MODULE:CALLABLE",
        default=DEFAULT_FETCH,
        help="the fetch function for jobs submitted here (default: the CLI's fetcher, "
        "which reads http, https and file URLs and reaches private and loopback "
        f"addresses: {DEFAULT_FETCH})",
    )
    serve.set_defaults(func=main)
    return serve


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {value}")
    return value


def _load_fetch(spec: str) -> Fetch:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--fetch {spec!r}: use module:callable (e.g. {DEFAULT_FETCH})")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise ValueError(f"--fetch {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def build_app(runner: Runner, port: int) -> Any:
    """The Flask app: the dashboard at ``/batch/``, the JSON API at ``/jobs``, metrics.

    Only requests whose ``Host`` is this server's loopback address get in.
    """
    from flask import Flask, Request, redirect

    from ._dashboard import dashboard  # Flask and Jinja2: the [flask] extra, only here
    from .flask import init_app

    hosts = {f"{HOST}:{port}", f"localhost:{port}"}

    def local(req: Request) -> bool:
        return req.host in hosts

    def identify(req: Request) -> tuple[str, str] | None:
        return LOCAL_CALLER if local(req) else None

    app = Flask("batch.serve")
    init_app(app, runner, identify)
    app.register_blueprint(dashboard(runner, local, url_prefix="/batch"))
    try:
        from prometheus_client import CollectorRegistry

        from ._metrics import metrics
    except ImportError:
        pass  # the [metrics] extra is optional
    else:
        app.register_blueprint(metrics(runner, registry=CollectorRegistry(), authorize=local))

    @app.get("/")
    def home() -> Any:
        return redirect("/batch/", code=302)

    return app


def say(text: str) -> None:
    """One line to stderr (stdout stays free for whatever a caller pipes)."""
    print(text, file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C or SIGTERM); return the exit status."""
    from werkzeug.serving import make_server

    url = getattr(args, "db", None) or os.environ.get("BATCH_DB") or DEFAULT_DB
    try:
        fetch = _load_fetch(args.fetch)
    except (ValueError, ImportError, AttributeError) as exc:
        say(f"cannot load the fetch function: {exc}")
        return 2
    try:
        db = dcache.DB.open(url)
    except (dcache.StoreError, ValueError, ImportError) as exc:
        say(f"cannot open the database {url!r}: {exc}")
        return 75 if isinstance(exc, dcache.StoreUnavailableError) else 1
    try:
        runner = Runner(db, fetch)
        try:
            # Bind first (port 0 picks one), then build the app for the port we got.
            server = make_server(HOST, args.port, None, threaded=True)  # type: ignore[arg-type]
        except OSError as exc:
            say(f"cannot listen on {HOST}:{args.port}: {exc.strerror or exc}")
            runner.close(timeout=5)
            return 1
        port = server.server_port
        server.app = build_app(runner, port)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupt)
        say(f"batch dashboard on http://{HOST}:{port}/batch/ (JSON API: /jobs)")
        say("for a local look only, not for production; Ctrl-C stops it")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
            runner.close(timeout=10)
    except dcache.StoreError as exc:
        say(f"database error: {exc}")
        return 75 if isinstance(exc, dcache.StoreUnavailableError) else 1
    finally:
        db.close()
    return 0
