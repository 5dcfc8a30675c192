"""Shared fixtures: one store fixture parametrised over every backend.

Server URLs come from ``DCACHE_TEST_POSTGRES_URL`` and ``DCACHE_TEST_MYSQL_URL`` (the
defaults point at the local servers). A server that does not answer is a visible skip
locally, and a failure when ``CI`` or ``DCACHE_REQUIRE_SERVERS`` is set.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import _pgbouncer
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

import dcache

POSTGRES_URL = os.environ.get(
    "DCACHE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# The local MariaDB has no TLS: saying so spares PyMySQL a TLS context per connection
# (docs/deployment.md); test_store checks the store in PyMySQL's default mode too.
MYSQL_URL = os.environ.get(
    "DCACHE_TEST_MYSQL_URL",
    "mysql+pymysql://root@127.0.0.1:3306/test?charset=utf8mb4&ssl_disabled=true",
)
REQUIRE_SERVERS = bool(os.environ.get("CI") or os.environ.get("DCACHE_REQUIRE_SERVERS"))

# Under ``pytest -n N`` (pytest-xdist) each worker process runs its tests on databases of
# its own beside the configured ones (``test`` -> ``test_gw0``, created in pytest_configure):
# workers never empty or lock each other's tables; a test that restarts a server runs alone
# (_whole_server_turn). The server-side checks the tests make (lock waiters, connections)
# already look at their own database.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_CONFIGURED_URLS = (POSTGRES_URL, MYSQL_URL)


def _worker_url(url: str) -> str:
    u = make_url(url)
    return u.set(database=f"{u.database}_{WORKER}").render_as_string(hide_password=False)


if WORKER:
    POSTGRES_URL, MYSQL_URL = (_worker_url(u) for u in _CONFIGURED_URLS)

# schemathesis 4 needs Python 3.11: the dev extras leave it out on 3.10 (pyproject.toml),
# and its tests with it. CI runs them (3.11).
collect_ignore = ["test_schemathesis.py"] if sys.version_info < (3, 11) else []

BACKENDS = ["memory", "sqlite", "postgresql", "mariadb"]
SERVER_URLS = {"postgresql": POSTGRES_URL, "mariadb": MYSQL_URL}

# PostgreSQL through a real PgBouncer in transaction pooling mode (tests/_pgbouncer.py),
# started on first use and stopped when the session ends: the backend "pgbouncer" joins
# the store, runner, process and race tests (PGBOUNCER_MODULES).
PGBOUNCER_MODULES = {
    "test_pgbouncer",
    "test_processes",
    "test_runner",
    "test_store",
    "test_store_races",
}
_bouncer: _pgbouncer.Bouncer | None = None


def pgbouncer_url() -> str:
    """The test PostgreSQL database through the session's PgBouncer (``?pgbouncer=true``)."""
    global _bouncer
    _check_server("postgresql")
    if _bouncer is None:
        if not Path(_pgbouncer.PGBOUNCER).exists():
            why = f"PgBouncer is not installed ({_pgbouncer.PGBOUNCER}); .ci/run installs it"
            if REQUIRE_SERVERS:
                pytest.fail(why)
            pytest.skip(why)
        _bouncer = _pgbouncer.start(POSTGRES_URL)
    return _bouncer.url()


def pytest_configure(config: pytest.Config) -> None:
    """A worker of ``pytest -n`` creates its own databases (see WORKER) before any test."""
    if not WORKER:
        return
    for url in _CONFIGURED_URLS:
        with contextlib.suppress(Exception):  # a server that does not answer: _check_server
            database_beside(url, f"_{WORKER}")


