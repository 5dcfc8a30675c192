"""Shared fixtures: one store fixture parametrised over every backend.

Server URLs come from ``DCACHE_TEST_POSTGRES_URL`` and ``DCACHE_TEST_MYSQL_URL`` (the
defaults point at the local servers). A server that does not answer is a visible skip
locally, and a failure when ``CI`` or ``DCACHE_REQUIRE_SERVERS`` is set.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import dcache

POSTGRES_URL = os.environ.get(
    "DCACHE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get(
    "DCACHE_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test?charset=utf8mb4"
)
REQUIRE_SERVERS = bool(os.environ.get("CI") or os.environ.get("DCACHE_REQUIRE_SERVERS"))

BACKENDS = ["memory", "sqlite", "postgresql", "mariadb"]
SERVER_URLS = {"postgresql": POSTGRES_URL, "mariadb": MYSQL_URL}

_reachable: dict[str, str | None] = {}


def _check_server(name: str) -> None:
    """Skip (or, in CI, fail) when a server backend does not answer."""
    if name not in _reachable:
        try:
            eng = create_engine(SERVER_URLS[name])
            with eng.connect() as conn:
                conn.execute(text("SELECT 1"))
            eng.dispose()
            _reachable[name] = None
        except Exception as exc:
            _reachable[name] = f"{name} at {SERVER_URLS[name]} does not answer: {exc}"
    why = _reachable[name]
    if why is not None:
        if REQUIRE_SERVERS:
            pytest.fail(why)
        pytest.skip(why)


def wipe(db: dcache.DB) -> None:
    """Empty every table of a shared server database (the schema stays)."""
    with db.engine.begin() as conn:
        conn.execute(text("DELETE FROM batch_target"))
        conn.execute(text("DELETE FROM batch_job"))
        conn.execute(text("DELETE FROM batch_owner"))
        conn.execute(text("DELETE FROM batch_tombstone"))
        conn.execute(text("DELETE FROM batch_lock WHERE name <> 'global'"))


def backend_url(backend: str, tmp_path: Path) -> str:
    """A URL for the backend that a child process can open too (not ``memory``)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite3'}"
    _check_server(backend)
    return SERVER_URLS[backend]


def open_backend(backend: str, tmp_path: Path) -> dcache.DB:
    """Open a fresh, empty store on the backend."""
    if backend == "memory":
        return dcache.DB.memory()
    db = dcache.DB.open(backend_url(backend, tmp_path))
    if backend in SERVER_URLS:
        wipe(db)
    return db


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test."""
    name: str = request.param
    if name in SERVER_URLS:
        _check_server(name)
    return name


@pytest.fixture
def db(backend: str, tmp_path: Path) -> Iterator[dcache.DB]:
    """A fresh store on each backend; afterwards no connection may be left checked out."""
    store = open_backend(backend, tmp_path)
    try:
        yield store
        pool = store.engine.pool
        checked_out = getattr(pool, "checkedout", lambda: 0)()
        assert checked_out == 0, f"{checked_out} connection(s) left checked out"
    finally:
        store.close()


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL several processes can open: the SQLite file and the servers, emptied first."""
    url = backend_url(request.param, tmp_path)
    if request.param in SERVER_URLS:
        store = dcache.DB.open(url)
        wipe(store)
        store.close()
    return url


class Clock:
    """An injected clock: tests move time instead of sleeping."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self.now = start or dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, **kw: float) -> dt.datetime:
        self.now += dt.timedelta(**kw)
        return self.now


@pytest.fixture
def clock() -> Clock:
    """A clock at a fixed instant that tests move by hand."""
    return Clock()


# The network jail: any connect beyond 127.0.0.0/8 and ::1 fails the test (and its children).
from _netjail import netjail, netjail_check  # noqa: E402, F401
