"""Helpers for the dashboard, metrics and browser tests: apps, servers, HTML checks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from html.parser import HTMLParser

from flask import Flask, Request
from werkzeug.serving import make_server

import batch
from batch._dashboard import dashboard

OPERATOR_HEADER = "X-Test-Operator"
OPERATOR_COOKIE = "test_operator"
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 1">'


def is_operator(request: Request) -> bool:
    """The tests' authorize: a header (test client) or a cookie (browser) says so."""
    return (
        request.headers.get(OPERATOR_HEADER) == "yes"
        or request.cookies.get(OPERATOR_COOKIE) == "yes"
    )


def make_app(runner: batch.Runner, authorize: Callable[[Request], bool] = is_operator) -> Flask:
    """An app with the dashboard under /batch and the JSON API under /jobs."""
    import batch.flask

    app = Flask(__name__)
    batch.flask.init_app(app, runner, lambda req: ("api-user", "api"))
    app.register_blueprint(dashboard(runner, authorize))
    return app


@contextmanager
def serving(app: Flask) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) with werkzeug's threaded server."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="test-wsgi", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class PageAudit(HTMLParser):
    """What a strict CSP would block or what stored text could smuggle in, found in HTML."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[dict[str, str | None]] = []
        self.inline_scripts = 0
        self.style_tags = 0
        self.style_attrs = 0
        self.handlers: list[str] = []
        self.external: list[str] = []
        self.text: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "script":
            self.scripts.append(a)
            self._in_script = True
            if not a.get("src"):
                self.inline_scripts += 1
        if tag == "style":
            self.style_tags += 1
        if "style" in a:
            self.style_attrs += 1
        self.handlers += [k for k in a if k.startswith("on")]
        for key in ("src", "href", "action"):
            value = a.get(key) or ""
            if "://" in value or value.startswith("//"):
                self.external.append(value)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts += 1
        self.text.append(data)


def audit(html: str) -> PageAudit:
    """Parse a page and return what it holds (see :class:`PageAudit`)."""
    parser = PageAudit()
    parser.feed(html)
    parser.close()
    return parser


def assert_strict(html: str) -> PageAudit:
    """The page needs nothing a ``default-src 'self'`` policy forbids, and runs no stored text."""
    page = audit(html)
    assert page.inline_scripts == 0, "an inline script"
    assert page.style_tags == 0 and page.style_attrs == 0, "an inline style"
    assert page.handlers == [], f"event handler attributes: {page.handlers}"
    assert page.external == [], f"assets or links off the origin: {page.external}"
    assert [s.get("src") for s in page.scripts] == ["/batch/static/dashboard.js"]
    return page