@pytest.fixture(autouse=True)
def _whole_server_turn(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under ``pytest -n``, a test marked ``whole_server`` (it restarts a shared server)
    runs alone: every test holds a shared lock on a file of the run for its whole life,
    such a test holds it exclusively. A turnstile lock, taken by all on the way in and
    kept by the exclusive test, stops the others from starving it."""
    if not WORKER:
        yield
        return
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # the run's, shared by its workers
    alone = request.node.get_closest_marker("whole_server") is not None
    with open(root / "turnstile.lock", "a") as turn, open(root / "servers.lock", "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turn, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Captured output with a lone surrogate (tests feed the store such text on purpose)
    escaped: pytest-xdist's workers send reports as UTF-8 and cannot send it raw."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [(k, _utf8_safe(v)) for k, v in report.sections]
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        if _utf8_safe(text) != text:
            report.longrepr = _utf8_safe(text)


def _utf8_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _bouncer is not None:
        _bouncer.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The PgBouncer backend for the modules that run through it."""
    bounced = metafunc.module.__name__.rpartition(".")[2] in PGBOUNCER_MODULES
    marks = getattr(metafunc.function, "pytestmark", [])
    named = {a.strip() for m in marks if m.name == "parametrize" for a in str(m.args[0]).split(",")}
    for fixture, params in (("backend", BACKENDS), ("shared_url", _SHARED)):
        if fixture in metafunc.fixturenames and fixture not in named:
            extra = ["pgbouncer"] if bounced else []
            metafunc.parametrize(fixture, [*params, *extra], indirect=True)


# What the forkserver imports once (see forkserver()): only what is importable without the
# tests directory on sys.path (the forkserver of Python 3.11 does not get the parent's).
FORKSERVER_PRELOAD = [
    "batch",
    "dcache",
    "sqlalchemy.dialects.sqlite.pysqlite",
    "sqlalchemy.dialects.postgresql.psycopg",
    "sqlalchemy.dialects.mysql.pymysql",
    "attrs",
]


def forkserver() -> multiprocessing.context.ForkServerContext:
    """Child processes forked from a server that imported the library once.

    A child costs a fork, not an interpreter's start-up and the imports (about a second
    each on a 2-core machine). The server starts clean, before any test's threads or
    connections, so each child is as fresh as a spawned one; it imports the test helper
    module its target lives in itself.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


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


def database_beside(url: str, suffix: str) -> str:
    """The server's database ``<url's database><suffix>``, created if missing; its URL."""
    u = make_url(url)
    name = f"{u.database}{suffix}"
    admin = create_engine(
        u.set(database="postgres") if u.get_backend_name() == "postgresql" else u,
        isolation_level="AUTOCOMMIT",
    )
    try:
        with admin.connect() as conn:
            if u.get_backend_name() == "postgresql":
                found = conn.execute(
                    text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
                ).first()
                if found is None:
                    conn.execute(text(f'CREATE DATABASE "{name}"'))
            else:
                conn.execute(text(f"CREATE DATABASE IF NOT EXISTS `{name}`"))
    finally:
        admin.dispose()
    return u.set(database=name).render_as_string(hide_password=False)


def failed_jobs(
    db: dcache.DB, n: int, at: dt.datetime, ttl: dt.timedelta = dt.timedelta(hours=1)
) -> list[str]:
    """``n`` one-target jobs of as many callers, submitted and failed in the store at
    ``at``: their leases lapse ``ttl`` later (a backlog for purge). Their ids."""
    ids = []
    for i in range(n):
        job_id = f"{i:032x}"
        out = db.submit(
            job_id=job_id,
            caller=f"c{i}",
            caller_class="web",
            idem_key=f"{i:064x}",
            targets=[dcache.NewTarget("https://e.com/")],
            ttl=ttl,
            jobs_per_caller=1,
            jobs_total=n,
            now=at,
        )
        assert out.kind == "created", out
        assert db.fail_job(job_id, "x", now=at)
        ids.append(job_id)
    return ids


def wipe(db: dcache.DB) -> None:
    """Empty every table of a shared server database (the schema stays)."""
    with db.engine.begin() as conn:
        conn.execute(text("DELETE FROM batch_target"))
        conn.execute(text("DELETE FROM batch_job"))
        conn.execute(text("DELETE FROM batch_owner"))
        conn.execute(text("DELETE FROM batch_tombstone"))
        conn.execute(text("DELETE FROM batch_outbox"))
        conn.execute(text("DELETE FROM batch_lock WHERE name <> 'global'"))


def is_server(backend: str) -> bool:
    """Whether the backend is a shared server database (emptied before each test)."""
    return backend in SERVER_URLS or backend == "pgbouncer"


def backend_url(backend: str, tmp_path: Path) -> str:
    """A URL for the backend that a child process can open too (not ``memory``)."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite3'}"
    if backend == "pgbouncer":
        return pgbouncer_url()
    _check_server(backend)
    return SERVER_URLS[backend]


def open_backend(backend: str, tmp_path: Path) -> dcache.DB:
    """Open a fresh, empty store on the backend."""
    if backend == "memory":
        return dcache.DB.memory()
    db = dcache.DB.open(backend_url(backend, tmp_path))
    if is_server(backend):
        wipe(db)
    return db


@pytest.fixture  # parametrised by pytest_generate_tests
def backend(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test."""
    name: str = request.param
    if name in SERVER_URLS:
        _check_server(name)
    elif name == "pgbouncer":
        pgbouncer_url()
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


_SHARED = ["sqlite", "postgresql", "mariadb"]


@pytest.fixture  # parametrised by pytest_generate_tests
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL several processes can open: the SQLite file and the servers, emptied first."""
    url = backend_url(request.param, tmp_path)
    if is_server(request.param):
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


def lock_waiters(db: dcache.DB) -> int:
    """How many transactions on this database wait for a row lock right now.

    Poll it no faster than every 0.2 s: InnoDB refreshes INNODB_TRX only when it was not
    read for 0.1 s, so a tight loop reads a stale table forever.
    """
    if db.dialect == "postgresql":
        q = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
    else:
        q = (
            "SELECT count(*) FROM information_schema.innodb_trx t"
            " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
            " WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()"
        )
    with db.engine.connect() as conn:
        return int(conn.exec_driver_sql(q).scalar_one())


@contextlib.contextmanager
def job_row_locked(db: dcache.DB, job_id: str) -> Iterator[None]:
    """Inside the block another connection holds the job's row locked (``FOR UPDATE``):
    a write to one of its targets waits at the server until the block ends."""
    with db.engine.connect() as blocker:
        blocker.begin()
        blocker.execute(text("SELECT id FROM batch_job WHERE id = :id FOR UPDATE"), {"id": job_id})
        try:
            yield
        finally:
            blocker.rollback()


def queue_behind_a_lock(
    store: dcache.DB,
    first: threading.Thread,
    rest: list[threading.Thread],
    at_server: dcache.DB | None = None,
) -> None:
    """Form one write batch for certain: start ``first`` (a write whose job's row is held
    by :func:`job_row_locked`) and wait until it leads ``store``'s writer (its batch taken,
    its commit under way), then start ``rest`` and wait until their outcomes are all
    queued behind it. With ``at_server`` (a store to ask with), also wait until the server
    shows the first write waiting for the lock: its statement has gone by.

    The batch forms when the lock is released, after this returns.
    """
    group = store._group
    first.start()
    deadline = time.monotonic() + 10
    while not (group._leading and not group._queued) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group._leading, "the first write never started its commit"
    if at_server is not None:
        while lock_waiters(at_server) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # see lock_waiters: no faster
        assert lock_waiters(at_server) == 1, "the first write never waited for the lock"
    for t in rest:
        t.start()
    wait_queued(store, len(rest))


def wait_queued(store: dcache.DB, n: int) -> None:
    """Wait (10 s at most) until ``n`` outcomes are queued behind ``store``'s writer's
    running commit."""
    group = store._group
    deadline = time.monotonic() + 10
    while len(group._queued) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(group._queued) == n


def default_sigint() -> None:
    """``preexec_fn`` of a child a test will SIGINT as Ctrl-C would: SIGINT's default
    action, as a terminal's foreground job has. A shell's background job (a CI run
    started with ``&``) inherits SIGINT ignored, and Python then leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_and_wait(proc: subprocess.Popen[str], timeout: float) -> int:
    """SIGINT a child and wait for its exit status; if it does not exit in time, fail
    with every thread's stack, which faulthandler prints on SIGABRT (start the child
    with ``PYTHONFAULTHANDLER=1`` and stderr piped)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        pytest.fail(f"the child did not exit {timeout} s after SIGINT; its threads:\n{err}")
