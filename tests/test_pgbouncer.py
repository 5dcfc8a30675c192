"""The store behind a real PgBouncer in transaction pooling mode (Debian's 1.18 in CI).

In that mode consecutive transactions of one client may run on different server
connections, so nothing may live in a server session: not a prepared statement (psycopg 3
prepares a statement after 5 executions unless ``prepare_threshold=None``), not a ``SET``.
``DB.open(..., pgbouncer=True)`` or ``?pgbouncer=true`` in the URL makes the store safe
there; the store, runner, process and race tests also run through the bouncer
(``conftest.PGBOUNCER_MODULES``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _pgbouncer
import psycopg
import pytest
from _fetchers import WAIT
from conftest import POSTGRES_URL, pgbouncer_url, wipe
from sqlalchemy import create_engine, event
from sqlalchemy.engine import make_url

import batch
import dcache
from batch import Result


def _plain(url: str) -> str:
    """The same URL without the store's flag."""
    return make_url(url).difference_update_query(["pgbouncer"]).render_as_string(False)


def _conninfo(url: str) -> str:
    u = make_url(_plain(url))
    return f"host={u.host} port={u.port} dbname={u.database} user={u.username}"


@pytest.fixture
def bounced() -> Iterator[dcache.DB]:
    db = dcache.DB.open(pgbouncer_url())
    wipe(db)
    try:
        yield db
    finally:
        db.close()


def test_the_tests_really_go_through_the_bouncer() -> None:
    """The backend's URL points at PgBouncer's port, not PostgreSQL's."""
    bouncer = make_url(pgbouncer_url())
    assert bouncer.port != make_url(POSTGRES_URL).port
    assert bouncer.query["pgbouncer"] == "true"
    with psycopg.connect(_conninfo(pgbouncer_url()), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.fixture
def own_bouncer() -> Iterator[str]:
    """A PgBouncer of this test's own: the failure below leaves prepared statements on its
    server connections, which must never reach the shared bouncer's other clients."""
    pgbouncer_url()  # skips or fails as the shared one would
    bouncer = _pgbouncer.start(POSTGRES_URL, pool_size=2)
    try:
        yield _conninfo(bouncer.url())
    finally:
        bouncer.stop()


def test_without_the_option_prepared_statements_break_behind_transaction_pooling(
    own_bouncer: str,
) -> None:
    """The failure the option exists for, shown with psycopg's defaults.

    Client A runs one query until psycopg prepares it on the server connection A was
    given; client B then takes that server connection for an open transaction, so A's
    next transaction runs on another one, where the prepared statement does not exist.
    """
    with psycopg.connect(own_bouncer, autocommit=True) as a, psycopg.connect(own_bouncer) as b:
        for i in range(10):
            a.execute("SELECT %s::int + 1", (i,))
        b.execute("SELECT 1")  # B holds a server connection in a transaction
        with pytest.raises(psycopg.errors.InvalidSqlStatementName):
            for i in range(3):
                a.execute("SELECT %s::int + 1", (i,))
        b.rollback()


def test_with_the_option_the_same_sequence_works(own_bouncer: str) -> None:
    with (
        psycopg.connect(own_bouncer, autocommit=True, prepare_threshold=None) as a,
        psycopg.connect(own_bouncer) as b,
    ):
        for i in range(10):
            a.execute("SELECT %s::int + 1", (i,))
        b.execute("SELECT 1")
        assert [a.execute("SELECT %s::int + 1", (i,)).fetchone() for i in range(3)] == [
            (1,),
            (2,),
            (3,),
        ]
        b.rollback()


def test_the_option_and_the_url_flag_turn_preparing_off(bounced: dcache.DB) -> None:
    with bounced.engine.connect() as conn:
        dbapi: Any = conn.connection.driver_connection
        assert dbapi.prepare_threshold is None
    flagged = dcache.DB.open(_plain(pgbouncer_url()), pgbouncer=True)
    try:
        with flagged.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    finally:
        flagged.close()


def test_the_url_flag_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="true or false"):
        dcache.DB.open(_plain(pgbouncer_url()) + "?pgbouncer=maybe")
    with pytest.raises(ValueError, match="PostgreSQL"):
        dcache.DB.open(f"sqlite:///{tmp_path / 's.sqlite3'}", pgbouncer=True)


