"""``python -m batch serve``: the dashboard and the JSON API on loopback, for a local look.

For a script's user who wants to see (and cancel) the jobs in a database, not for
production: it binds 127.0.0.1 only, runs werkzeug's development server, and lets in any
request whose ``Host`` names the loopback address it listens on (refusing other hosts
defends against DNS rebinding from a web page). Mount :func:`batch.flask.dashboard`
behind your own authorization in a real app instead.
"""

from __future__ import annotations

import argparse
import signal
import socket
import socketserver
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


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``, as werkzeug's server would bind it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug's does
        sock.bind((host, port))
        sock.listen(socketserver.TCPServer.request_queue_size)
    except BaseException:
        sock.close()
        raise
    return sock


def say(text: str) -> None:
    """One line to stderr (stdout stays free for whatever a caller pipes)."""
    print(text, file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C or SIGTERM); return the exit status.

    The fetch and the store are loaded and opened as the other commands do theirs: the
    same errors, exit statuses and hidden password.
    """
    from . import _cli  # imported here: the command line imports this module

    try:
        from werkzeug.serving import make_server
    except ImportError:
        _cli._say("serve needs Flask: pip install 'batch-dcache[flask]'")
        return _cli.EXIT_USAGE
    try:
        fetch: Fetch = _cli._load_fetch(args.fetch)
    except _cli.InputError as exc:
        _cli._say(str(exc))
        return _cli.EXIT_USAGE
    db = _cli._open_db(args)
    if isinstance(db, int):
        return db
    try:
        runner = Runner(db, fetch)
        try:
            # Bind first (port 0 picks one), then build the app for the port we got. The
            # socket is bound here, not by make_server: werkzeug prints its own lines and
            # calls sys.exit(1) when its bind fails, past this message and runner.close.
            sock = _listen(HOST, args.port)
        except OSError as exc:
            _cli._say(f"cannot listen on {HOST}:{args.port}: {exc.strerror or exc}")
            runner.close(timeout=5)
            return _cli.EXIT_FAILED
        try:
            with sock:  # the server listens on its own duplicate of the socket
                server = make_server(
                    HOST,
                    sock.getsockname()[1],
                    None,  # type: ignore[arg-type]
                    threaded=True,
                    fd=sock.fileno(),
                )
        except BaseException:
            runner.close(timeout=5)
            raise
        port = server.port
        server.app = build_app(runner, port)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            # Said inside the try: a Ctrl-C the moment the banner is out stops it cleanly.
            say(f"batch dashboard on http://{HOST}:{port}/batch/ (JSON API: /jobs)")
            say("for a local look only, not for production; Ctrl-C stops it")
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
            runner.close(timeout=10)
    except dcache.StoreError as exc:
        return _cli._store_failed(args, exc)
    finally:
        db.close()
    return _cli.EXIT_OK
