"""Database faults: outages mid-drain, an exhausted write budget, and the transient/permanent line.

The outage tests put a small TCP proxy (``_proxy.Proxy``) between the store and the shared
PostgreSQL or MariaDB server and cut it (every connection reset, new ones refused) for a
few seconds, the way Toxiproxy does; the servers keep running for everyone else. They are
marked ``slow``. One test really restarts PostgreSQL; it only runs when ``CI`` or
``DCACHE_ALLOW_PG_RESTART`` is set, since it cuts every other user of that server too.

The checkout tests kill the server sessions of a caller's engine between checkouts (a
restart, ``KILL`` or failover as the pool meets it) and check that every store call, and
a drain's write, sees ``StoreUnavailableError`` and recovers. The silent-server test runs
the store with ``io_timeout`` behind a stalled proxy.

The classification tests produce real driver errors cheaply (a held SQLite write lock, a
MariaDB lock wait of one second, a PostgreSQL deadlock) and check that
``dcache.is_transient`` and the store's translation put each on the side ``_errors.py``
says.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import socket
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from _proxy import Proxy, proxied
from conftest import MYSQL_URL, POSTGRES_URL, SERVER_URLS, backend_url, wipe
from sqlalchemy import bindparam, create_engine, event, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

import batch
import dcache
from dcache._schema import owners

WAIT = 30.0  # the most any handshake or drain may take before the test fails
OUTAGE = 5.0  # seconds the database is cut away
FAST = 3.0  # "quickly": the most a request-path call may take to fail during an outage
HEARTBEAT = dt.timedelta(seconds=0.2)
IO_TIMEOUT = 2.0  # DB.open(io_timeout=...) of the stores behind the proxy


# -- helpers ------------------------------------------------------------------------------


def url_of(name: str, idx: int) -> str:
    return f"https://faults.example/{name}/{idx}"


def content_for(url: str) -> str:
    """The exact content the fetch returns for ``url`` (non-ASCII on purpose)."""
    return f"contenu de {url} \N{CHECK MARK}"


def targets(name: str, n: int) -> list[batch.Target]:
    return [batch.Target(url_of(name, i)) for i in range(n)]


class CountingFetch:
    """Counts every fetch per URL; the fetch of ``hold`` signals ``entered`` and waits for ``go``.

    Holding the fetch lets a test cut the database after a result is fetched and before it
    is written, so the write has to cross the outage.
    """

    def __init__(self, hold: str | None = None) -> None:
        self.hold = hold
        self.entered = threading.Event()
        self.go = threading.Event()
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    def __call__(self, target: batch.Target) -> batch.Result:
        with self._lock:
            self.calls[target.url] += 1
        if target.url == self.hold:
            self.entered.set()
            if not self.go.wait(WAIT):
                raise RuntimeError("the test never released the held fetch")
        return batch.Result(content_for(target.url), {"url": target.url})


def thread_named(name: str) -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == name), None)


def pause(seconds: float) -> None:
    """Let real time pass (an outage lasts this long); never used to synchronise."""
    threading.Event().wait(max(0.0, seconds))


def poll(fn: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Call ``fn`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(dcache.StoreUnavailableError):
            value = fn()
            if value:
                return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout} s")
        pause(0.05)


def timed(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``fn`` and return what it raised (or None) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as exc:
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


def heartbeat_at(db: dcache.DB, owner: str) -> dt.datetime | None:
    with db.engine.connect() as conn:
        return conn.execute(
            select(owners.c.heartbeat_at).where(owners.c.owner == owner)
        ).scalar_one_or_none()


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fill_pool(db: dcache.DB, n: int = 3) -> None:
    """Open ``n`` pooled connections (all idle afterwards)."""
    with contextlib.ExitStack() as stack:
        for _ in range(n):
            stack.enter_context(db.engine.connect())


@attrs.define
class Cut:
    """A store reached through a proxy the test can cut, and a direct handle for checks."""

    backend: str
    proxy: Proxy
    db: dcache.DB  # through the proxy
    direct: dcache.DB  # straight to the server


@pytest.fixture(params=["postgresql", "mariadb"])
def cut(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cut]:
    url = backend_url(request.param, tmp_path)  # a visible skip (or a CI failure) if absent
    direct = dcache.DB.open(url)
    try:
        wipe(direct)
        with proxied(url) as (proxy, through):
            db = dcache.DB.open(through, io_timeout=IO_TIMEOUT, connect_timeout=IO_TIMEOUT)
            try:
                yield Cut(request.param, proxy, db, direct)
            finally:
                proxy.restore()
                db.close()
    finally:
        direct.close()


# -- outages through the proxy ------------------------------------------------------------


@pytest.mark.slow
def test_a_five_second_cut_mid_drain_loses_nothing_and_repeats_no_fetch(
    cut: Cut, caplog: pytest.LogCaptureFixture
) -> None:
    """The headline promise: an outage mid-drain costs time, never a result or a second fetch."""
    caplog.set_level(logging.WARNING)
    n, held = 6, 2
    fetch = CountingFetch(hold=url_of("a", held))
    runner = batch.Runner(cut.db, fetch, batch.Config(heartbeat=HEARTBEAT, jobs_per_caller=2))
    try:
        job_id, _ = runner.submit("alice", "user", targets("a", n))
        assert fetch.entered.wait(WAIT), "the drain never reached the held target"
        drain = thread_named(f"batch-job-{job_id}")
        beat = thread_named(f"batch-heartbeat-{runner.owner[:8]}")
        assert drain is not None and beat is not None

        cut.proxy.sever()
        cut_at = time.monotonic()
        fetch.go.set()  # target 2's result must now be written across the outage

        # Request-path calls fail fast with the retryable error instead of hanging.
        for what, call in (
            ("submit", lambda: runner.submit("bob", "user", targets("b", 1))),
            ("status", lambda: runner.status(job_id)),
            ("cancel", lambda: runner.cancel(batch.new_job_id())),
        ):
            raised, took = timed(call)
            assert isinstance(raised, dcache.StoreUnavailableError), (what, raised)
            assert isinstance(raised, batch.StoreError)
            assert took < FAST, f"{what} took {took:.1f} s to fail during the outage"

        pause(OUTAGE - (time.monotonic() - cut_at))
        assert drain.is_alive(), "the drain thread died during the outage"
        assert beat.is_alive(), "the heartbeat thread died during the outage"
        assert fetch.calls[url_of("a", held + 1)] == 0, "the drain went on without storing"
        restored_at = dcache.utcnow()
        cut.proxy.restore()

        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None
        assert (job.status, job.targets_done, job.error) == ("done", n, "")
        found = runner.status(job_id)
        assert found is not None
        for ts in found[1]:
            assert ts.status == "done", ts
            assert ts.result == batch.Result(content_for(ts.url), {"url": ts.url})
        assert dict(fetch.calls) == {url_of("a", i): 1 for i in range(n)}
        # The held result really crossed the outage: it was written after the restore.
        rows = cut.direct.get_job_with_targets(job_id)
        assert rows is not None
        written = rows[1][held].updated_at
        assert written is not None and written >= restored_at

        # The same runner takes new work at once: no restart, no new Runner.
        job2, reused = runner.submit("bob", "user", targets("b", 2))
        assert not reused
        done2 = runner.wait(job2, timeout=WAIT)
        assert done2 is not None and done2.status == "done"

        # The heartbeat resumed by itself and its thread is still there.
        poll(
            lambda: (heartbeat_at(cut.direct, runner.owner) or restored_at) > restored_at,
            "a heartbeat after the outage",
        )
        assert beat.is_alive()
    finally:
        fetch.go.set()
        cut.proxy.restore()
        runner.close(timeout=10)
    assert not any(
        r.levelno >= logging.CRITICAL for r in caplog.records if r.name.startswith("batch")
    ), "a 5 s outage is within the write budget: nothing may be given up"


@pytest.mark.slow
def test_an_exhausted_write_budget_gives_up_once_and_the_job_ends_failed_when_the_store_is_back(
    cut: Cut, caplog: pytest.LogCaptureFixture
) -> None:
    """Past Config.write_retry the drain stops loudly, refetches nothing, and the job is failed."""
    caplog.set_level(logging.WARNING)
    n, held = 4, 1
    fetch = CountingFetch(hold=url_of("x", held))
    cfg = batch.Config(write_retry=dt.timedelta(seconds=1), heartbeat=HEARTBEAT)
    runner = batch.Runner(cut.db, fetch, cfg)
    try:
        job_id, _ = runner.submit("alice", "user", targets("x", n))
        assert fetch.entered.wait(WAIT)
        drain = thread_named(f"batch-job-{job_id}")
        assert drain is not None
        cut.proxy.sever()
        fetch.go.set()
        drain.join(WAIT)
        assert not drain.is_alive(), "the drain kept retrying past its budget"

        critical = [
            r for r in caplog.records if r.levelno == logging.CRITICAL and r.name == "batch"
        ]
        assert critical, "giving up a fetched result must be logged at CRITICAL"
        assert any(
            getattr(r, "job_id", None) == job_id and job_id in r.getMessage() for r in critical
        ), [r.getMessage() for r in critical]
        assert dict(fetch.calls) == {url_of("x", 0): 1, url_of("x", 1): 1}

        cut.proxy.restore()
        job = poll(
            lambda: (j := runner.job(job_id)) is not None and j.status == "failed" and j,
            "the heartbeat failing the abandoned job",
        )
        assert job.error == "store unavailable"
        assert job.finished_at is not None
        assert job.targets_done == 1  # target 0 was stored before the cut
        found = runner.status(job_id)
        assert found is not None
        assert [t.status for t in found[1]] == ["done", "pending", "pending", "pending"]
        waited = runner.wait(job_id, timeout=WAIT)
        assert waited is not None and waited.status == "failed"
        # Nothing is fetched again to make up for the lost write.
        assert dict(fetch.calls) == {url_of("x", 0): 1, url_of("x", 1): 1}
        assert runner.db.live_batch_jobs_total() == 0
    finally:
        fetch.go.set()
        cut.proxy.restore()
        runner.close(timeout=10)


@pytest.mark.slow
def test_requests_fail_fast_when_the_server_stops_answering_without_a_reset(cut: Cut) -> None:
    """A silent partition must cost a request a 503 within io_timeout + 2 s, not a hung thread.

    The proxy keeps every connection open and moves no byte, new ones included, so no TCP
    timer notices: only the store's own deadline (``DB.open(io_timeout=...)``) does. A
    pre-ping that meets the silence fails the checkout instead of reconnecting (which
    would add a connect_timeout).
    """
    runner = batch.Runner(cut.db, CountingFetch(), batch.Config(heartbeat=dt.timedelta(hours=1)))
    live_id, _ = runner.submit("carol", "user", targets("s", 1))
    assert runner.wait(live_id, timeout=WAIT) is not None
    calls: dict[str, Callable[[], Any]] = {
        "status": lambda: runner.status(live_id),
        "job": lambda: runner.job(live_id),
        "jobs": lambda: runner.jobs(),
        "submit": lambda: runner.submit("dave", "user", targets("s", 2)),
        "cancel": lambda: runner.cancel(live_id),
    }
    outcomes: dict[str, tuple[BaseException | None, float]] = {}
    try:
        fill_pool(cut.db, 4)  # pooled connections exist: the stall meets them, not connect
        cut.proxy.stall()
        workers = [
            threading.Thread(
                target=lambda n=name, c=call: outcomes.__setitem__(n, timed(c)),
                name=f"stalled-{name}",
                daemon=True,
            )
            for name, call in calls.items()
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(IO_TIMEOUT + 2 + 5)
        hung = [w.name for w in workers if w.is_alive()]
        cut.proxy.restore()  # unblocks a hung call
        for w in workers:
            w.join(WAIT)
        assert not hung, f"{hung} hung while the server did not answer"
        for name, (raised, took) in outcomes.items():
            assert isinstance(raised, dcache.StoreUnavailableError), (name, repr(raised))
            assert took < IO_TIMEOUT + 2, f"{name} took {took:.1f} s to fail"
        # Back to normal at once after the partition heals.
        found = runner.status(live_id)
        assert found is not None and found[0].status == "done"
    finally:
        cut.proxy.restore()
        runner.close(timeout=10)


@pytest.mark.slow
@pytest.mark.whole_server
@pytest.mark.skipif(
    not (os.environ.get("CI") or os.environ.get("DCACHE_ALLOW_PG_RESTART")),
    reason="restarts the shared PostgreSQL server: set CI or DCACHE_ALLOW_PG_RESTART=1",
)
def test_a_real_postgresql_restart_mid_drain_loses_nothing(tmp_path: Path) -> None:
    """The proxy imitates an outage; this one is the real thing: the server stops and starts."""
    url = backend_url("postgresql", tmp_path)
    version = sorted(os.listdir("/etc/postgresql"))[-1]

    def ctl(action: str) -> None:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
            check=True,
            timeout=120,
            capture_output=True,
        )

    def answering() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", 5432)) == 0

    n, held = 5, 2
    fetch = CountingFetch(hold=url_of("pg", held))
    db = dcache.DB.open(url)
    wipe(db)
    runner = batch.Runner(db, fetch, batch.Config(heartbeat=HEARTBEAT, jobs_per_caller=2))
    stopped = False
    try:
        job_id, _ = runner.submit("alice", "user", targets("pg", n))
        assert fetch.entered.wait(WAIT)
        ctl("stop")
        stopped = True
        fetch.go.set()
        raised, took = timed(lambda: runner.status(job_id))
        assert isinstance(raised, dcache.StoreUnavailableError), raised
        assert took < FAST + 5
        drain = thread_named(f"batch-job-{job_id}")
        assert drain is not None and drain.is_alive()
        ctl("start")
        stopped = False
        job = runner.wait(job_id, timeout=60)
        assert job is not None and (job.status, job.targets_done) == ("done", n)
        assert dict(fetch.calls) == {url_of("pg", i): 1 for i in range(n)}
        job2, _ = runner.submit("bob", "user", targets("pg-b", 1))
        done2 = runner.wait(job2, timeout=WAIT)
        assert done2 is not None and done2.status == "done"
        beat = thread_named(f"batch-heartbeat-{runner.owner[:8]}")
        assert beat is not None and beat.is_alive()
    finally:
        fetch.go.set()
        if stopped or not answering():
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                ctl("start")
        deadline = time.monotonic() + 60
        while not answering() and time.monotonic() < deadline:
            pause(0.5)
        runner.close(timeout=10)
        db.close()


# -- connections lost between checkouts (a restart, KILL, failover) ------------------------


_WHO = {"postgresql": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}


class Sessions:
    """The server session id of every connection a caller's engine opens, to kill them."""

    def __init__(self, backend: str, engine: Any) -> None:
        self.backend = backend
        self.ids: list[int] = []
        self._admin = create_engine(engine.url, poolclass=NullPool)
        event.listen(engine, "connect", self._record)

    def _record(self, dbapi_conn: Any, _rec: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(_WHO[self.backend])
        self.ids.append(int(cur.fetchone()[0]))
        cur.close()
        dbapi_conn.commit()

    def kill_all(self) -> int:
        """Kill every recorded session that still exists; wait until the server let it go."""
        with self._admin.connect() as admin:
            if self.backend == "postgresql":
                alive = "SELECT pid FROM pg_stat_activity WHERE pid = ANY(:ids)"
                kill = "SELECT pg_terminate_backend(:id)"
            else:
                alive = "SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN :ids"
                kill = "KILL CONNECTION :id"
            query = text(alive)
            if self.backend == "mariadb":
                query = query.bindparams(bindparam("ids", expanding=True))
            targets = [int(i) for i in admin.execute(query, {"ids": self.ids}).scalars()]
            admin.commit()
            for sid in targets:
                admin.execute(text(kill), {"id": sid})
                admin.commit()
            deadline = time.monotonic() + WAIT
            while admin.execute(query, {"ids": targets}).first() is not None:
                admin.commit()
                assert time.monotonic() < deadline, "the server never let the sessions go"
                pause(0.02)
        return len(targets)

    def close(self) -> None:
        self._admin.dispose()


@contextlib.contextmanager
def caller_store(backend: str, tmp_path: Path) -> Iterator[tuple[dcache.DB, Sessions]]:
    """``DB(engine)`` on a caller's engine with no pre-ping: a dead pooled session is used."""
    engine = create_engine(backend_url(backend, tmp_path), pool_size=3, max_overflow=0)
    sessions = Sessions(backend, engine)
    db = dcache.DB(engine)
    try:
        wipe(db)
        yield db, sessions
    finally:
        db.close()
        engine.dispose()
        sessions.close()


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_a_session_lost_between_checkouts_is_store_unavailable_on_every_call(
    backend: str, tmp_path: Path
) -> None:
    """A pooled connection the server dropped must cost a 503 on every call, never a driver error.

    MariaDB's per-checkout ``SET SESSION TRANSACTION ISOLATION LEVEL`` + COMMIT raised
    ``pymysql`` errors past SQLAlchemy's wrapping (HTTP 500, and the drain skipped its retry).
    """
    with caller_store(backend, tmp_path) as (db, sessions):
        job = db.submit(
            job_id=batch.new_job_id(),
            caller="alice",
            caller_class="user",
            idem_key="k" * 64,
            targets=[dcache.NewTarget(url_of("k", 0), "{}")],
            ttl=dt.timedelta(hours=1),
            jobs_per_caller=8,
            jobs_total=8,
        ).job
        assert job is not None
        calls: dict[str, Callable[[], Any]] = {
            "get_job": lambda: db.get_job(job.id),
            "get_job_with_targets": lambda: db.get_job_with_targets(job.id),
            "list_jobs": lambda: db.list_jobs(),
            "live_batch_jobs_total": db.live_batch_jobs_total,
            "cancel": lambda: db.cancel(batch.new_job_id()),
            "heartbeat": lambda: db.heartbeat("owner-k"),
            "submit": lambda: db.submit(
                job_id=batch.new_job_id(),
                caller="bob",
                caller_class="user",
                idem_key="b" * 64,
                targets=[dcache.NewTarget(url_of("b", 0), "{}")],
                ttl=dt.timedelta(hours=1),
                jobs_per_caller=8,
                jobs_total=8,
            ),
            "write_target": lambda: db.write_target(
                job.id, 0, status="failed", error="x", ttl=dt.timedelta(hours=1)
            ),
        }
        # The heartbeat and the group writer have pools of their own: open theirs too, so
        # every call meets a pooled session the server dropped.
        warm = db.submit(
            job_id=batch.new_job_id(),
            caller="carol",
            caller_class="user",
            idem_key="w" * 64,
            targets=[
                dcache.NewTarget(url_of("w", 0), "{}"),
                dcache.NewTarget(url_of("w", 1), "{}"),
            ],
            ttl=dt.timedelta(hours=1),
            jobs_per_caller=8,
            jobs_total=8,
        ).job
        assert warm is not None
        db.heartbeat("owner-k")
        db.write_target(warm.id, 0, status="failed", error="x", ttl=dt.timedelta(hours=1))
        for name, call in calls.items():
            # Idle connections killed in an earlier round (for another pool's call) would
            # fail their reset and be replaced unnoticed: start each round with live ones.
            db.engine.pool.dispose()
            fill_pool(db)
            assert sessions.kill_all() >= 1
            raised, _ = timed(call)
            assert isinstance(raised, dcache.StoreUnavailableError), (name, repr(raised))
            assert isinstance(cause(raised), sa_exc.DBAPIError), (name, repr(cause(raised)))
            # The dead connection was dropped, not pooled again: the retry just works.
            raised, _ = timed(call)
            assert raised is None, (name, repr(raised))
        assert db.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_the_drain_retries_a_write_whose_checkout_finds_a_dead_session(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write that meets a dropped session (its own and the pool's) is retried, never given up."""
    caplog.set_level(logging.WARNING)
    n, held = 3, 1
    fetch = CountingFetch(hold=url_of("d", held))
    with caller_store(backend, tmp_path) as (db, sessions):
        runner = batch.Runner(db, fetch, batch.Config(heartbeat=dt.timedelta(hours=1)))
        try:
            job_id, _ = runner.submit("alice", "user", targets("d", n))
            assert fetch.entered.wait(WAIT)
            fill_pool(db, 2)  # the drain holds one connection; the others idle in the pool
            assert sessions.kill_all() >= 2
            fetch.go.set()
            job = runner.wait(job_id, timeout=WAIT)
            assert job is not None
            assert (job.status, job.targets_done, job.error) == ("done", n, "")
            assert dict(fetch.calls) == {url_of("d", i): 1 for i in range(n)}
        finally:
            fetch.go.set()
            runner.close(timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]


# -- classification: transient or permanent, with real driver errors ----------------------


def cause(exc: BaseException) -> BaseException:
    assert exc.__cause__ is not None, "the store's error must chain the driver's"
    return exc.__cause__


def test_sqlite_database_is_locked_past_busy_timeout_is_transient(tmp_path: Path) -> None:
    """A writer stuck behind another's lock is an outage to retry, not a broken store."""
    path = tmp_path / "locked.sqlite3"
    db = dcache.DB.open(f"sqlite:///{path}", busy_timeout=0.1)
    holder = sqlite3.connect(path, isolation_level=None, timeout=0.1)
    runner = batch.Runner(db, CountingFetch(), batch.Config(heartbeat=dt.timedelta(hours=1)))
    try:
        holder.execute("BEGIN IMMEDIATE")
        raised, took = timed(lambda: db.cancel(batch.new_job_id()))
        assert isinstance(raised, dcache.StoreUnavailableError), raised
        assert "database is locked" in str(cause(raised))
        assert dcache.is_transient(cause(raised))
        assert took < FAST
        raised, took = timed(lambda: runner.submit("alice", "user", targets("l", 1)))
        assert isinstance(raised, dcache.StoreUnavailableError), raised
        assert took < FAST
        holder.execute("ROLLBACK")
        assert db.cancel(batch.new_job_id()) is False  # the store works again at once
    finally:
        with contextlib.suppress(sqlite3.Error):
            holder.execute("ROLLBACK")
        holder.close()
        runner.close(timeout=10)
        db.close()


def test_a_checkout_timeout_of_an_exhausted_pool_is_transient(tmp_path: Path) -> None:
    """Every pooled connection busy is a moment's congestion: retry, don't fail the job."""
    db = dcache.DB.open(
        f"sqlite:///{tmp_path / 'pool.sqlite3'}", pool_size=1, max_overflow=0, pool_timeout=0.1
    )
    try:
        with db.engine.connect():
            raised, _ = timed(lambda: db.get_job(batch.new_job_id()))
        assert isinstance(raised, dcache.StoreUnavailableError), raised
        assert isinstance(cause(raised), sa_exc.TimeoutError)
        assert db.get_job(batch.new_job_id()) is None
    finally:
        db.close()


def test_sqlite_unable_to_open_the_file_is_permanent(tmp_path: Path) -> None:
    """A path that cannot exist will not heal by retrying: the caller must see StoreError."""
    missing = tmp_path / "no" / "such" / "dir" / "x.sqlite3"
    with pytest.raises(dcache.StoreError) as info:
        dcache.DB.open(f"sqlite:///{missing}")
    assert not isinstance(info.value, dcache.StoreUnavailableError)


def test_integrity_errors_are_permanent() -> None:
    """A duplicate key is an error in what was asked: retrying it can never succeed."""
    db = dcache.DB.memory()
    try:
        with db.engine.connect() as conn, pytest.raises(sa_exc.IntegrityError) as dup:
            conn.execute(text("INSERT INTO batch_lock (name) VALUES ('global')"))
        assert not dcache.is_transient(dup.value)
        assert type(dcache._errors.translate(dup.value)) is dcache.StoreError
    finally:
        db.close()


def test_server_syntax_errors_are_permanent(postgres_url: str, mariadb_url: str) -> None:
    """Bad SQL on a server (42601 / 1064) is a bug to report, not an outage to wait out."""
    for url in (postgres_url, mariadb_url):
        eng = create_engine(url)
        try:
            with eng.connect() as conn, pytest.raises(sa_exc.DBAPIError) as bad:
                conn.execute(text("SELEKT 1"))
            assert not dcache.is_transient(bad.value), url
        finally:
            eng.dispose()


def test_sqlite_errors_no_retry_can_fix_are_permanent(tmp_path: Path) -> None:
    """A read-only file or bad SQL must surface as StoreError now, not after a retry budget."""
    path = tmp_path / "ro.sqlite3"
    dcache.DB.open(f"sqlite:///{path}").close()
    eng = create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    try:
        with eng.connect() as conn:
            with pytest.raises(sa_exc.OperationalError) as readonly:
                conn.execute(text("INSERT INTO batch_lock (name) VALUES ('x')"))
            conn.rollback()
            with pytest.raises(sa_exc.OperationalError) as syntax:
                conn.execute(text("SELEKT 1"))
    finally:
        eng.dispose()
    assert "readonly" in str(readonly.value)
    assert not dcache.is_transient(syntax.value)
    assert not dcache.is_transient(readonly.value)


def raw_error(fn: Callable[[], Any]) -> BaseException:
    """Run a raw driver call that must fail; return what it raised (the driver's own type)."""
    try:
        fn()
    except Exception as exc:
        assert not isinstance(exc, sa_exc.SQLAlchemyError)
        return exc
    raise AssertionError("the driver call did not fail")


def test_raw_driver_errors_are_translated_like_wrapped_ones(
    tmp_path: Path, postgres_url: str, mariadb_url: str
) -> None:
    """The hot paths and pool events meet the driver directly: its errors must become StoreError.

    Each case is a real error of a real driver call, outside SQLAlchemy, sorted on the
    same line as its wrapped twin: a lost connection or a lock is transient, bad SQL not.
    """
    import psycopg
    import pymysql

    cases: list[tuple[str, BaseException, bool]] = []
    path = tmp_path / "raw.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN IMMEDIATE")
        cases.append(("sqlite locked", raw_error(lambda: other.execute("BEGIN IMMEDIATE")), True))
        cases.append(("sqlite syntax", raw_error(lambda: other.execute("SELEKT 1")), False))
    finally:
        holder.close()
        other.close()

    pg_url = make_url(postgres_url)
    pg = psycopg.connect(
        host=pg_url.host, port=pg_url.port or 5432, user=pg_url.username, dbname=pg_url.database
    )
    try:
        cases.append(("psycopg syntax", raw_error(lambda: pg.execute("SELEKT 1")), False))
        pg.rollback()
        pid = pg.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        pg.commit()
        with psycopg.connect(
            host=pg_url.host,
            port=pg_url.port or 5432,
            user=pg_url.username,
            dbname=pg_url.database,
            autocommit=True,  # pg_stat_activity is a snapshot per transaction
        ) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            gone = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
            poll(lambda: admin.execute(gone, (pid,)).fetchone() is None, "the session gone")
        cases.append(("psycopg terminated", raw_error(lambda: pg.execute("SELECT 1")), True))
        cases.append(("psycopg closed", raw_error(lambda: pg.execute("SELECT 1")), True))
    finally:
        pg.close()

    my_url = make_url(mariadb_url)
    my = pymysql.connect(
        host=my_url.host, port=my_url.port or 3306, user=my_url.username, database=my_url.database
    )
    try:
        cur = my.cursor()
        cases.append(("pymysql syntax", raw_error(lambda: cur.execute("SELEKT 1")), False))
        cur.execute("SELECT CONNECTION_ID()")
        sid = cur.fetchone()[0]  # type: ignore[index]
        admin_my = pymysql.connect(host=my_url.host, port=my_url.port or 3306, user=my_url.username)
        with admin_my.cursor() as acur:
            acur.execute(f"KILL CONNECTION {int(sid)}")
            gone = "SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = %s"
            poll(lambda: acur.execute(gone, (sid,)) == 0, "the session gone")
        admin_my.close()
        cases.append(("pymysql killed", raw_error(lambda: cur.execute("SELECT 1")), True))
        cases.append(("pymysql closed", raw_error(lambda: my.cursor().execute("SELECT 1")), True))
    finally:
        with contextlib.suppress(Exception):
            my.close()

    for name, exc, transient in cases:
        assert dcache.is_transient(exc) is transient, (name, repr(exc))

        @dcache._errors.wrap_errors
        def store_call(exc: BaseException = exc) -> None:
            raise exc

        with pytest.raises(dcache.StoreError) as info:
            store_call()
        assert isinstance(info.value, dcache.StoreUnavailableError) is transient, name
        assert info.value.__cause__ is exc, name


def test_exceptions_that_are_not_database_errors_are_never_transient() -> None:
    """Only driver errors are classified; a bug elsewhere is not an outage to retry."""
    assert not dcache.is_transient(ValueError("database is locked"))
    assert not dcache.is_transient(RuntimeError("connection reset"))
    assert not dcache.is_transient(KeyboardInterrupt())


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_a_server_that_refuses_connections_is_transient_and_fails_fast(backend: str) -> None:
    """A closed port (a server still starting) is an outage, reported within seconds."""
    url = {
        "postgresql": f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/test_chaos",
        "mariadb": f"mysql+pymysql://root@127.0.0.1:{closed_port()}/test_chaos",
    }[backend]
    raised, took = timed(lambda: dcache.DB.open(url))
    assert isinstance(raised, dcache.StoreUnavailableError), raised
    assert dcache.is_transient(cause(raised))
    assert took < FAST


@contextlib.contextmanager
def two_connections(url: str, **engine: Any) -> Iterator[tuple[Any, Any]]:
    """Two raw connections to a server database whose schema exists (a lock row to fight over)."""
    dcache.DB.open(url).close()  # creates the schema and the 'global' lock row if missing
    eng = create_engine(url, **engine)
    a, b = eng.connect(), eng.connect()
    try:
        with a.begin():
            a.execute(text("DELETE FROM batch_lock WHERE name IN ('fault-x', 'fault-y')"))
            a.execute(text("INSERT INTO batch_lock (name) VALUES ('fault-x'), ('fault-y')"))
        yield a, b
    finally:
        for c in (a, b):
            with contextlib.suppress(sa_exc.SQLAlchemyError):
                c.rollback()
            c.close()
        eng.dispose()


def lock_row(conn: Any, name: str) -> None:
    conn.execute(text("SELECT name FROM batch_lock WHERE name = :n FOR UPDATE"), {"n": name})


def deadlock(a: Any, b: Any) -> sa_exc.DBAPIError:
    """Cross two row locks between ``a`` and ``b``; return the error of the victim."""
    errors: list[BaseException] = []
    a.begin()
    b.begin()
    lock_row(a, "fault-x")
    lock_row(b, "fault-y")

    def a_wants_y() -> None:
        try:
            lock_row(a, "fault-y")
        except BaseException as exc:
            errors.append(exc)
            a.rollback()

    t = threading.Thread(target=a_wants_y, daemon=True)
    t.start()
    try:
        lock_row(b, "fault-x")
    except BaseException as exc:
        errors.append(exc)
        b.rollback()
    else:
        b.rollback()  # b won: a is the victim; release b's locks so a's wait ends
    t.join(WAIT)
    assert not t.is_alive()
    assert len(errors) == 1, errors
    assert isinstance(errors[0], sa_exc.DBAPIError), errors[0]
    return errors[0]


@pytest.fixture
def mariadb_url(tmp_path: Path) -> str:
    return backend_url("mariadb", tmp_path)


@pytest.fixture
def postgres_url(tmp_path: Path) -> str:
    return backend_url("postgresql", tmp_path)


def test_mariadb_lock_wait_timeout_1205_is_transient(mariadb_url: str) -> None:
    """A lock wait that timed out (1205) asks for a retry; it says nothing about the data."""
    with two_connections(mariadb_url) as (a, b):
        a.begin()
        lock_row(a, "fault-x")
        b.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
        b.commit()
        b.begin()
        with pytest.raises(sa_exc.OperationalError) as info:
            lock_row(b, "fault-x")
        assert info.value.orig.args[0] == 1205
        assert dcache.is_transient(info.value)


def test_mariadb_submit_stuck_behind_a_lock_raises_store_unavailable(mariadb_url: str) -> None:
    """Through the public API, a lock wait timeout surfaces as the retryable error (503)."""
    db = dcache.DB.open(
        mariadb_url, connect_args={"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
    )
    wipe(db)
    runner = batch.Runner(db, CountingFetch(), batch.Config(heartbeat=dt.timedelta(hours=1)))
    try:
        with two_connections(mariadb_url) as (a, _b):
            a.begin()
            lock_row(a, "global")
            raised, took = timed(lambda: runner.submit("alice", "user", targets("m", 1)))
            a.rollback()
        assert isinstance(raised, dcache.StoreUnavailableError), raised
        assert took < FAST + 2
        assert runner.db.live_batch_jobs_total() == 0
    finally:
        runner.close(timeout=10)
        db.close()


def test_mariadb_deadlock_1213_is_transient(mariadb_url: str) -> None:
    """The deadlock victim's transaction was rolled back whole: running it again is safe."""
    with two_connections(mariadb_url) as (a, b):
        err = deadlock(a, b)
    assert err.orig.args[0] == 1213
    assert dcache.is_transient(err)


def test_postgresql_deadlock_40p01_is_transient(postgres_url: str) -> None:
    """PostgreSQL's deadlock victim may retry, like MariaDB's."""
    with two_connections(postgres_url) as (a, b):
        for c in (a, b):
            c.execute(text("SET deadlock_timeout = '50ms'"))
            c.commit()
        err = deadlock(a, b)
    assert err.orig.sqlstate == "40P01"
    assert dcache.is_transient(err)


def test_postgresql_serialization_failure_40001_is_transient(postgres_url: str) -> None:
    """A serialization failure is the textbook retryable error."""
    with two_connections(postgres_url) as (a, b):
        a.execution_options(isolation_level="REPEATABLE READ")
        a.begin()
        a.execute(text("SELECT count(*) FROM batch_lock"))
        b.execute(text("UPDATE batch_lock SET name = name WHERE name = 'fault-x'"))
        b.commit()
        with pytest.raises(sa_exc.OperationalError) as info:
            a.execute(text("UPDATE batch_lock SET name = name WHERE name = 'fault-x'"))
    assert info.value.orig.sqlstate == "40001"
    assert dcache.is_transient(info.value)


def _lock_wait_cut_by(url: str, setting: str) -> Any:
    """The error of a row-lock wait on ``url`` that ``setting`` (run first in the waiting
    session) cuts short."""
    with two_connections(url) as (a, b):
        a.begin()
        lock_row(a, "fault-x")
        b.execute(text(setting))
        b.commit()
        b.begin()
        with pytest.raises(sa_exc.OperationalError) as info:
            lock_row(b, "fault-x")
    return info.value


def test_postgresql_lock_timeout_55p03_is_transient_like_mariadb_1205(postgres_url: str) -> None:
    """A lock wait that an operator's lock_timeout cut short (55P03) is worth a retry.

    It is the same event as MariaDB's lock wait timeout (1205) and SQLite's busy timeout,
    which are retried too; treating them alike keeps behaviour the same on every backend.
    """
    err = _lock_wait_cut_by(postgres_url, "SET lock_timeout = '100ms'")
    assert err.orig.sqlstate == "55P03"
    assert dcache.is_transient(err)
    translated = dcache._errors.translate(err)
    assert type(translated) is dcache.StoreUnavailableError


def test_postgresql_statement_timeout_57014_is_transient(postgres_url: str) -> None:
    """A statement the server cancelled (statement_timeout, an operator's
    pg_cancel_backend) says nothing about its data: retried, as a lock timeout is, so a
    drain's fetched result is stored once the wait is over, not thrown away as refused."""
    err = _lock_wait_cut_by(postgres_url, "SET statement_timeout = '100ms'")
    assert err.orig.sqlstate == "57014"
    assert type(dcache._errors.translate(err)) is dcache.StoreUnavailableError


@pytest.mark.parametrize("how", ["max_statement_time", "kill_query"])
def test_mariadb_interrupted_statement_is_transient(mariadb_url: str, how: str) -> None:
    """MariaDB's statement timeout (1969) and an operator's KILL QUERY (1317) likewise."""
    with two_connections(mariadb_url) as (a, b):
        a.begin()
        lock_row(a, "fault-x")
        if how == "max_statement_time":
            b.execute(text("SET SESSION max_statement_time = 0.2"))
        b.commit()
        b.begin()
        killer = None
        if how == "kill_query":
            victim = b.execute(text("SELECT CONNECTION_ID()")).scalar()
            killer = threading.Timer(0.3, lambda: a.execute(text(f"KILL QUERY {int(victim)}")))
            killer.start()
        with pytest.raises(sa_exc.OperationalError) as info:
            lock_row(b, "fault-x")
        if killer is not None:
            # b's error may come back before the KILL's own answer on a: a is the
            # timer's until then (two threads on one connection garble its packets).
            killer.join(10)
        a.rollback()
    assert info.value.orig.args[0] == (1969 if how == "max_statement_time" else 1317)
    assert type(dcache._errors.translate(info.value)) is dcache.StoreUnavailableError


def test_a_session_killed_by_the_server_is_transient(postgres_url: str, mariadb_url: str) -> None:
    """A server restart kills every session (57P01 / KILL): the next statement must retry."""
    for url, who, kill in (
        (postgres_url, "SELECT pg_backend_pid()", "SELECT pg_terminate_backend(:pid)"),
        (mariadb_url, "SELECT CONNECTION_ID()", "KILL CONNECTION :pid"),
    ):
        eng = create_engine(url)
        try:
            with eng.connect() as victim, eng.connect() as admin:
                pid = victim.execute(text(who)).scalar()
                victim.commit()
                admin.execute(text(kill), {"pid": pid})
                admin.commit()
                with pytest.raises(sa_exc.DBAPIError) as info:
                    victim.execute(text("SELECT 1"))
            assert dcache.is_transient(info.value), info.value
        finally:
            eng.dispose()


def test_a_dropped_connection_is_transient_on_both_servers(
    postgres_url: str, mariadb_url: str
) -> None:
    """A connection reset under a statement is the outage case the drain retries."""
    for url in (postgres_url, mariadb_url):
        with proxied(url) as (proxy, through):
            eng = create_engine(through)
            try:
                conn = eng.connect()
                conn.execute(text("SELECT 1"))
                proxy.sever()
                with pytest.raises(sa_exc.DBAPIError) as info:
                    conn.execute(text("SELECT 1"))
                assert dcache.is_transient(info.value), info.value
                conn.close()
            finally:
                eng.dispose()


def test_the_fixture_urls_point_at_loopback_only() -> None:
    """These tests cut and stall connections: they must never aim at a real network host."""
    for url in (POSTGRES_URL, MYSQL_URL, *SERVER_URLS.values()):
        host = make_url(url).host
        assert host in ("127.0.0.1", "localhost"), url