def test_many_runners_and_threads_through_the_bouncer_lose_nothing(bounced: dcache.DB) -> None:
    """Three runners on one bouncer pool of 8 server connections, each statement run far
    more than 5 times, racing submits from threads: every job done, every target once."""
    seen: list[str] = []
    lock = threading.Lock()

    def fetch(target: batch.Target) -> Result:
        with lock:
            seen.append(target.url)
        return Result(content=target.url)

    cfg = batch.Config(jobs_per_caller=64, jobs_total=256)
    stores = [dcache.DB.open(pgbouncer_url()) for _ in range(3)]
    runners = [batch.Runner(s, fetch, cfg) for s in stores]
    ids: list[str] = []
    try:

        def submit(r: int, n: int) -> None:
            for j in range(6):
                targets = [{"url": f"https://example.com/{r}/{n}/{j}/{i}"} for i in range(8)]
                job_id, _ = runners[r].submit(f"caller{n}", "free", targets)
                with lock:
                    ids.append(job_id)

        threads = [threading.Thread(target=submit, args=(r, n)) for r in range(3) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        for job_id in ids:
            final = next(r for r in runners).wait(job_id, timeout=WAIT)
            assert final is not None and final.status == "done", final
    finally:
        for r in runners:
            r.close()
        for s in stores:
            s.close()
    assert len(ids) == 54
    assert len(seen) == len(set(seen)) == 54 * 8


def test_the_store_sends_nothing_session_level(bounced: dcache.DB) -> None:
    """Every statement a runner's life sends is a query or transaction-scoped: no SET,
    no PREPARE, no LISTEN, no session advisory lock (they would outlive the transaction
    on a server connection that the next client gets)."""
    sent: list[str] = []

    @event.listens_for(bounced.engine, "before_cursor_execute")
    def record(_c: Any, _cur: Any, statement: str, *_a: Any) -> None:
        sent.append(statement)

    with batch.Runner(bounced, lambda t: Result(content="x")) as runner:
        job_id, _ = runner.submit(
            "alice", "free", [{"url": f"https://example.com/{i}"} for i in range(12)]
        )
        assert runner.wait(job_id, timeout=WAIT) is not None
        runner.cancel(job_id)
        runner.status(job_id)
    assert sent
    session_level = ("SET ", "PREPARE", "LISTEN", "DISCARD", "RESET")
    bad = [s for s in sent if s.lstrip().upper().startswith(session_level)]
    bad += [s for s in sent if "pg_advisory_lock" in s or "pg_try_advisory_lock" in s]
    assert not bad, bad


def test_without_the_option_the_store_stops_preparing_at_the_first_lost_statement(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store not told of the bouncer meets the failure above: the error is a lost
    connection (transient: retried, never a refused result), it says what to set, and
    from then on the store prepares nothing and the same sequence works."""
    pgbouncer_url()  # skips or fails as the shared one would
    bouncer = _pgbouncer.start(POSTGRES_URL, pool_size=2)
    store = dcache.DB.open(bouncer.url(flag=False), pool_size=1, max_overflow=0)
    fetched: list[str] = []
    runner = batch.Runner(store, lambda t: fetched.append(t.url) or Result(t.url))
    try:
        with psycopg.connect(_conninfo(bouncer.url())) as other:
            outcomes: list[str] = []
            for round_ in range(6):
                for _ in range(8):  # far past psycopg's 5: prepared on the connection
                    try:
                        store.get_job("no-such-job")
                        outcomes.append("ok")
                    except dcache.StoreError as exc:  # the store's "retry later" kind only
                        assert isinstance(exc, dcache.StoreUnavailableError), exc
                        outcomes.append(type(exc).__name__)
                # Another client takes the server connection the store's statements were
                # prepared on (or gives it back): the store's next one runs on the other.
                if round_ % 2 == 0:
                    other.execute("SELECT 1")
                else:
                    other.rollback()
            assert "StoreUnavailableError" in outcomes, "the bouncer never moved the store"
            assert outcomes[-16:] == ["ok"] * 16, outcomes
            with store.engine.connect() as conn:
                assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
            other.execute("SELECT 1")
            targets = [{"url": f"https://example.com/{i}"} for i in range(12)]
            job_id, _ = runner.submit("c", "free", targets)
            final = runner.wait(job_id, timeout=WAIT)
            other.rollback()
        assert final is not None and final.status == "done", final
        assert fetched == [t["url"] for t in targets]
        said = [r for r in caplog.records if "pgbouncer=True" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "ERROR", said
    finally:
        runner.close()
        store.close()
        bouncer.stop()


def _lose_prepared_statements(store: dcache.DB) -> None:
    """Drop the server's prepared statements under psycopg's feet (libpq directly), as a
    pooler does when the next transaction lands on another server connection."""
    with store.engine.connect() as conn:
        pgconn = conn.connection.driver_connection.pgconn  # type: ignore[union-attr]
        pgconn.exec_(b"DEALLOCATE ALL")


def test_once_a_statement_was_lost_the_writers_held_connection_stops_preparing_too() -> None:
    """The group writer keeps its connection across batches (it is not checked out again):
    the switch reaches it at its next batch, not at its own first lost statement."""
    pgbouncer_url()  # needs PostgreSQL (the shared PgBouncer is not used)
    store = dcache.DB.open(POSTGRES_URL, pool_size=1, max_overflow=0)
    wipe(store)
    runner = batch.Runner(store, lambda t: Result(t.url))
    try:
        first, _ = runner.submit("c", "free", [{"url": f"https://e.com/a{i}"} for i in range(8)])
        assert runner.wait(first, timeout=WAIT) is not None
        held = store._group._conn
        assert held is not None
        assert held.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
        for _ in range(8):  # prepared on the main pool's one connection
            store.get_job("no-such-job")
        _lose_prepared_statements(store)
        with pytest.raises(dcache.StoreUnavailableError):
            store.get_job("no-such-job")
        second, _ = runner.submit("c", "free", [{"url": f"https://e.com/b{i}"} for i in range(8)])
        final = runner.wait(second, timeout=WAIT)
        assert final is not None and final.status == "done", final
        assert store._group._conn is held  # the same connection, kept
        assert held.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    finally:
        runner.close()
        store.close()


def test_a_callers_own_engine_is_left_to_its_own_prepared_statements() -> None:
    """On an engine the caller made (DB(engine)), a lost prepared statement may come from
    the app's own SQL: the store neither takes it for a pooler nor turns preparing off."""
    pgbouncer_url()
    engine = create_engine(POSTGRES_URL)
    store = dcache.DB(engine)
    try:
        for _ in range(8):
            store.get_job("no-such-job")
        _lose_prepared_statements(store)
        with pytest.raises(dcache.StoreError) as info:
            store.get_job("no-such-job")
        assert not isinstance(info.value, dcache.StoreUnavailableError)
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
    finally:
        store.close()
        engine.dispose()
