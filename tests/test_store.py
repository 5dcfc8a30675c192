"""The store, one operation at a time, on every backend (memory, SQLite file, PostgreSQL, MariaDB).

Time is always injected (``now=``), so leases lapse by moving the clock, never by sleeping.
Races between threads and processes live in ``test_store_races.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import random
import re
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import (
    BACKENDS,
    backend_url,
    job_row_locked,
    open_backend,
    queue_behind_a_lock,
    wait_queued,
    wipe,
)
from sqlalchemy import event, select, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url

import dcache
from dcache import DB, JobRow, NewTarget, SubmitOutcome
from dcache._schema import jobs, owners, targets

UTC = dt.timezone.utc
T0 = dt.datetime(2030, 1, 1, tzinfo=UTC)
TTL = dt.timedelta(minutes=10)
MiB = 1024 * 1024


# -- helpers -------------------------------------------------------------------------------


def idem(*parts: str) -> str:
    """An idempotency key shaped like the runner's (sha256 hex)."""
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def submit(
    db: DB,
    *,
    caller: str = "alice",
    key: str | None = None,
    n: int = 2,
    per_caller: int = 8,
    total: int = 8,
    ttl: dt.timedelta = TTL,
    now: dt.datetime = T0,
    owner: str = "",
    job_id: str | None = None,
) -> SubmitOutcome:
    """Submit a job of ``n`` targets with generous caps unless told otherwise."""
    return db.submit(
        job_id=job_id or uuid.uuid4().hex,
        caller=caller,
        caller_class="user",
        idem_key=key or idem(caller, uuid.uuid4().hex),
        targets=[NewTarget(f"https://example.com/{i}", '{"mode":"text"}') for i in range(n)],
        ttl=ttl,
        jobs_per_caller=per_caller,
        jobs_total=total,
        owner=owner,
        now=now,
    )


def created(db: DB, **kw: Any) -> JobRow:
    """Submit and insist a new job was created."""
    out = submit(db, **kw)
    assert out.kind == "created", out
    assert out.job is not None
    return out.job


def on_threads(fn: Any, items: list[Any]) -> None:
    """Run ``fn(item)`` on a thread of its own for every item; all must end in 30 s."""
    threads = [threading.Thread(target=fn, args=(item,)) for item in items]
    for t in threads:
        t.start()
    join_all(threads)


def join_all(threads: list[threading.Thread]) -> None:
    """Every thread must end within 30 s."""
    for t in threads:
        t.join(30)
        assert not t.is_alive()


def job_of(db: DB, job_id: str, now: dt.datetime = T0) -> JobRow:
    """Read a job that must be visible."""
    job = db.get_job(job_id, now=now)
    assert job is not None, f"job {job_id} not visible at {now}"
    return job


def sql(db: DB, query: str, **params: Any) -> list[Any]:
    """Run raw SQL through the store's engine (for checks the API does not expose)."""
    with db.engine.begin() as conn:
        result = conn.execute(text(query), params)
        return list(result.all()) if result.returns_rows else []


def target_count(db: DB, job_id: str) -> int:
    """How many target rows a job has left in the database."""
    return int(sql(db, "SELECT count(*) FROM batch_target WHERE job_id = :j", j=job_id)[0][0])


# -- schema --------------------------------------------------------------------------------


def test_schema_creation_is_idempotent_and_records_the_version(db: DB) -> None:
    """Every process opens the store at start: a second open must neither fail nor duplicate."""
    job = created(db)
    again = DB(db.engine)  # the caller owns this engine: the schema step runs again on it
    try:
        assert again.schema_version() == dcache.SCHEMA_VERSION
        assert job_of(again, job.id).id == job.id
    finally:
        again.close()
    assert db.schema_version() == dcache.SCHEMA_VERSION
    assert sql(db, "SELECT count(*) FROM dcache_meta")[0][0] == 1
    assert sql(db, "SELECT count(*) FROM batch_lock WHERE name = 'global'")[0][0] == 1
    # Closing a store that does not own its engine leaves the engine usable.
    assert job_of(db, job.id).status == "running"


def test_reopening_a_url_keeps_the_data(backend: str, tmp_path: Path) -> None:
    """A restarted process opens the same URL and must find its jobs and version intact."""
    if backend == "memory":
        pytest.skip("an in-memory store lives only as long as its DB object")
    first = open_backend(backend, tmp_path)
    try:
        job = created(first)
    finally:
        first.close()
    with DB.open(backend_url(backend, tmp_path)) as second:
        assert second.schema_version() == dcache.SCHEMA_VERSION
        assert job_of(second, job.id).targets_total == 2


def test_a_newer_schema_version_is_refused(db: DB) -> None:
    """An old library must not scribble over a schema it does not understand."""
    sql(db, "UPDATE dcache_meta SET value = '99' WHERE value = :v", v=str(dcache.SCHEMA_VERSION))
    try:
        with pytest.raises(dcache.SchemaVersionError):
            DB(db.engine)
    finally:
        sql(
            db, "UPDATE dcache_meta SET value = :v WHERE value = '99'", v=str(dcache.SCHEMA_VERSION)
        )
    assert db.schema_version() == dcache.SCHEMA_VERSION


def test_a_newer_schema_is_refused_before_any_change_to_it(db: DB) -> None:
    """The version is read first: an old library adds nothing (MySQL's DDL would commit)
    to a newer schema that lacks an index it knows, and says to upgrade the library."""
    index = next(i for i in jobs.indexes if i.name == "ix_batch_job_created")
    with db.engine.begin() as conn:
        index.drop(conn)
    sql(db, "UPDATE dcache_meta SET value = '99' WHERE value = :v", v=str(dcache.SCHEMA_VERSION))
    try:
        with pytest.raises(dcache.SchemaVersionError, match="upgrade the library"):
            DB(db.engine)
        with db.engine.connect() as conn:
            found = {i["name"] for i in sa_inspect(conn).get_indexes("batch_job")}
        assert "ix_batch_job_created" not in found
    finally:
        sql(
            db, "UPDATE dcache_meta SET value = :v WHERE value = '99'", v=str(dcache.SCHEMA_VERSION)
        )
        with db.engine.begin() as conn:
            index.create(conn)


@pytest.mark.parametrize("garbage", ["3.1", "three", ""])
def test_a_schema_version_that_is_not_a_number_is_a_schema_version_error(
    db: DB, garbage: str
) -> None:
    """Not a bare ValueError from int(): a StoreError that names the value."""
    sql(
        db,
        "UPDATE dcache_meta SET value = :g WHERE value = :v",
        g=garbage,
        v=str(dcache.SCHEMA_VERSION),
    )
    try:
        with pytest.raises(dcache.SchemaVersionError, match=repr(garbage)):
            DB(db.engine)
        with pytest.raises(dcache.SchemaVersionError, match=repr(garbage)):
            db.schema_version()
    finally:
        sql(
            db,
            "UPDATE dcache_meta SET value = :v WHERE value = :g",
            v=str(dcache.SCHEMA_VERSION),
            g=garbage,
        )


def _schema_state(db: DB) -> tuple[str | None, set[str], set[str]]:
    """The recorded version, the table names and batch_target's columns: what DDL changes."""
    from dcache._schema import meta

    with db.engine.connect() as conn:
        inspector = sa_inspect(conn)
        version = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        tables = {t for t in inspector.get_table_names() if t.startswith(("batch_", "dcache_"))}
        columns = {c["name"] for c in inspector.get_columns("batch_target")}
    return version, tables, columns


def _open_without_create(db: DB, backend: str, tmp_path: Path) -> DB:
    """``create=False`` on the fixture's database: by URL (as the CLI opens it) where a
    URL reaches it, on its engine for the in-memory store."""
    if backend == "memory":
        return DB(db.engine, create=False)
    return DB.open(backend_url(backend, tmp_path), create=False)


def test_open_without_create_opens_a_current_store_and_reads_it(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """``create=False`` is for readers that must not change a database: a store of this
    version opens and reads as ever."""
    job = created(db)
    with _open_without_create(db, backend, tmp_path) as reader:
        assert reader.schema_version() == dcache.SCHEMA_VERSION
        assert job_of(reader, job.id).id == job.id


def test_open_without_create_leaves_an_older_schema_untouched_and_says_who_upgrades(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """A newer reader pointed at a production database must not migrate it under the older
    workers (they would then refuse to start): it refuses, naming both versions."""
    job = created(db)
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE batch_target DROP COLUMN result_bytes"))
        conn.execute(text("UPDATE dcache_meta SET value = '2' WHERE value = :v"), {"v": "3"})
    before = _schema_state(db)
    assert before[0] == "2" and "result_bytes" not in before[2]
    with pytest.raises(dcache.SchemaVersionError, match=r"version 2 is older than .* 3") as err:
        _open_without_create(db, backend, tmp_path)
    assert "upgrade it first" in str(err.value)
    assert err.value.found == 2  # for a message of the caller's own (the CLI's)
    assert _schema_state(db) == before
    # A writer still upgrades it, data intact; then the reader opens it.
    if backend == "memory":
        db._create_schema()
    else:
        DB.open(backend_url(backend, tmp_path)).close()
    assert _schema_state(db)[0] == str(dcache.SCHEMA_VERSION)
    with _open_without_create(db, backend, tmp_path) as reader:
        assert job_of(reader, job.id).id == job.id


def test_open_without_create_refuses_a_newer_schema(db: DB, backend: str, tmp_path: Path) -> None:
    """The version check of a writer holds for a reader too: an old library reads no rows
    whose meaning may have changed."""
    sql(db, "UPDATE dcache_meta SET value = '99' WHERE value = :v", v=str(dcache.SCHEMA_VERSION))
    try:
        with pytest.raises(dcache.SchemaVersionError, match="newer .* upgrade the library") as err:
            _open_without_create(db, backend, tmp_path)
        assert err.value.found == 99
        with pytest.raises(dcache.SchemaVersionError) as err:
            DB(db.engine)  # a writer refuses it alike, saying which version it found
        assert err.value.found == 99
    finally:
        sql(
            db, "UPDATE dcache_meta SET value = :v WHERE value = '99'", v=str(dcache.SCHEMA_VERSION)
        )


# Not through PgBouncer: it reaches the postgresql backend's server, where this runs, and
# knows only the databases its test config names.
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_open_without_create_refuses_a_database_without_a_store_and_creates_nothing(
    backend: str, tmp_path: Path
) -> None:
    """Pointed at the wrong database, a reader says there is no store there; it creates
    no tables (and on SQLite no file), and leaves a foreign SQLite file as it was."""
    if backend == "memory":
        with pytest.raises(dcache.NoStoreError):
            DB.open("sqlite://", create=False)
        return
    if backend == "sqlite":
        missing = tmp_path / "missing.sqlite3"
        with pytest.raises(dcache.NoStoreError, match="does not exist"):
            DB.open(f"sqlite:///{missing}", create=False)
        assert not missing.exists()
        assert not (tmp_path / "missing.sqlite3-wal").exists()
        foreign = tmp_path / "foreign.sqlite3"
        with contextlib.closing(sqlite3.connect(foreign)) as conn:
            conn.execute("CREATE TABLE notes (body TEXT)")
            conn.commit()
        content = foreign.read_bytes()
        with pytest.raises(dcache.NoStoreError, match="no batch store"):
            DB.open(f"sqlite:///{foreign}", create=False)
        assert foreign.read_bytes() == content  # still in rollback mode, not switched to WAL
        assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.sqlite3"]
        # The same through DB(engine): the caller's engine connects to neither.
        from sqlalchemy import create_engine

        for path in (missing, foreign):
            engine = create_engine(f"sqlite:///{path}")
            with pytest.raises(dcache.NoStoreError):
                DB(engine, create=False)
            engine.dispose()
        assert not missing.exists()
        assert foreign.read_bytes() == content
        assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign.sqlite3"]
        return
    from conftest import database_beside
    from sqlalchemy import create_engine

    from dcache._schema import metadata

    url = database_beside(backend_url(backend, tmp_path), "_nostore")
    plain = create_engine(url)
    try:
        metadata.drop_all(plain)  # whatever an earlier run left: an empty database
        with pytest.raises(dcache.NoStoreError, match="no batch store"):
            DB.open(url, create=False)
        with plain.connect() as conn:
            assert sa_inspect(conn).get_table_names() == []
    finally:
        plain.dispose()


# -- submit --------------------------------------------------------------------------------


def test_submit_creates_a_running_job_with_pending_targets(db: DB) -> None:
    """submit returns with the job already running, all its targets pending, lease now+ttl."""
    job = created(db, n=3, owner="runner-1")
    assert job.status == "running"
    assert (job.targets_total, job.targets_done, job.targets_failed) == (3, 0, 0)
    assert job.created_at == job.updated_at == T0
    assert job.expires_at == T0 + TTL
    assert job.finished_at is None
    assert job.ttl == TTL
    assert job.owner == "runner-1"
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    stored, targets = found
    assert stored == job
    assert [t.idx for t in targets] == [0, 1, 2]
    assert [t.url for t in targets] == [f"https://example.com/{i}" for i in range(3)]
    assert all(t.options == '{"mode":"text"}' for t in targets)
    assert all(t.status == "pending" and t.result is None and t.updated_at is None for t in targets)


def test_submit_without_targets_is_a_value_error(db: DB) -> None:
    """A job needs at least one target; the store refuses an empty one before any SQL."""
    with pytest.raises(ValueError):
        submit(db, n=0)


def test_identical_submit_is_reused_while_the_lease_holds(db: DB) -> None:
    """Idempotency: the same (caller, idem_key) returns the same job, no second row."""
    key = idem("alice", "pages")
    job = created(db, key=key)
    out = submit(db, key=key, now=T0 + TTL - dt.timedelta(microseconds=1))
    assert out.kind == "reused"
    assert out.job is not None
    assert out.job.id == job.id
    assert len(db.list_jobs(now=T0)) == 1


def test_a_terminal_job_is_reused_until_its_lease_lapses(db: DB) -> None:
    """Rule 1: a job in any status is reused while its lease holds; only then is a new one made."""
    for end in ("cancel", "fail", "done"):
        key = idem("alice", end)
        job = created(db, key=key, n=1)
        if end == "cancel":
            assert db.cancel(job.id, now=T0)
        elif end == "fail":
            assert db.fail_job(job.id, "boom", now=T0)
        else:
            assert db.write_target(job.id, 0, status="done", ttl=TTL, now=T0).finished
        out = submit(db, key=key, now=T0 + dt.timedelta(minutes=5))
        assert out.kind == "reused", end
        assert out.job is not None
        assert out.job.id == job.id, end
        assert out.job.status == job_of(db, job.id).status != "running"

        later = T0 + TTL  # expires_at <= now: lapsed
        fresh = submit(db, key=key, now=later)
        assert fresh.kind == "created", end
        assert fresh.job is not None
        assert fresh.job.id != job.id
        # The lookup now finds the new job, not the lapsed one.
        by_idem = db.batch_job_by_idem("alice", key, now=later)
        assert by_idem is not None
        assert by_idem.id == fresh.job.id, end


def test_reuse_wins_over_full_caps(db: DB) -> None:
    """Rule 1 before rule 2: a resubmit of a live job is reused even when every cap is full."""
    key = idem("alice", "full")
    job = created(db, key=key, per_caller=1, total=1)
    out = submit(db, key=key, per_caller=1, total=1)
    assert out.kind == "reused"
    assert out.job is not None
    assert out.job.id == job.id


def test_idempotency_is_per_caller(db: DB) -> None:
    """The same key from another caller is another job."""
    key = idem("shared")
    a = created(db, caller="alice", key=key)
    b = created(db, caller="bob", key=key)
    assert a.id != b.id


def test_callers_differing_only_in_case_accents_or_padding_are_distinct(db: DB) -> None:
    """Caller ids are opaque: 'alice' shares caps and jobs with no 'Alice', 'alicé', 'alice '."""
    callers = ("alice", "Alice", "alicé", "alice ")
    for caller in callers:
        created(db, caller=caller, per_caller=1)
    for caller in callers:
        assert db.live_batch_jobs(caller) == 1, caller
        assert [j.caller for j in db.list_jobs(caller=caller, now=T0)] == [caller]


def test_caller_busy_reports_the_callers_live_count(db: DB) -> None:
    """Rule 2: a caller at jobs_per_caller live jobs is refused, with the count that hit the cap."""
    created(db, per_caller=2)
    created(db, per_caller=2)
    created(db, caller="bob", per_caller=2)
    out = submit(db, per_caller=2)
    assert out == SubmitOutcome("caller_busy", None, 2)
    assert db.live_batch_jobs("alice") == 2
    assert db.live_batch_jobs_total() == 3


def test_busy_reports_the_total_live_count(db: DB) -> None:
    """Rule 2: at jobs_total live jobs overall, a new caller is refused, with the total."""
    for caller in ("a", "b", "c"):
        created(db, caller=caller, total=3)
    out = submit(db, caller="d", total=3)
    assert out == SubmitOutcome("busy", None, 3)
    assert db.live_batch_jobs("d") == 0


def test_the_caller_cap_is_checked_before_the_total_cap(db: DB) -> None:
    """When both caps are full the caller hears that it is the one over its share."""
    created(db, per_caller=1, total=1)
    out = submit(db, per_caller=1, total=1)
    assert out.kind == "caller_busy"
    assert out.live == 1


def test_live_is_by_status_not_by_lease(db: DB) -> None:
    """A running job past its expiry still holds its slot; a finished one with a lease does not."""
    stuck = created(db, per_caller=1)
    far = T0 + 100 * TTL
    out = submit(db, per_caller=1, now=far)
    assert out.kind == "caller_busy"
    assert out.live == 1
    assert db.live_batch_jobs("alice") == 1
    # A running job is never hidden, lease or not, and its key is still reused.
    assert job_of(db, stuck.id, now=far).status == "running"
    again = submit(db, key=stuck.idem_key, per_caller=1, now=far)
    assert again.kind == "reused"
    # Once it is no longer live, its lease (bumped by the cancel) is irrelevant to the caps.
    assert db.cancel(stuck.id, now=far)
    assert db.live_batch_jobs("alice") == 0
    assert created(db, per_caller=1, total=1, now=far).status == "running"


def test_a_duplicate_job_id_is_a_store_error_and_leaves_nothing_behind(db: DB) -> None:
    """A failed submit transaction rolls back whole and surfaces as StoreError, not sqlalchemy's."""
    job = created(db, n=2)
    with pytest.raises(dcache.StoreError) as info:
        submit(db, job_id=job.id, caller="bob", n=5)
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)
    assert isinstance(info.value.__cause__, sa_exc.SQLAlchemyError)
    assert target_count(db, job.id) == 2
    assert db.live_batch_jobs("bob") == 0
    assert job_of(db, job.id).caller == "alice"


# -- SQLite: the store's write transactions on the group writer's connection -----------


@contextlib.contextmanager
def on_the_writers_connection(db: DB) -> Iterator[None]:
    """Asserts that the statements run inside ran on the group writer's DBAPI connection,
    with no connection checked out of the pool."""
    group_conn = db._group._conn
    assert group_conn is not None
    checkouts: list[object] = []
    ran_on: list[object] = []

    def on_checkout(*_: Any) -> None:
        checkouts.append(None)

    def on_statement(conn: Any, *_: Any) -> None:
        ran_on.append(conn.connection.driver_connection)

    event.listen(db.engine.pool, "checkout", on_checkout)
    event.listen(db.engine, "before_cursor_execute", on_statement)
    try:
        yield
    finally:
        event.remove(db.engine, "before_cursor_execute", on_statement)
        event.remove(db.engine.pool, "checkout", on_checkout)
    assert ran_on
    assert all(c is group_conn.connection.driver_connection for c in ran_on)
    assert checkouts == []


@pytest.mark.parametrize("backend", ["sqlite", "memory"])
def test_every_sqlite_write_transaction_runs_on_the_group_writers_connection(db: DB) -> None:
    """One connection of a SQLite file writes at a time: the submit, cancels, job ends,
    reaping, purge and the outbox's claims run on the group writer's connection, between
    its batches, not on one of the pool's; none of them waits in SQLite's busy handler
    behind a batch, or makes a batch wait in it."""
    later = T0 + dt.timedelta(seconds=5)
    ids = {name: created(db, caller=name, n=2).id for name in ("a", "b", "c", "f")}
    created(db, caller="g", n=2, owner="gone")  # an owner that never beat: an orphan
    ended = created(db, caller="e", n=1).id
    assert db.write_target(ended, 0, status="done", ttl=TTL, now=T0).finished
    assert db.cancel(ids["f"], now=later)
    steps = {
        "cancel": lambda: db.cancel(ids["a"], now=later),
        "cancel_job": lambda: db.cancel_job(ids["b"], now=later)[0],
        "fail_job": lambda: db.fail_job(ids["c"], "stopped", now=later),
        "mark_finished": lambda: db.mark_finished(ids["f"], now=later),
        "reap_orphans": lambda: db.reap_orphans("restart", dt.timedelta(seconds=1), now=later) == 1,
        "claim_notifications": lambda: db.claim_notifications("me", now=later) == [],
        "redeliver": lambda: db.redeliver(ended, now=later) is False,
        "mark_in_flight_failed": lambda: db.mark_in_flight_failed("restart", now=later) == 0,
        "purge_expired": lambda: db.purge_expired(now=T0 + TTL + dt.timedelta(seconds=1)) == 1,
        "submit": lambda: submit(db, caller="bob", n=3).kind == "created",
    }
    for name, step in steps.items():
        with on_the_writers_connection(db):
            assert step(), name


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_refused_sqlite_submit_leaves_the_writers_connection_writing(db: DB) -> None:
    job = created(db, n=2)
    with pytest.raises(dcache.StoreError):
        submit(db, job_id=job.id, caller="bob", n=5)  # the job's id again: refused
    assert db.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
    assert submit(db, caller="bob", n=1).kind == "created"
    assert db.write_target(job.id, 1, status="done", ttl=TTL, now=T0).finished


def test_a_write_whose_commit_fails_leaves_no_transaction_or_lock_behind() -> None:
    """A COMMIT that fails on the group writer's long-lived connection: SQLAlchemy marks its
    transaction ended without rolling SQLite's back, which kept the write lock (the
    heartbeat, on its own connection, then failed "database is locked") and failed the
    store's next write ("cannot start a transaction within a transaction"). In memory
    (no WAL) a COMMIT waits for readers: a reader left open makes it fail."""
    db = DB.open("sqlite://", busy_timeout=0.2)
    try:
        a, b = created(db).id, created(db).id
        reader = db.engine.connect()
        reader.execute(select(jobs)).fetchone()  # holds SQLite's shared lock
        with pytest.raises(dcache.StoreError, match="locked"):
            db.cancel(a, now=T0)
        reader.close()
        db.heartbeat("owner-1")  # the write lock is free again
        assert db.cancel(b, now=T0) is True
        assert db.cancel(a, now=T0) is True  # the failed cancel was rolled back, not kept
    finally:
        db.close()


def test_a_writer_connection_that_died_is_replaced_by_the_next_write(tmp_path: Path) -> None:
    """SQLite's one "disconnect" is a closed connection. Met in the "begin" hook, before
    SQLAlchemy could call it one, it was never replaced: every write but a drain's batch
    failed until a batch came. Now the write that meets it fails and the next one works."""
    db = DB.open(f"sqlite:///{tmp_path / 'dead.sqlite3'}")
    try:
        a, b = created(db).id, created(db).id
        conn = db._group._conn
        assert conn is not None
        conn.connection.driver_connection.close()
        with pytest.raises(dcache.StoreError):
            db.cancel(a, now=T0)
        assert db.cancel(a, now=T0) is True
        assert created(db).id
        assert db.write_target(b, 0, status="done", ttl=TTL, now=T0).stored
    finally:
        db.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_a_forked_child_writes_on_its_own_connections_and_the_parents_live_on(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """gunicorn --preload forks workers from a process that may have opened the store.
    Forked while another thread held the group writer's connection in a transaction,
    the child used to wait for that lock forever, and wrote on the parent's session
    otherwise. Now the child stores a job on connections of its own and exits the normal
    way, and the parent's writer connection is still the same open session after it
    (see tests/_fork_child.py). SQLite is not forked with a store open (DB._forked)."""
    db.close()  # the child process opens its own store on the emptied database
    child = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).parent / "_fork_child.py"),
            backend_url(backend, tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    assert child.stdout.split("\n")[:2] == ["child ok", "parent ok"], child.stdout


def test_sqlite_writes_and_drains_of_one_store_never_meet_in_sqlites_lock(
    tmp_path: Path,
) -> None:
    """With no busy timeout, a write transaction that found another connection's under
    way would fail at once ("database is locked"). Submits, cancels and job ends racing
    eight drains on one store all go through: the store's writes take turns on its one
    write connection."""
    store = DB.open(f"sqlite:///{tmp_path / 'store.sqlite3'}", busy_timeout=0)
    errors: list[BaseException] = []
    drained = [created(store, caller=f"d{i}", n=32, total=100) for i in range(8)]
    stopped = [created(store, caller=f"x{i}", n=2, total=100).id for i in range(32)]
    submitted: list[str] = []

    def drain(job: JobRow) -> None:
        with store.writer() as writer:
            for idx in range(32):
                out = writer.write_target(job.id, idx, status="done", result="r", ttl=TTL, now=T0)
                assert out.stored

    def submitter(n: int) -> None:
        for i in range(16):
            out = submit(store, caller=f"s{n}-{i}", n=4, total=100)
            assert out.kind == "created"
            submitted.append(out.job.id if out.job else "")

    def stopper(ids: list[str]) -> None:
        for job_id in ids:
            if int(job_id, 16) % 2:
                assert store.cancel(job_id, now=T0)
                assert store.mark_finished(job_id, now=T0)
            else:
                assert store.fail_job(job_id, "stopped", now=T0)

    def reported(work: Any) -> None:
        try:
            work()
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        work = [lambda j=j: drain(j) for j in drained]
        work += [lambda n=n: submitter(n) for n in range(2)]
        work += [lambda: stopper(stopped[:16]), lambda: stopper(stopped[16:])]
        on_threads(reported, work)
        assert errors == []
        assert len(submitted) == 32
        for job in drained:
            assert job_of(store, job.id).status == "done"
        for job_id in stopped:
            assert job_of(store, job_id).finished_at == T0
        assert store.engine.pool.checkedout() == 0
    finally:
        store.close()


# -- write_target --------------------------------------------------------------------------


def test_write_target_is_compare_and_set(db: DB) -> None:
    """A target is stored once: a second write of the same index changes nothing."""
    job = created(db, n=2)
    first = db.write_target(job.id, 0, status="done", result="first", ttl=TTL, now=T0)
    assert first == dcache.WriteOutcome(True, "running", False)
    assert first.running
    second = db.write_target(
        job.id, 0, status="failed", error="late", ttl=TTL, now=T0 + dt.timedelta(seconds=5)
    )
    assert second == dcache.WriteOutcome(False, "running", False)
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    stored, targets = found
    assert (targets[0].status, targets[0].result, targets[0].error) == ("done", "first", "")
    assert stored.targets_done == 1
    assert stored.updated_at == T0


def test_write_target_to_an_unknown_job_or_index_is_not_stored(db: DB) -> None:
    """A write for a purged job or a bad index reports stored=False instead of raising."""
    job = created(db, n=1)
    assert db.write_target("nope", 0, status="done", ttl=TTL, now=T0) == dcache.WriteOutcome(
        False, ""
    )
    out = db.write_target(job.id, 7, status="done", ttl=TTL, now=T0)
    assert out == dcache.WriteOutcome(False, "running")
    assert job_of(db, job.id).targets_done == 0


def test_write_target_rejects_a_status_other_than_done_or_failed(db: DB) -> None:
    """Only terminal target statuses are written; anything else is a programming error."""
    job = created(db, n=1)
    with pytest.raises(ValueError):
        db.write_target(job.id, 0, status="pending", ttl=TTL, now=T0)


@pytest.mark.parametrize("field", ["result", "error", "hint"])
@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"], ids=["nul", "lone-surrogate"])
def test_a_value_some_backend_cannot_store_is_refused_before_the_write(
    db: DB, field: str, bad: str
) -> None:
    """A NUL (PostgreSQL text cannot hold it) or a lone surrogate (not UTF-8) is this
    write's own ValueError, raised before it joins a batch: in one it failed, or
    mis-answered, the other drains' writes committed with it."""
    job = created(db, n=2)
    values = {"result": "ok", "error": "", "hint": "", field: bad}
    with pytest.raises(ValueError, match=field):
        db.write_target(job.id, 0, status="failed", ttl=TTL, now=T0, **values)
    assert db.write_target(job.id, 1, status="done", result="fine", ttl=TTL, now=T0).stored
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    assert [t.status for t in found[1]] == ["pending", "done"]


def test_every_write_moves_the_lease_to_now_plus_ttl(db: DB, clock: Any) -> None:
    """Rule 5: a job being drained stays readable a full TTL after its latest write."""
    job = created(db, n=3, now=clock.now)
    for idx in range(3):
        at = clock.advance(minutes=7)  # beyond the previous lease's start, within it
        db.write_target(job.id, idx, status="done", result=str(idx), ttl=TTL, now=at)
        stored = job_of(db, job.id, now=at)
        assert stored.expires_at == at + TTL
        assert stored.updated_at == at
    # The job is done now: its lease lapses a TTL after the last write, not before.
    last = clock.now
    assert db.get_job(job.id, now=last + TTL - dt.timedelta(microseconds=1)) is not None
    assert db.get_job(job.id, now=last + TTL) is None


def test_write_target_counts_done_and_failed(db: DB) -> None:
    """targets_done counts every stored target, targets_failed the failed ones among them."""
    job = created(db, n=4)
    for idx, status in enumerate(["done", "failed", "failed"]):
        db.write_target(
            job.id,
            idx,
            status=status,
            result="r",
            error="e" * (status == "failed"),
            hint="h",
            ttl=TTL,
            now=T0,
        )
    stored = job_of(db, job.id)
    assert (stored.targets_done, stored.targets_failed, stored.status) == (3, 2, "running")
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    assert [(t.status, t.error, t.hint) for t in found[1]] == [
        ("done", "", "h"),
        ("failed", "e", "h"),
        ("failed", "e", "h"),
        ("pending", "", ""),
    ]


TERMINAL_CASES = [
    (["done", "done", "done"], "done"),
    (["failed", "failed", "failed"], "failed"),
    (["done", "failed", "done"], "partial"),
    (["failed", "failed", "done"], "partial"),
    (["done"], "done"),
    (["failed"], "failed"),
]


def test_the_last_write_sets_the_terminal_status_once(db: DB) -> None:
    """Rule 7: all done → done, all failed → failed, a mix → partial, with finished_at, once."""
    for statuses, terminal in TERMINAL_CASES:
        case = f"{statuses} -> {terminal}"
        job = created(db, n=len(statuses))
        for idx, status in enumerate(statuses):
            at = T0 + dt.timedelta(seconds=idx + 1)
            out = db.write_target(job.id, idx, status=status, result="r", ttl=TTL, now=at)
            last = idx == len(statuses) - 1
            assert out.stored, case
            assert out.status == (terminal if last else "running"), case
            assert out.finished is last, case
            assert out.running is not last, case
        end = T0 + dt.timedelta(seconds=len(statuses))
        stored = job_of(db, job.id)
        assert stored.status == terminal, case
        assert stored.finished_at == end, case
        assert stored.targets_done == len(statuses), case
        assert stored.targets_failed == statuses.count("failed"), case
        # Set exactly once: nothing later moves a terminal job.
        later = end + dt.timedelta(minutes=1)
        assert not db.write_target(job.id, 0, status="failed", ttl=TTL, now=later).stored
        assert not db.cancel(job.id, now=later)
        assert not db.fail_job(job.id, "late", now=later)
        assert not db.mark_finished(job.id, now=later)
        assert db.mark_in_flight_failed("restart", now=later) == 0
        again = job_of(db, job.id)
        assert (again.status, again.finished_at, again.error) == (terminal, end, ""), case


def test_a_write_after_cancel_stores_the_target_and_finishes_the_job(db: DB) -> None:
    """Rule 6: the in-flight target is stored after a cancel, and tells the drain to stop."""
    job = created(db, n=3)
    db.write_target(job.id, 0, status="done", result="a", ttl=TTL, now=T0)
    assert db.cancel(job.id, now=T0 + dt.timedelta(seconds=1))
    assert job_of(db, job.id).finished_at is None  # the drain has not stopped yet
    at = T0 + dt.timedelta(seconds=2)
    out = db.write_target(job.id, 1, status="done", result="b", ttl=TTL, now=at)
    assert out == dcache.WriteOutcome(True, "cancelled", True)
    assert not out.running
    stored = job_of(db, job.id)
    assert (stored.status, stored.targets_done, stored.finished_at) == ("cancelled", 2, at)
    assert stored.expires_at == at + TTL
    # Even writing the last target never turns a cancelled job into done; finished_at stays.
    out = db.write_target(job.id, 2, status="done", ttl=TTL, now=at + dt.timedelta(seconds=1))
    assert out == dcache.WriteOutcome(True, "cancelled", True)
    stored = job_of(db, job.id)
    assert (stored.status, stored.targets_done, stored.finished_at) == ("cancelled", 3, at)


def test_a_write_after_fail_job_is_stored_and_keeps_the_failure(db: DB) -> None:
    """A reaped job's in-flight result is kept, but the job stays failed with its reason."""
    job = created(db, n=2)
    assert db.fail_job(job.id, "restart", now=T0)
    out = db.write_target(
        job.id, 0, status="done", result="kept", ttl=TTL, now=T0 + dt.timedelta(seconds=1)
    )
    assert out == dcache.WriteOutcome(True, "failed", True)
    stored = job_of(db, job.id)
    assert (stored.status, stored.error, stored.finished_at) == ("failed", "restart", T0)
    assert stored.targets_done == 1


def test_a_write_asked_for_the_job_answers_it_as_a_read_would(db: DB) -> None:
    """``job_row=True``: the write that ends a job (or finds it ended) answers the job's
    row as its commit left it, equal to a read of it; any other write answers no row."""
    job = created(db, n=3)
    for idx, status in enumerate(["done", "failed"]):
        at = T0 + dt.timedelta(seconds=idx + 1)
        out = db.write_target(job.id, idx, status=status, result="r", ttl=TTL, now=at, job_row=True)
        assert (out.stored, out.status, out.job) == (True, "running", None)
    at = T0 + dt.timedelta(seconds=3)
    out = db.write_target(job.id, 2, status="done", result="r", ttl=TTL, now=at, job_row=True)
    assert (out.stored, out.status, out.finished) == (True, "partial", True)
    assert out.job == job_of(db, job.id)
    assert (out.job.finished_at, out.job.expires_at, out.job.targets_done) == (at, at + TTL, 3)
    # Not stored (written before, or no such job): no row.
    again = db.write_target(job.id, 2, status="done", ttl=TTL, now=at, job_row=True)
    assert (again.stored, again.job) == (False, None)
    unknown = db.write_target(uuid.uuid4().hex, 0, status="done", ttl=TTL, now=at, job_row=True)
    assert unknown == dcache.WriteOutcome(False, "")
    # Not asked: no row, though the write ended the job.
    single = created(db, n=1)
    out = db.write_target(single.id, 0, status="done", ttl=TTL, now=at)
    assert (out.finished, out.job) == (True, None)


def test_a_write_asked_for_the_job_after_cancel_or_fail_answers_the_ended_job(db: DB) -> None:
    """A write that finds its job cancelled or failed (and so finishes it) answers the
    job as the write left it: its status, reason, times and counts."""
    cancelled = created(db, n=3)
    assert db.cancel(cancelled.id, now=T0)
    at = T0 + dt.timedelta(seconds=1)
    out = db.write_target(cancelled.id, 0, status="done", ttl=TTL, now=at, job_row=True)
    assert out.job is not None and out.job == job_of(db, cancelled.id)
    assert (out.job.status, out.job.finished_at, out.job.targets_done) == ("cancelled", at, 1)
    failed = created(db, n=2)
    assert db.fail_job(failed.id, "restart", now=T0)
    out = db.write_target(failed.id, 0, status="done", ttl=TTL, now=at, job_row=True)
    assert out.job is not None and out.job == job_of(db, failed.id)
    assert (out.job.status, out.job.error, out.job.finished_at) == ("failed", "restart", T0)


def test_each_write_is_committed_when_it_returns_and_takes_no_pooled_connection(db: DB) -> None:
    """The group writer has a connection of its own: reads and submits never wait for it."""
    job = created(db, n=3)
    checked_out = getattr(db.engine.pool, "checkedout", lambda: 0)
    with db.writer() as writer:
        for idx, status in enumerate(["done", "failed", "done"]):
            out = writer.write_target(
                job.id,
                idx,
                status=status,
                result=f"r{idx}",
                ttl=TTL,
                now=T0 + dt.timedelta(seconds=idx),
            )
            assert out.stored
            # Another connection sees it at once: nothing waits for the drain to end.
            assert job_of(db, job.id).targets_done == idx + 1
            assert checked_out() == 0
        assert not writer.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
        with pytest.raises(ValueError):
            writer.write_target(job.id, 0, status="running", ttl=TTL, now=T0)
        writer.close()
        writer.close()  # idempotent
    assert checked_out() == 0
    stored = job_of(db, job.id)
    assert (stored.status, stored.targets_done, stored.targets_failed) == ("partial", 3, 1)


def test_a_result_is_read_whole_brief_or_a_slice_at_a_time(db: DB) -> None:
    """get_target with or without its result (then its size); get_result_slice cuts the
    stored text by characters, whatever their UTF-8 width."""
    job = created(db, n=2)
    text = '{"content": "é😀\\"x", "meta": {}}'
    assert db.write_target(job.id, 0, status="done", result=text, ttl=TTL, now=T0).stored
    whole = db.get_target(job.id, 0, now=T0)
    brief = db.get_target(job.id, 0, now=T0, results=False)
    assert whole is not None and brief is not None
    assert (whole[1].result, whole[1].result_bytes) == (text, None)
    assert (brief[1].result, brief[1].result_bytes) == (None, len(text.encode()))
    with db.engine.connect() as conn:  # stored with the result, not measured when read
        size = conn.execute(
            select(targets.c.result_bytes).where(targets.c.job_id == job.id, targets.c.idx == 0)
        ).scalar()
    assert size == len(text.encode())
    assert attrs.evolve(brief[1], result=text, result_bytes=None) == whole[1]
    for start in range(len(text) + 2):
        for length in (0, 1, 2, 5, 100):
            assert db.get_result_slice(job.id, 0, start, length) == text[start : start + length]
    pending = db.get_target(job.id, 1, now=T0, results=False)
    assert pending is not None and pending[1].result_bytes is None
    assert db.get_result_slice(job.id, 1, 0, 10) is None  # no result stored
    assert db.get_result_slice(job.id, 2, 0, 10) is None  # no such target
    assert db.get_result_slice("no-such-job", 0, 0, 10) is None
    with pytest.raises(ValueError):
        db.get_result_slice(job.id, 0, -1, 10)


def test_read_result_cuts_the_stored_texts_utf8_bytes_anywhere(db: DB) -> None:
    """read_result answers bytes of the stored text's UTF-8, cut anywhere (inside a
    character too); SQLite reads them in place through a blob handle where it can (Python
    3.11+), else with SQL as the servers do: both ways are checked; gone rows answer None."""
    ways = [None]
    if db.dialect == "sqlite":
        ways = [False] + ([True] if hasattr(sqlite3.Connection, "blobopen") else [])
        assert db._sqlite_blobs() is (True in ways)  # the store's files are UTF-8
    for blobs in ways:
        if blobs is not None:
            db.__dict__["_blobs"] = blobs
        _check_read_result(db)


def _check_read_result(db: DB) -> None:
    job = created(db, n=3)
    text = '{"content": "é😀\\"x\\u0000ü", "meta": {}}'
    data = text.encode()
    assert db.write_target(job.id, 0, status="done", result=text, ttl=TTL, now=T0).stored
    assert db.write_target(job.id, 2, status="done", result="", ttl=TTL, now=T0).stored
    for offset in range(len(data) + 2):
        for size in (0, 1, 2, 3, 5, 100):
            got = db.read_result(job.id, 0, offset, size)
            assert got == data[offset : offset + size], (offset, size)
    assert db.read_result(job.id, 2, 0, 10) == b""  # an empty text is stored, not missing
    assert db.read_result(job.id, 1, 0, 10) is None  # no result stored
    assert db.read_result(job.id, 3, 0, 10) is None  # no such target
    assert db.read_result("no-such-job", 0, 0, 10) is None
    assert db.read_result("nul\x00", 0, 0, 10) is None
    with pytest.raises(ValueError):
        db.read_result(job.id, 0, 0, -1)
    assert db.purge_expired(now=T0 + dt.timedelta(days=30)) == 0  # live: kept
    assert db.cancel(job.id, now=T0)
    assert db.mark_finished(job.id, now=T0)  # its drain has ended
    assert db.purge_expired(now=T0 + TTL + dt.timedelta(days=30)) == 1
    assert db.read_result(job.id, 0, 0, 10) is None  # purged


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer"])
def test_one_statement_reads_open_no_transaction_on_postgresql(db: DB) -> None:
    """On PostgreSQL the reads of one statement run in autocommit: no BEGIN before them and
    no ROLLBACK after (one round trip, not three); the writes keep their transactions."""
    import psycopg

    job = created(db, n=1)
    assert db.write_target(job.id, 0, status="done", result='{"content": "x"}', ttl=TTL, now=T0)
    states: list[tuple[str, Any]] = []

    def seen(conn: Any, _cur: Any, statement: str, *_: Any) -> None:
        info = conn.connection.driver_connection.info
        states.append((statement.split(maxsplit=1)[0].upper(), info.transaction_status))

    event.listen(db.engine, "after_cursor_execute", seen)
    try:
        assert db.get_job(job.id, now=T0) is not None
        assert db.poll_job(job.id, now=T0) is not None
        assert db.get_job_with_targets(job.id, now=T0) is not None
        stream = db.get_job_with_targets_streamed(job.id, now=T0, notification=True)
        assert stream is not None
        with stream:
            assert len(list(stream)) == 1
        assert db.get_target(job.id, 0, now=T0) is not None
        assert db.get_result_slice(job.id, 0, 0, 5) == '{"con'
        assert db.notification(job.id) is None
        reads = list(states)
        states.clear()
        assert db.cancel(job.id, now=T0) is False  # a write: inside its transaction
    finally:
        event.remove(db.engine, "after_cursor_execute", seen)
    idle = psycopg.pq.TransactionStatus.IDLE
    assert len(reads) >= 7 and all(s == idle for _, s in reads), reads
    assert any(s == psycopg.pq.TransactionStatus.INTRANS for _, s in states), states


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer"])
def test_a_poll_and_a_status_read_are_one_exchange_with_the_server(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """Nobody watching statements, ``poll_job``, ``get_job`` and ``get_job_with_targets``
    run on the pooled driver connection: the wire carries the SELECT and nothing else (no
    BEGIN, no ROLLBACK, no SET), and the connection goes back to the pool out of
    autocommit, its next transaction a real one."""
    import psycopg

    job = created(db, n=2)
    store = DB.open(backend_url(backend, tmp_path), pool_size=1, max_overflow=0)
    reads = {
        "poll_job": lambda: store.poll_job(job.id, now=T0),
        "get_job": lambda: store.get_job(job.id, now=T0),
        "get_job_with_targets": lambda: store.get_job_with_targets(job.id, now=T0),
    }
    try:
        assert store.poll_job(job.id, now=T0) is not None  # the pool's one connection
        with store.engine.connect() as conn:
            raw = conn.connection.driver_connection
        for name, read in reads.items():
            trace = tmp_path / f"{name}.trace"
            with trace.open("w") as out:
                raw.pgconn.trace(out.fileno())
                raw.pgconn.set_trace_flags(
                    psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE
                )
                try:
                    found = read()
                finally:
                    raw.pgconn.untrace()
            assert found is not None, name
            sent = [line.split("\t") for line in trace.read_text().splitlines()]
            to_server = [f[2:] for f in sent if f[0] == "F"]
            text = " ".join(" ".join(f) for f in to_server).upper()
            assert "SELECT" in text, (name, to_server)
            for word in ("BEGIN", "ROLLBACK", "COMMIT", " SET "):
                assert word not in text, (name, to_server)
            ready = [f for f in sent if f[0] == "B" and f[2].startswith("ReadyForQuery")]
            assert len(ready) == 1, (name, sent)
            assert raw.autocommit is False, name
        with store.engine.begin() as conn:
            conn.exec_driver_sql("SELECT 1")
            assert raw.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer"])
def test_psycopg_keeps_one_cursor_per_connection_and_loses_it_with_the_connection(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """Polls and submits (few, small rows) reuse one cursor per pooled psycopg connection:
    making one costs about a quarter of a keyed read on loopback. A status read of a large
    result does not run on it, so the megabyte does not stay with the connection. A
    connection the server drops takes its cursor with it; the next read works, on a new
    connection and cursor."""
    from dcache._reads import _HELD

    job = created(db, n=2)
    store = DB.open(backend_url(backend, tmp_path), pool_size=1, max_overflow=0)

    def held() -> Any:
        with store.engine.connect() as conn:  # the pool's only connection
            return conn.connection.info.get(_HELD), conn.connection.driver_connection

    try:
        assert store.poll_job(job.id, now=T0) is not None
        first, raw = held()
        assert first is not None and not first.closed
        for n in range(3):
            assert store.poll_job(job.id, now=T0) is not None
            created(store, caller=f"c{n}", n=3)  # the submit's statements on the same one
        assert held() == (first, raw) and not first.closed
        big = '"' + "x" * MiB + '"'
        assert db.write_target(job.id, 0, status="done", result=big, ttl=TTL, now=T0).stored
        found = store.get_job_with_targets(job.id, now=T0)
        assert found is not None and found[1][0].result == big
        assert held() == (first, raw)
        kept = first.pgresult  # what the held cursor still holds: the last short statement's
        assert kept is None or kept.ntuples <= 1
        if kept is not None and kept.ntuples:
            assert all(len(kept.get_value(0, c) or b"") < 1024 for c in range(kept.nfields))
        if backend == "pgbouncer":
            return  # the server connection behind the bouncer is not the client's to cut
        with db.engine.connect() as other:
            other.exec_driver_sql("SELECT pg_terminate_backend(%s)", (raw.info.backend_pid,))
        with contextlib.suppress(dcache.StoreUnavailableError):
            store.poll_job(job.id, now=T0)  # fails, unless the pool's pre-ping ran first
        assert store.poll_job(job.id, now=T0) is not None
        again, new_raw = held()
        assert new_raw is not raw and again is not None and again is not first
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_after_a_read_in_autocommit_transactions_are_still_read_committed(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """A server whose default isolation is stricter than the store's: a read in autocommit
    hands its connection back at READ COMMITTED, the level the store sets on every one,
    not at the server's default (what SQLAlchemy found on its first connection)."""
    strict = {"options": "-c default_transaction_isolation=serializable"}
    store = DB.open(
        backend_url(backend, tmp_path), pool_size=1, max_overflow=0, connect_args=strict
    )
    try:
        with store.engine.connect() as conn:  # the server's own default, on a raw connection
            raw = conn.connection.driver_connection
            assert raw.execute("SHOW default_transaction_isolation").fetchone()[0] == "serializable"
        assert store.get_job("0" * 32) is None  # a read in autocommit on the pool's only one
        with store.engine.begin() as conn:
            level = conn.exec_driver_sql("SHOW transaction_isolation").scalar_one()
        assert level == "read committed"
        # The writer's statements run in autocommit too (each its own transaction, at the
        # server's level); they store on such a server all the same.
        job = created(store, n=2)
        for i in range(2):
            out = store.write_target(job.id, i, status="done", result="r", ttl=TTL, now=T0)
            assert out.stored
        assert job_of(store, job.id).status == "done"
    finally:
        store.close()


@contextlib.contextmanager
def _pings(db: DB) -> Iterator[tuple[Any, list[Any]]]:
    """The store's pre-ping, and the connections it pinged while the block ran."""
    from dcache._engine import RecentPing

    recent = db.engine.dialect.do_ping
    assert isinstance(recent, RecentPing)
    real, window = recent.ping, recent.window
    pinged: list[Any] = []

    def ping(dbapi_conn: Any) -> bool:
        pinged.append(dbapi_conn)
        return real(dbapi_conn)

    recent.ping = ping
    try:
        yield recent, pinged
    finally:
        recent.ping, recent.window = real, window


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer", "mariadb"])
def test_a_connection_given_back_moments_ago_is_not_pinged_again(db: DB) -> None:
    """The servers' pre-ping is skipped within half a second of a connection's last use
    (a round trip as long as a short read's own), and done after a pause."""
    with _pings(db) as (recent, pinged):
        assert db.get_job("0" * 32) is None
        pinged.clear()
        for _ in range(5):
            assert db.get_job("0" * 32) is None
        assert pinged == []  # each checkout found a connection given back just now
        recent.window = 0.0
        assert db.get_job("0" * 32) is None
        assert len(pinged) == 1  # after a pause (here: any), pinged before use


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "pgbouncer", "mariadb"])
def test_the_pool_hands_out_the_connection_given_back_last(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """LIFO: the next checkout takes the connection given back last, so a process that
    reads now and then keeps reusing one warm connection (and its recent use spares it the
    pre-ping); the others stay idle for the server to time out. A caller's own
    ``pool_use_lifo=False`` still has the pool take the longest-idle one first."""

    def given_back_in_order(store: DB) -> tuple[list[Any], Any]:
        held = [store.engine.raw_connection() for _ in range(3)]
        order = [c.driver_connection for c in held]
        for c in held:
            c.close()
        again = store.engine.raw_connection()
        try:
            return order, again.driver_connection
        finally:
            again.close()

    order, next_one = given_back_in_order(db)
    assert next_one is order[-1]
    fifo = DB.open(backend_url(backend, tmp_path), pool_use_lifo=False)
    try:
        order, next_one = given_back_in_order(fifo)
        assert next_one is order[0]
    finally:
        fifo.close()


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer", "mariadb"])
def test_reads_spaced_out_are_not_pinged_while_the_pool_holds_idle_connections(db: DB) -> None:
    """A read every 0.2 s, with four connections idle in the pool: each finds the one the
    read before gave back, inside the pre-ping's half-second window. Taking the
    longest-idle one instead (a FIFO pool) met each connection every 0.8 s and pinged
    before every read: a second round trip per read."""
    held = [db.engine.raw_connection() for _ in range(4)]  # as four request threads leave
    for c in held:
        c.close()
    with _pings(db) as (_recent, pinged):
        for _ in range(6):
            time.sleep(0.2)
            assert db.get_job("0" * 32) is None
        assert pinged == []


def _break_statements(db: DB, marker: str, *, table: str = "batch_job") -> Any:
    """An engine hook that turns the UPDATE of ``table`` for a write whose parameters
    hold ``marker`` into invalid SQL: a real database error at exactly that statement
    (on PostgreSQL, the one statement that updates both tables)."""

    def hook(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: Any) -> Any:
        values = params.values() if isinstance(params, dict) else params
        if f"UPDATE {table} " in statement and any(v == marker for v in values):
            return "UPDATE no_such_table SET x = 1", params
        return statement, params

    event.listen(db.engine, "before_cursor_execute", hook, retval=True)
    return lambda: event.remove(db.engine, "before_cursor_execute", hook)


def test_a_failed_write_rolls_back_whole_and_the_writer_recovers(db: DB) -> None:
    """Target and counters move in one transaction; a failure mid-way leaves neither changed."""
    job = created(db, n=2)
    with db.writer() as writer:
        assert writer.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
        # The job update (the second statement) fails, after the target's update.
        undo = _break_statements(db, job.id)
        try:
            with pytest.raises(dcache.StoreError) as info:
                writer.write_target(job.id, 1, status="done", result="lost", ttl=TTL, now=T0)
        finally:
            undo()
        assert not isinstance(info.value, sa_exc.SQLAlchemyError)
        found = db.get_job_with_targets(job.id, now=T0)
        assert found is not None
        assert found[0].targets_done == 1
        assert (found[1][1].status, found[1][1].result) == ("pending", None)
        assert writer.write_target(
            job.id, 1, status="done", result="kept", ttl=TTL, now=T0
        ).finished
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    assert (found[0].status, found[0].targets_done, found[1][1].result) == ("done", 2, "kept")


def test_concurrent_drains_share_commits_and_each_gets_its_own_answer(db: DB) -> None:
    """Group commit: many targets per transaction, every write's outcome its own."""
    jobs_ = [created(db, caller=f"c{i}", n=8) for i in range(8)]
    commits_before = db._group.commits
    barrier = threading.Barrier(len(jobs_))
    answers: dict[str, list[dcache.WriteOutcome]] = {}

    def drain(job: JobRow) -> None:
        barrier.wait(10)
        answers[job.id] = [
            db.write_target(job.id, i, status="done", result=f"{job.id}:{i}", ttl=TTL, now=T0)
            for i in range(8)
        ]

    on_threads(drain, jobs_)
    for job in jobs_:
        assert [a.stored for a in answers[job.id]] == [True] * 8
        assert [a.status for a in answers[job.id]] == ["running"] * 7 + ["done"]
        assert answers[job.id][-1].finished
        found = db.get_job_with_targets(job.id, now=T0)
        assert found is not None
        assert [t.result for t in found[1]] == [f"{job.id}:{i}" for i in range(8)]
    commits = db._group.commits - commits_before
    assert commits <= 64  # one per write at worst; shared whenever writers overlap


def until_gathering(db: DB, leader: threading.Thread, timeout: float = 10.0) -> None:
    """Return once ``leader`` (a thread writing through ``db``) leads a commit and waits
    for other writers' outcomes; fail if it ends or does not get there in time."""
    deadline = time.monotonic() + timeout
    while not db._group._gathering:
        assert leader.is_alive() and time.monotonic() < deadline
        time.sleep(0.001)


def test_a_leader_waits_for_the_outcomes_of_the_other_open_writers(
    db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two drains' writers open: the first outcome's leader waits for the second's, and
    both commit in one transaction (a slice long enough that timing cannot split them)."""
    from dcache import _writer

    monkeypatch.setattr(_writer, "GATHER_SLICE", 30.0)
    monkeypatch.setattr(_writer, "GATHER_MAX", 30.0)
    first, second = created(db, caller="a", n=2), created(db, caller="b", n=2)
    group = db._group
    commits_before = group.commits
    with db.writer() as w1, db.writer() as w2:
        answers: list[dcache.WriteOutcome] = []
        leader = threading.Thread(
            target=lambda: answers.append(
                w1.write_target(first.id, 0, status="done", ttl=TTL, now=T0)
            )
        )
        leader.start()
        until_gathering(db, leader)  # the leader waits for w2's outcome
        assert w2.write_target(second.id, 0, status="done", ttl=TTL, now=T0).stored
        leader.join(10)
        assert [a.stored for a in answers] == [True]
    assert group.commits - commits_before == 1
    assert group._open == 0


def test_a_gathering_leader_is_woken_once_when_its_batch_is_complete(
    db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four drains' writers open: the leader is not woken as the second and third outcomes
    arrive, only by the fourth, which completes its batch; all four commit together."""
    from dcache import _writer

    monkeypatch.setattr(_writer, "GATHER_SLICE", 30.0)
    monkeypatch.setattr(_writer, "GATHER_MAX", 30.0)
    jobs_ = [created(db, caller=f"c{i}", n=1) for i in range(4)]
    group = db._group
    wakes: list[int] = []

    class Counting(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            woken = super().wait(timeout)
            wakes.append(len(group._queued))
            return woken

    monkeypatch.setattr(group, "_arrived", Counting(group._mutex))
    commits_before = group.commits
    writers = [db.writer() for _ in jobs_]
    for w in writers:
        w.__enter__()
    answers: dict[int, dcache.WriteOutcome] = {}

    def write(i: int) -> None:
        answers[i] = writers[i].write_target(jobs_[i].id, 0, status="done", ttl=TTL, now=T0)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    try:
        threads[0].start()
        until_gathering(db, threads[0])
        for i in (1, 2):
            threads[i].start()
        deadline = time.monotonic() + 10
        while len(group._queued) < 3:  # both queued behind the gathering leader
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert wakes == []  # neither arrival woke it
        threads[3].start()
        for t in threads:
            t.join(10)
    finally:
        for w in writers:
            w.close()
    assert wakes == [4]  # woken once, by the outcome that completed the batch
    assert sorted(answers) == [0, 1, 2, 3] and all(a.stored for a in answers.values())
    assert group.commits - commits_before == 1


def test_a_leader_waits_one_slice_for_an_open_writer_that_does_not_write(
    db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain whose fetch is slow costs the others one slice, not its fetch's time; a
    lone writer, or a writer closed twice, waits for nobody."""
    from dcache import _writer

    monkeypatch.setattr(_writer, "GATHER_SLICE", 1.0)
    monkeypatch.setattr(_writer, "GATHER_MAX", 30.0)
    job = created(db, n=3)
    idle = db.writer()
    idle.__enter__()
    try:
        with db.writer() as writer:
            t0 = time.monotonic()
            assert writer.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
            assert 0.9 <= time.monotonic() - t0 < 10
    finally:
        idle.close()
        idle.close()
    assert db._group._open == 0
    with db.writer() as writer:
        t0 = time.monotonic()
        assert writer.write_target(job.id, 1, status="done", ttl=TTL, now=T0).stored
        assert time.monotonic() - t0 < 0.9  # no slice waited


def test_a_writer_dropped_without_close_stops_being_waited_for(
    db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's writer entered and dropped, never closed: once it is collected the
    group writer stops counting on it, so a lone drain's commit waits for nobody."""
    import gc

    from dcache import _writer

    monkeypatch.setattr(_writer, "GATHER_SLICE", 1.0)
    monkeypatch.setattr(_writer, "GATHER_MAX", 30.0)
    job = created(db, n=1)
    before = db._group._open
    leaked = db.writer()
    leaked.__enter__()
    assert db._group._open == before + 1
    del leaked
    gc.collect()
    with db.writer() as writer:
        assert db._group._open == before + 1  # the dropped one is no longer counted
        t0 = time.monotonic()
        assert writer.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
        assert time.monotonic() - t0 < 0.9  # no slice waited for the dropped writer
    assert db._group._open == before


def test_a_writer_collected_while_the_group_mutex_is_held_does_not_deadlock(db: DB) -> None:
    """The collector may finalize a dropped writer on a thread that holds the group
    writer's (non-reentrant) mutex: the finalizer takes no lock."""
    group = db._group
    before = group._open
    leaked = db.writer()
    leaked.__enter__()
    finalizer = leaked._open
    assert finalizer is not None
    done = threading.Event()

    def collect_under_the_mutex() -> None:
        with group._mutex:
            finalizer()  # what the collector runs when the writer is unreachable
        done.set()

    thread = threading.Thread(target=collect_under_the_mutex, daemon=True)
    thread.start()
    assert done.wait(10), "the finalizer blocked on the mutex its thread holds"
    leaked.close()  # finalized already: counted once, not twice
    db.writer().__enter__().close()  # a mutex holder settles the count
    assert group._open == before


def test_a_writer_can_be_entered_again_after_close(db: DB) -> None:
    """Closing twice counts once; entering again after close opens it again."""
    before = db._group._open
    writer = db.writer()
    with writer:
        assert db._group._open == before + 1
    writer.close()
    assert db._group._open == before
    with writer, writer:  # entered twice while open: still one
        assert db._group._open == before + 1
    assert db._group._open == before


def test_a_writer_closing_stops_a_leader_waiting_for_it(
    db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain that ends (its writer closed) is not waited for: the leader commits at once
    instead of waiting out its slice."""
    from dcache import _writer

    monkeypatch.setattr(_writer, "GATHER_SLICE", 20.0)
    monkeypatch.setattr(_writer, "GATHER_MAX", 30.0)
    job = created(db, n=1)
    idle = db.writer()
    idle.__enter__()
    took: list[float] = []

    def write() -> None:
        with db.writer() as writer:
            t0 = time.monotonic()
            assert writer.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored
            took.append(time.monotonic() - t0)

    leader = threading.Thread(target=write)
    leader.start()
    until_gathering(db, leader)  # the leader waits for the idle writer's outcome
    idle.close()
    leader.join(10)
    assert not leader.is_alive() and took and took[0] < 10  # not the 20 s slice
    assert db._group._open == 0


def test_an_outcome_the_database_refuses_does_not_fail_the_others_in_its_batch(db: DB) -> None:
    """One refused result (too large for the server, say) is answered alone; the rest commit."""
    good = [created(db, caller=f"g{i}", n=1) for i in range(6)]
    bad = created(db, caller="bad", n=1)
    undo = _break_statements(db, "refuse me", table="batch_target")
    errors: dict[str, BaseException] = {}
    outs: dict[str, dcache.WriteOutcome] = {}
    barrier = threading.Barrier(7)

    def write(job: JobRow, result: str) -> None:
        barrier.wait(10)
        try:
            outs[job.id] = db.write_target(job.id, 0, status="done", result=result, ttl=TTL, now=T0)
        except dcache.StoreError as exc:
            errors[job.id] = exc

    threads = [threading.Thread(target=write, args=(j, "fine")) for j in good]
    threads.append(threading.Thread(target=write, args=(bad, "refuse me")))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        undo()
    assert set(errors) == {bad.id}
    assert not isinstance(errors[bad.id], dcache.StoreUnavailableError)
    assert all(outs[j.id] == dcache.WriteOutcome(True, "done", True) for j in good)
    assert job_of(db, bad.id).targets_done == 0


def _refusing_trigger(db: DB, marker: str) -> Any:
    """A trigger that makes the server itself refuse a target update storing ``marker``
    (nothing watches statements, so the writer runs its production path); the undo."""
    stmts = {
        "sqlite": [
            "CREATE TRIGGER refuse_marker BEFORE UPDATE ON batch_target "
            f"WHEN NEW.result = '{marker}' BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ],
        "postgresql": [
            "CREATE FUNCTION refuse_marker() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF NEW.result = '{marker}' THEN RAISE EXCEPTION 'refused'; END IF; "
            "RETURN NEW; END $$",
            "CREATE TRIGGER refuse_marker BEFORE UPDATE ON batch_target "
            "FOR EACH ROW EXECUTE FUNCTION refuse_marker()",
        ],
        "mysql": [
            "CREATE TRIGGER refuse_marker BEFORE UPDATE ON batch_target FOR EACH ROW BEGIN "
            f"IF NEW.result = '{marker}' THEN SIGNAL SQLSTATE '22001' "
            "SET MESSAGE_TEXT = 'refused', MYSQL_ERRNO = 1406; END IF; END"
        ],
    }[db.dialect]
    drops = {
        "sqlite": ["DROP TRIGGER refuse_marker"],
        "postgresql": ["DROP TRIGGER refuse_marker ON batch_target", "DROP FUNCTION refuse_marker"],
        "mysql": ["DROP TRIGGER refuse_marker"],
    }[db.dialect]
    with db.engine.begin() as conn:
        for sql in stmts:
            conn.exec_driver_sql(sql)

    def undo() -> None:
        with db.engine.begin() as conn:
            for sql in drops:
                conn.exec_driver_sql(sql)

    return undo


def one_batch_with_a_refusal(
    db: DB, first: JobRow, others: list[JobRow], bad: JobRow, *, job_row: bool = False
) -> tuple[dict[str, dcache.WriteOutcome], dict[str, BaseException]]:
    """Write target 0 of ``first``, ``others`` and ``bad`` (whose result the server
    refuses) at once; each job's answer or error. On the servers ``first`` is held on a
    row lock until the others have queued behind it, so they form one batch for certain."""
    undo = _refusing_trigger(db, "refuse me")
    errors: dict[str, BaseException] = {}
    outs: dict[str, dcache.WriteOutcome] = {}

    def write(job: JobRow, result: str) -> None:
        try:
            outs[job.id] = db.write_target(
                job.id, 0, status="done", result=result, ttl=TTL, now=T0, job_row=job_row
            )
        except dcache.StoreError as exc:
            errors[job.id] = exc

    try:
        leader = threading.Thread(target=write, args=(first, "fine"))
        threads = [threading.Thread(target=write, args=(j, "fine")) for j in others]
        threads.append(threading.Thread(target=write, args=(bad, "refuse me")))
        if db.dialect != "sqlite":
            with job_row_locked(db, first.id):
                queue_behind_a_lock(db, leader, threads)
        else:
            for t in [leader, *threads]:
                t.start()
        join_all([leader, *threads])
    finally:
        undo()
    return outs, errors


def test_a_batch_with_an_outcome_the_server_refuses_commits_the_others(db: DB) -> None:
    """The group writer's production path (nobody watching statements; on PostgreSQL the
    batch pipelined in one round trip): the server refuses one outcome of a batch, which
    is answered alone with its error, and the others are committed."""
    first = created(db, caller="first", n=1)
    good = [created(db, caller=f"g{i}", n=1) for i in range(5)]
    bad = created(db, caller="bad", n=1)
    commits_before = db._group.commits
    outs, errors = one_batch_with_a_refusal(db, first, good, bad)
    assert set(errors) == {bad.id}
    assert not isinstance(errors[bad.id], dcache.StoreUnavailableError)
    assert all(outs[j.id] == dcache.WriteOutcome(True, "done", True) for j in [first, *good])
    assert job_of(db, bad.id).targets_done == 0
    found = db.get_job_with_targets(bad.id, now=T0)
    assert found is not None and found[1][0].status == "pending"
    if db.dialect != "sqlite":  # the leader's commit, then one for the five the refusal left
        assert db._group.commits - commits_before == 2


def test_writes_asking_for_their_jobs_in_one_batch_each_get_their_own(db: DB) -> None:
    """Outcomes committed together (pipelined on PostgreSQL; retried one by one when the
    server refuses one of them) each answer their own job's row, equal to a read of it."""
    first = created(db, caller="first", n=1)
    good = [created(db, caller=f"g{i}", n=1) for i in range(4)]
    running = created(db, caller="running", n=2)  # its write leaves it running: no row
    bad = created(db, caller="bad", n=1)
    outs, errors = one_batch_with_a_refusal(db, first, [*good, running], bad, job_row=True)
    assert set(errors) == {bad.id}
    for job in [first, *good]:
        out = outs[job.id]
        assert out.job is not None and out.job.id == job.id
        assert out.job == job_of(db, job.id)
        assert (out.job.status, out.job.targets_done) == ("done", 1)
    assert outs[running.id] == dcache.WriteOutcome(True, "running")


@contextlib.contextmanager
def first_write_held(
    db: DB,
    jobs_: list[JobRow],
    write: Any,
    hook: Any,
    holding: threading.Event,
    hold: threading.Event,
) -> Iterator[list[threading.Thread]]:
    """``write(job)`` on a thread for each job, with ``hook`` watching statements: the
    first write is held in it (it sets ``holding``, then waits for ``hold``) until the
    others have queued behind its commit. Yields the threads; ``hold`` is set, and the
    hook removed, on the way out."""
    event.listen(db.engine, "before_cursor_execute", hook)
    try:
        first = threading.Thread(target=write, args=(jobs_[0],))
        first.start()
        assert holding.wait(10)
        rest = [threading.Thread(target=write, args=(j,)) for j in jobs_[1:]]
        for t in rest:
            t.start()
        wait_queued(db, len(rest))
        yield [first, *rest]
    finally:
        hold.set()
        event.remove(db.engine, "before_cursor_execute", hook)


def test_an_interrupted_leader_answers_its_batch_and_hands_the_writer_on(db: DB) -> None:
    """An interrupt in the thread leading a commit (a BaseException out of a statement:
    KeyboardInterrupt, SystemExit) stops that thread, answers every other outcome of its
    batch with a StoreError (none is left waiting), writes none of them, and leaves the
    writer to the next write. The first leader is held in its statement until three
    writes have queued behind it; the one that leads their batch is interrupted."""
    jobs_ = [created(db, caller=f"c{i}", n=1) for i in range(4)]
    hold, holding = threading.Event(), threading.Event()
    writes: list[str] = []

    def hook(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "UPDATE batch_target" not in statement:
            return
        writes.append(statement)
        if len(writes) == 1:  # the first leader: held until the others have queued
            holding.set()
            hold.wait(10)
        elif len(writes) == 2:  # the leader of their batch
            raise KeyboardInterrupt

    outs: dict[str, dcache.WriteOutcome] = {}
    errors: dict[str, dcache.StoreError] = {}
    interrupted: list[str] = []

    def write(job: JobRow) -> None:
        try:
            outs[job.id] = db.write_target(job.id, 0, status="done", ttl=TTL, now=T0)
        except dcache.StoreError as exc:
            errors[job.id] = exc
        except KeyboardInterrupt:
            interrupted.append(job.id)

    with first_write_held(db, jobs_, write, hook, holding, hold) as writers:
        hold.set()
        join_all(writers)
    assert outs == {jobs_[0].id: dcache.WriteOutcome(True, "done", True)}
    assert len(interrupted) == 1
    assert set(errors) == {j.id for j in jobs_[1:]} - set(interrupted)
    assert not any(isinstance(e, dcache.StoreUnavailableError) for e in errors.values())
    for job in jobs_[1:]:  # none was written, and the writer goes on
        assert job_of(db, job.id).targets_done == 0
        assert db.write_target(job.id, 0, status="done", ttl=TTL, now=T0).stored


def first_target_update_held() -> tuple[Any, threading.Event, threading.Event]:
    """A ``before_cursor_execute`` hook that holds the first target update in it (setting
    ``holding``) until ``hold`` is set; ``(hook, hold, holding)``."""
    hold, holding = threading.Event(), threading.Event()

    def hook(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "UPDATE batch_target" in statement and not holding.is_set():
            holding.set()
            hold.wait(10)

    return hook, hold, holding


def one_held_batch(
    db: DB, jobs_: list[JobRow], idx: Any = lambda _job: 0
) -> tuple[dict[str, dcache.WriteOutcome], dict[str, dcache.StoreError]]:
    """Write target ``idx(job)`` of each job, the first held until the others have queued
    behind it (so they form one batch); each job's answer, and each one's error."""
    hook, hold, holding = first_target_update_held()
    outs: dict[str, dcache.WriteOutcome] = {}
    errors: dict[str, dcache.StoreError] = {}

    def write(job: JobRow) -> None:
        try:
            outs[job.id] = db.write_target(job.id, idx(job), status="done", ttl=TTL, now=T0)
        except dcache.StoreError as exc:
            errors[job.id] = exc

    with first_write_held(db, jobs_, write, hook, holding, hold) as writers:
        hold.set()
        join_all(writers)
    return outs, errors


def test_an_outcome_that_breaks_its_own_statement_in_python_fails_alone(db: DB) -> None:
    """An error that is no database's (a caller's index no integer column holds: SQLite's
    driver raises OverflowError before sending it) is that outcome's own: it is answered
    with it, and the others of its batch are committed without it."""
    jobs_ = [created(db, caller=f"c{i}", n=1) for i in range(4)]
    bad = jobs_[2]
    outs, errors = one_held_batch(db, jobs_, lambda job: 2**64 if job is bad else 0)
    if db.dialect == "mysql":  # MariaDB compares 2**64 with the column: no such target
        assert not errors and not outs[bad.id].stored
    else:
        assert set(errors) == {bad.id}, errors
        assert not isinstance(errors[bad.id], dcache.StoreUnavailableError)
    for job in jobs_:
        if job is not bad:
            assert outs[job.id] == dcache.WriteOutcome(True, "done", True)
    assert job_of(db, bad.id).targets_done == 0


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_a_lock_wait_on_one_outcomes_row_does_not_fail_the_others(
    backend: str, tmp_path: Path
) -> None:
    """Another session holds one job's row (an operator's transaction, a stalled peer)
    past the server's lock timeout: that outcome alone is answered "retry later"; the
    others of its batch are committed (they all failed with it, and each retry met the
    same lock again, so every drain of the process stalled behind one row)."""
    options = (
        {"options": "-c lock_timeout=300"}
        if backend == "postgresql"
        else {"init_command": "SET SESSION innodb_lock_wait_timeout = 1"}
    )
    db = DB.open(backend_url(backend, tmp_path), connect_args=options)
    wipe(db)
    jobs_ = [created(db, caller=f"c{i}", n=1) for i in range(4)]
    bad = jobs_[2]
    try:
        with job_row_locked(db, bad.id):
            outs, errors = one_held_batch(db, jobs_)
        assert set(errors) == {bad.id}, errors
        assert isinstance(errors[bad.id], dcache.StoreUnavailableError)
        for job in jobs_:
            if job is not bad:
                assert outs[job.id] == dcache.WriteOutcome(True, "done", True)
        # The lock gone, its retry is stored.
        assert db.write_target(bad.id, 0, status="done", ttl=TTL, now=T0).stored
    finally:
        db.close()


def test_closing_the_writer_waits_for_the_commit_under_way(db: DB) -> None:
    """The store's writer gives its connection back only once the batch being committed
    is answered: a close() during a commit waits for it (and is woken when it ends), and
    the outcomes written meanwhile are all stored."""
    jobs_ = [created(db, caller=f"c{i}", n=1) for i in range(3)]
    hook, hold, holding = first_target_update_held()

    outs: dict[str, dcache.WriteOutcome] = {}
    closed = threading.Event()

    def write(job: JobRow) -> None:
        outs[job.id] = db.write_target(job.id, 0, status="done", ttl=TTL, now=T0)

    def close() -> None:
        db._group.close()
        closed.set()

    with first_write_held(db, jobs_, write, hook, holding, hold) as writers:
        closer = threading.Thread(target=close)
        closer.start()
        assert not closed.wait(0.3), "close() returned while a commit was under way"
        hold.set()
        join_all([*writers, closer])
    assert closed.is_set() and db._group._closers == 0
    assert outs == {j.id: dcache.WriteOutcome(True, "done", True) for j in jobs_}
    assert all(job_of(db, j.id).targets_done == 1 for j in jobs_)


@pytest.mark.parametrize("backend", ["postgresql", "pgbouncer"])
def test_postgresql_commits_a_batch_in_one_exchange_with_the_server(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """Nobody watching statements, each outcome is one statement and a batch of them one
    implicit transaction: the wire carries no BEGIN and no COMMIT, and the server answers
    once per commit (one ReadyForQuery), whatever the batch's size. The first drain's
    first write is held on a row lock until the other three have queued behind it, so
    (through PgBouncer too) at least one batch of several is pipelined."""
    import psycopg

    store = DB.open(backend_url(backend, tmp_path), pool_size=1, max_overflow=0)
    try:
        jobs_ = [created(store, caller=f"c{i}", n=4) for i in range(4)]
        assert store.write_target(jobs_[0].id, 0, status="done", ttl=TTL, now=T0).stored
        conn = store._group._conn
        assert conn is not None
        raw = conn.connection.driver_connection
        trace = tmp_path / "writes.trace"
        commits_before = store._group.commits

        def drain(job: JobRow) -> None:
            for i in range(1 if job is jobs_[0] else 0, 4):
                out = store.write_target(job.id, i, status="done", result="r", ttl=TTL, now=T0)
                assert out.stored

        with trace.open("w") as out:
            raw.pgconn.trace(out.fileno())
            raw.pgconn.set_trace_flags(
                psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE
            )
            try:
                first = threading.Thread(target=drain, args=(jobs_[0],))
                others = [threading.Thread(target=drain, args=(j,)) for j in jobs_[1:]]
                with job_row_locked(db, jobs_[0].id):
                    queue_behind_a_lock(store, first, others)
                join_all([first, *others])
            finally:
                raw.pgconn.untrace()
        commits = store._group.commits - commits_before
        sent = [line.split("\t") for line in trace.read_text().splitlines()]
        to_server = " ".join(" ".join(f[2:]) for f in sent if f[0] == "F").upper()
        for word in ("BEGIN", "COMMIT", "ROLLBACK"):
            assert word not in to_server
        executes = [f for f in sent if f[0] == "F" and f[2].startswith("Execute")]
        ready = [f for f in sent if f[0] == "B" and f[2].startswith("ReadyForQuery")]
        # psycopg prepares a statement run often enough in an exchange of its own, once
        # per connection (not behind PgBouncer, where the store turns that off).
        prepares = [f for f in sent if f[0] == "F" and f[2] == "Parse" and '"_pg3_' in f[3]]
        assert len(executes) == 15  # every outcome, one statement each
        assert len(ready) == commits + len(prepares), sent
        assert commits < 15  # the three queued behind the lock went in one batch at least
        for job in jobs_:
            assert job_of(store, job.id).status == "done"
    finally:
        store.close()


# -- status changes ------------------------------------------------------------------------


def test_cancel_wins_once(db: DB) -> None:
    """cancel is a compare-and-set: True for the live job once, then False; bumps the lease."""
    job = created(db)
    at = T0 + dt.timedelta(minutes=3)
    assert db.cancel(job.id, now=at) is True
    assert db.cancel(job.id, now=at) is False
    stored = job_of(db, job.id, now=at)
    assert (stored.status, stored.updated_at, stored.expires_at) == ("cancelled", at, at + TTL)
    assert stored.finished_at is None
    assert db.live_batch_jobs("alice") == 0


def test_cancel_of_an_unknown_or_terminal_job_is_false(db: DB) -> None:
    """Rule 6 and 9: bad ids and finished jobs are a plain False, never an error."""
    assert db.cancel("no-such-job", now=T0) is False
    job = created(db, n=1)
    db.write_target(job.id, 0, status="done", ttl=TTL, now=T0)
    assert db.cancel(job.id, now=T0) is False
    assert job_of(db, job.id).status == "done"
    failed = created(db, n=1)
    assert db.fail_job(failed.id, "x", now=T0)
    assert db.cancel(failed.id, now=T0) is False


def test_fail_job_marks_a_live_job_failed_and_finished(db: DB) -> None:
    """fail_job is a compare-and-set that records the reason, finished_at and a fresh lease."""
    job = created(db)
    at = T0 + dt.timedelta(minutes=1)
    assert db.fail_job(job.id, "worker died", now=at) is True
    assert db.fail_job(job.id, "again", now=at) is False
    assert db.fail_job("no-such-job", "x", now=at) is False
    stored = job_of(db, job.id, now=at)
    assert (stored.status, stored.error, stored.finished_at) == ("failed", "worker died", at)
    assert stored.expires_at == at + TTL
    cancelled = created(db)
    assert db.cancel(cancelled.id, now=at)
    assert db.fail_job(cancelled.id, "x", now=at) is False
    assert job_of(db, cancelled.id).status == "cancelled"


def test_mark_finished_closes_a_stopped_job_once(db: DB) -> None:
    """A cancelled job whose drain stopped between targets gets finished_at exactly once."""
    job = created(db)
    assert db.mark_finished(job.id, now=T0) is False  # still live: the drain owns it
    assert db.mark_finished("no-such-job", now=T0) is False
    assert db.cancel(job.id, now=T0)
    at = T0 + dt.timedelta(seconds=30)
    assert db.mark_finished(job.id, now=at) is True
    assert db.mark_finished(job.id, now=at + dt.timedelta(seconds=1)) is False
    stored = job_of(db, job.id, now=at)
    assert (stored.status, stored.finished_at, stored.expires_at) == ("cancelled", at, at + TTL)


def test_mark_in_flight_failed_fails_live_jobs_and_keeps_their_targets(db: DB) -> None:
    """Rule 8: on restart live jobs fail; stored targets stay readable, pending ones pending."""
    started = created(db, caller="a", n=3)
    db.write_target(started.id, 0, status="done", result="kept", ttl=TTL, now=T0)
    fresh = created(db, caller="b", n=1)
    done = created(db, caller="c", n=1)
    db.write_target(done.id, 0, status="done", ttl=TTL, now=T0)
    cancelled = created(db, caller="d", n=1)
    assert db.cancel(cancelled.id, now=T0)

    at = T0 + dt.timedelta(minutes=9)
    assert db.mark_in_flight_failed("restart", now=at) == 2
    assert db.live_batch_jobs_total() == 0
    for job in (started, fresh):
        stored = job_of(db, job.id, now=at)
        assert (stored.status, stored.error, stored.finished_at) == ("failed", "restart", at)
        assert stored.expires_at == at + TTL  # readable a full TTL after the restart
    found = db.get_job_with_targets(started.id, now=at + TTL - dt.timedelta(seconds=1))
    assert found is not None
    assert [(t.status, t.result) for t in found[1]] == [
        ("done", "kept"),
        ("pending", None),
        ("pending", None),
    ]
    assert found[0].targets_done == 1
    # Terminal jobs keep their status; an unfinished cancelled one is closed.
    assert job_of(db, done.id).status == "done"
    assert job_of(db, done.id).error == ""
    closed = job_of(db, cancelled.id, now=at)
    assert (closed.status, closed.finished_at) == ("cancelled", at)
    assert db.mark_in_flight_failed("restart", now=at) == 0


def test_mark_in_flight_failed_uses_the_clock_when_now_is_omitted(db: DB) -> None:
    """The restart call in an app passes no time: the wall clock must be used, aware UTC."""
    before = dcache.utcnow()
    job = created(db, now=before)
    assert db.mark_in_flight_failed("restart") == 1
    stored = db.get_job(job.id)
    assert stored is not None
    assert stored.finished_at is not None
    assert stored.finished_at.tzinfo is not None
    assert before <= stored.finished_at <= dcache.utcnow()


def test_mark_in_flight_failed_refuses_a_reason_that_is_no_text(db: DB) -> None:
    """The reason becomes every live job's error: None or a number is a TypeError before
    anything is written, not the database's NOT NULL failure mid-transaction."""
    job = created(db)
    for reason in (None, 1, b"restart"):
        with pytest.raises(TypeError, match="reason must be a str"):
            db.mark_in_flight_failed(reason)  # type: ignore[arg-type]
    assert job_of(db, job.id).status == "running"
    assert db.mark_in_flight_failed("restart") == 1


def test_heartbeat_inserts_then_updates_the_owner_row(db: DB) -> None:
    """heartbeat is an upsert: started_at stays, heartbeat_at moves; remove_owner forgets it."""
    db.heartbeat("runner-1", now=T0)
    db.heartbeat("runner-1", now=T0 + dt.timedelta(seconds=5))
    with db.engine.begin() as conn:
        rows = conn.execute(
            select(owners.c.owner, owners.c.heartbeat_at, owners.c.started_at)
        ).all()
    assert [tuple(r) for r in rows] == [("runner-1", T0 + dt.timedelta(seconds=5), T0)]
    db.remove_owner("runner-1")
    db.remove_owner("never-seen")
    assert sql(db, "SELECT count(*) FROM batch_owner")[0][0] == 0


def test_reap_orphans_fails_only_jobs_of_stale_or_missing_owners(db: DB) -> None:
    """Scale-out rule 8: a live runner's jobs are untouched; a dead runner's are failed."""
    now = T0 + dt.timedelta(minutes=5)
    stale_after = dt.timedelta(minutes=1)
    db.heartbeat("alive", now=now - dt.timedelta(seconds=10))
    db.heartbeat("stale", now=now - dt.timedelta(minutes=2))
    mine = created(db, caller="a", owner="alive")
    theirs = created(db, caller="b", owner="stale")
    ghost = created(db, caller="c", owner="ghost")  # no owner row at all
    stopped = created(db, caller="d", owner="stale")
    assert db.cancel(stopped.id, now=T0)
    finished = created(db, caller="e", owner="stale", n=1)
    db.write_target(finished.id, 0, status="done", ttl=TTL, now=T0)

    assert db.reap_orphans("owner lost", stale_after, now=now) == 2
    assert job_of(db, mine.id, now=now).status == "running"
    for job in (theirs, ghost):
        stored = job_of(db, job.id, now=now)
        assert (stored.status, stored.error, stored.finished_at) == ("failed", "owner lost", now)
    assert job_of(db, stopped.id, now=now).finished_at == now
    assert job_of(db, finished.id, now=now).status == "done"
    owners = [r[0] for r in sql(db, "SELECT owner FROM batch_owner ORDER BY owner")]
    assert owners == ["alive"]
    assert db.reap_orphans("owner lost", stale_after, now=now) == 0


def test_reap_orphans_honours_the_deadline_an_owner_declared(db: DB) -> None:
    """A peer with a slower heartbeat (a rolling deploy) is not reaped before its own deadline."""
    db.heartbeat("slow", now=T0, stale_after=dt.timedelta(minutes=10))
    job = created(db, owner="slow")
    reaper_says = dt.timedelta(minutes=1)
    assert db.reap_orphans("owner lost", reaper_says, now=T0 + dt.timedelta(minutes=5)) == 0
    assert job_of(db, job.id).status == "running"
    assert [r[0] for r in sql(db, "SELECT owner FROM batch_owner")] == ["slow"]
    late = T0 + dt.timedelta(minutes=11)
    assert db.reap_orphans("owner lost", reaper_says, now=late) == 1
    assert job_of(db, job.id, now=late).status == "failed"
    assert sql(db, "SELECT count(*) FROM batch_owner")[0][0] == 0


def test_purge_deletes_only_lapsed_jobs_that_are_not_live(db: DB) -> None:
    """Purge frees space, but a live job is never purged, whatever its expires_at says."""
    lapsed = []
    for caller in ("a", "b", "c"):
        job = created(db, caller=caller, n=2)
        assert db.cancel(job.id, now=T0)
        assert db.mark_finished(job.id, now=T0)  # its drain has ended
        lapsed.append(job)
    done = created(db, caller="d", n=1)
    db.write_target(done.id, 0, status="done", result="x" * 1000, ttl=TTL, now=T0)
    lapsed.append(done)
    running = created(db, caller="e", n=2)  # lease lapses too, but it is live
    later = T0 + TTL
    kept = created(db, caller="f", n=2, now=later)
    assert db.cancel(kept.id, now=later)  # not live, lease holds

    assert db.purge_expired(now=later, limit=1) == 4  # four batches of one
    for job in lapsed:
        assert sql(db, "SELECT count(*) FROM batch_job WHERE id = :j", j=job.id)[0][0] == 0
        assert target_count(db, job.id) == 0
    assert job_of(db, running.id, now=later).status == "running"
    assert target_count(db, running.id) == 2
    assert job_of(db, kept.id, now=later).status == "cancelled"
    assert target_count(db, kept.id) == 2
    assert db.purge_expired(now=later, limit=1) == 0


def test_purge_keeps_a_cancelled_job_until_its_drain_has_ended(db: DB) -> None:
    """A fetch may outlast the TTL: while its owner is registered, the cancelled job
    stays, lapsed or not, until its drain stores the in-flight target (which ends it);
    then a full TTL more. An owner gone (stopped cleanly, or reaped) has no drain left:
    its cancelled jobs lapse as any other (a `batch cancel` of a dead script's job), and
    so do those of an owner that has not beaten since their lease lapsed."""
    db.heartbeat("runner-1", now=T0)
    db.heartbeat("runner-3", now=T0)  # then it died: its row stays, no runner reaps it
    job = created(db, n=2, owner="runner-1")
    orphan = created(db, n=2, caller="bob", owner="runner-2")  # no owner row
    stale = created(db, n=2, caller="carol", owner="runner-3")
    for j in (job, orphan, stale):
        assert db.cancel(j.id, now=T0)
    later = T0 + 3 * TTL
    db.heartbeat("runner-1", now=later)  # alive, its drain still fetching
    assert db.purge_expired(now=later) == 2
    assert db.lookup(orphan.id, now=later).state == "expired"
    assert db.lookup(stale.id, now=later).state == "expired"
    out = db.write_target(job.id, 0, status="done", result="late", ttl=TTL, now=later)
    assert out.stored and out.finished
    assert db.purge_expired(now=later + TTL - dt.timedelta(microseconds=1)) == 0
    found = db.get_job_with_targets(job.id, now=later)
    assert found is not None
    assert found[0].status == "cancelled" and found[1][0].result == "late"
    assert db.purge_expired(now=later + TTL) == 1
    assert db.lookup(job.id, now=later + TTL).state == "expired"
    again = created(db, n=1, owner="runner-1", now=later)
    assert db.cancel(again.id, now=later)
    db.remove_owner("runner-1")  # stopped cleanly: none of its drains is left
    assert db.purge_expired(now=later + TTL) == 1


@pytest.mark.parametrize(
    "bad", [{"limit": -1}, {"limit": 0}, {"limit": 2.5}, {"max_batches": 0}, {"limit": True}]
)
def test_purge_bounds_that_are_not_positive_ints_are_value_errors(
    db: DB, bad: dict[str, Any]
) -> None:
    """``limit=-1`` purged everything in one transaction on SQLite and was a driver
    error on the servers; 2.5 purged two."""
    for caller in "abc":
        assert db.fail_job(created(db, caller=caller).id, "x", now=T0)
    with pytest.raises(ValueError, match=next(iter(bad))):
        db.purge_expired(now=T0 + TTL, **bad)
    assert sql(db, "SELECT count(*) FROM batch_job")[0][0] == 3


def tombstone_count(db: DB) -> int:
    return int(sql(db, "SELECT count(*) FROM batch_tombstone")[0][0])


def tombstone_ids(db: DB) -> set[str]:
    return {r[0] for r in sql(db, "SELECT id FROM batch_tombstone")}


def test_purge_stops_after_max_batches(db: DB) -> None:
    """Purge is bounded: each call does at most max_batches batches of limit jobs."""
    for caller in "abcde":
        assert db.fail_job(created(db, caller=caller).id, "x", now=T0)
    later = T0 + TTL
    assert db.purge_expired(now=later, limit=2, max_batches=1) == 2
    assert db.purge_expired(now=later, limit=2, max_batches=1) == 2
    assert db.purge_expired(now=later, limit=2, max_batches=1) == 1
    assert db.purge_expired(now=later, limit=2) == 0
    assert sql(db, "SELECT count(*) FROM batch_target")[0][0] == 0


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "stored-before-v3"])
def test_a_purge_transaction_deletes_a_bounded_number_of_bytes(db: DB, sized: bool) -> None:
    """A purge batch is bounded by what it deletes, not only by its number of jobs: 500
    lapsed jobs of large results in one transaction held SQLite's write lock (and
    MariaDB's drains) for seconds. Each transaction takes the oldest jobs up to
    ``PURGE_BATCH_BYTES`` of stored results (at least one job); a result stored before
    schema version 3 (no ``result_bytes``) is weighed by its length."""
    from dcache._upkeep import PURGE_BATCH_BYTES

    big = "x" * (PURGE_BATCH_BYTES * 5 // 8)  # one fits in a batch, two do not
    ids = []
    for caller in "abcd":
        job = created(db, caller=caller, n=1)
        db.write_target(job.id, 0, status="done", result=big, ttl=TTL, now=T0)
        ids.append(job.id)
    next_second = T0 + dt.timedelta(seconds=1)  # their leases lapse after the large ones'
    small = [created(db, caller=f"s{i}", n=2, now=next_second) for i in range(3)]
    for job in small:
        for idx in range(2):
            db.write_target(job.id, idx, status="done", result="r", ttl=TTL, now=next_second)
    if not sized:
        sql(db, "UPDATE batch_target SET result_bytes = NULL")
    later = T0 + 2 * TTL
    assert db.purge_expired(now=later, max_batches=1) == 1
    assert db.purge_expired(now=later, max_batches=2) == 2
    # The last large one and the small ones after it share a batch.
    assert db.purge_expired(now=later, max_batches=1) == 4
    assert db.purge_expired(now=later) == 0
    assert sql(db, "SELECT count(*) FROM batch_job")[0][0] == 0
    assert sql(db, "SELECT count(*) FROM batch_tombstone")[0][0] == 7


# -- reads ---------------------------------------------------------------------------------


def test_reads_hide_a_lapsed_job(db: DB) -> None:
    """Rule: a job whose lease lapsed is invisible to every read, before any purge."""
    job = created(db)
    assert db.cancel(job.id, now=T0)
    edge = T0 + TTL - dt.timedelta(microseconds=1)
    assert db.get_job(job.id, now=edge) is not None
    assert db.get_job_with_targets(job.id, now=edge) is not None
    assert [j.id for j in db.list_jobs(now=edge)] == [job.id]
    assert db.batch_job_by_idem("alice", job.idem_key, now=edge) is not None
    lapsed = T0 + TTL
    assert db.get_job(job.id, now=lapsed) is None
    assert db.get_job_with_targets(job.id, now=lapsed) is None
    assert db.list_jobs(now=lapsed) == []
    assert db.batch_job_by_idem("alice", job.idem_key, now=lapsed) is None


def test_reads_always_show_a_live_job(db: DB) -> None:
    """A running job whose expires_at passed is still visible: live jobs are never hidden."""
    job = created(db, n=2)
    far = T0 + 50 * TTL
    assert job_of(db, job.id, now=far).status == "running"
    found = db.get_job_with_targets(job.id, now=far)
    assert found is not None
    assert len(found[1]) == 2
    assert [j.id for j in db.list_jobs(now=far)] == [job.id]


def test_reads_of_an_unknown_job_are_none(db: DB) -> None:
    """Rule 9: a bad id is None, not an error."""
    assert db.get_job("missing", now=T0) is None
    assert db.get_job_with_targets("missing", now=T0) is None
    assert db.batch_job_by_idem("nobody", idem("x"), now=T0) is None


def test_list_jobs_filters_by_caller_and_liveness_newest_first(db: DB) -> None:
    """list_jobs is the admin view: newest first, optional caller and live-only filters, limit."""
    a1 = created(db, caller="a", now=T0)
    b1 = created(db, caller="b", now=T0 + dt.timedelta(seconds=1))
    a2 = created(db, caller="a", now=T0 + dt.timedelta(seconds=2))
    assert db.cancel(a1.id, now=T0 + dt.timedelta(seconds=3))
    at = T0 + dt.timedelta(seconds=4)
    assert [j.id for j in db.list_jobs(now=at)] == [a2.id, b1.id, a1.id]
    assert [j.id for j in db.list_jobs(caller="a", now=at)] == [a2.id, a1.id]
    assert [j.id for j in db.list_jobs(live_only=True, now=at)] == [a2.id, b1.id]
    assert [j.id for j in db.list_jobs(caller="a", live_only=True, now=at)] == [a2.id]
    assert [j.id for j in db.list_jobs(limit=1, now=at)] == [a2.id]
    assert db.list_jobs(caller="nobody", now=at) == []


def test_live_counts_and_idem_lookup(db: DB) -> None:
    """The seed's lookups: live counts by status only, idem lookup by (caller, key)."""
    a = created(db, caller="a")
    created(db, caller="a")
    created(db, caller="b")
    assert db.cancel(a.id, now=T0)
    assert db.live_batch_jobs("a") == 1
    assert db.live_batch_jobs("b") == 1
    assert db.live_batch_jobs("c") == 0
    assert db.live_batch_jobs_total() == 2
    found = db.batch_job_by_idem("a", a.idem_key, now=T0)
    assert found is not None
    assert (found.id, found.status) == (a.id, "cancelled")
    assert db.batch_job_by_idem("b", a.idem_key, now=T0) is None


# -- values: big results, unicode, time ----------------------------------------------------


def test_an_8_mib_unicode_result_round_trips(db: DB) -> None:
    """Fetched pages are megabytes of any script: the result column must hold 8 MiB exactly."""
    unit = "aé漢😀\n"  # 1 + 2 + 3 + 4 + 1 bytes in UTF-8
    big = unit * (8 * MiB // len(unit.encode()) + 1)
    assert len(big.encode()) >= 8 * MiB
    job = created(db, n=1)
    url = "https://例え.jp/ü?q=😀"
    other = created(db, caller="ü-😀", n=1)
    out = db.write_target(job.id, 0, status="done", result=big, ttl=TTL, now=T0)
    assert out.stored
    db.write_target(other.id, 0, status="failed", error="ошибка 😀", hint="ヒント", ttl=TTL, now=T0)
    found = db.get_job_with_targets(job.id, now=T0)
    assert found is not None
    assert found[1][0].result == big
    assert found[0].status == "done"
    theirs = db.get_job_with_targets(other.id, now=T0)
    assert theirs is not None
    assert theirs[0].caller == "ü-😀"
    assert (theirs[1][0].error, theirs[1][0].hint) == ("ошибка 😀", "ヒント")
    unicode_job = db.submit(
        job_id=uuid.uuid4().hex,
        caller="alice",
        caller_class="user",
        idem_key=idem("u"),
        targets=[NewTarget(url, '{"question":"¿qué?"}')],
        ttl=TTL,
        jobs_per_caller=8,
        jobs_total=8,
        now=T0,
    )
    assert unicode_job.job is not None
    read = db.get_job_with_targets(unicode_job.job.id, now=T0)
    assert read is not None
    assert (read[1][0].url, read[1][0].options) == (url, '{"question":"¿qué?"}')


def test_timestamps_round_trip_as_aware_utc_with_microseconds(db: DB) -> None:
    """Leases are compared to the microsecond; a lost fraction or zone would move them."""
    at = dt.datetime(2031, 6, 15, 12, 34, 56, 789012, tzinfo=UTC)
    ttl = dt.timedelta(seconds=90)
    job = created(db, n=2, now=at, ttl=ttl)
    wrote = at + dt.timedelta(microseconds=1)
    db.write_target(job.id, 0, status="done", ttl=ttl, now=wrote)
    found = db.get_job_with_targets(job.id, now=at)
    assert found is not None
    stored, targets = found
    for value in (stored.created_at, stored.updated_at, stored.expires_at, targets[0].updated_at):
        assert value is not None
        assert value.tzinfo is not None
        assert value.utcoffset() == dt.timedelta(0)
    assert stored.created_at == at
    assert stored.updated_at == wrote
    assert stored.expires_at == wrote + ttl
    assert targets[0].updated_at == wrote


def test_the_job_ttl_round_trips_exactly(db: DB) -> None:
    """Status changes re-lease with the stored ttl: a rounded ttl would move every expiry."""
    for ttl in (
        dt.timedelta(hours=24),
        dt.timedelta(days=14, seconds=7),  # more digits than a single-precision float holds
        dt.timedelta(seconds=90, microseconds=123457),
        dt.timedelta(days=40, seconds=789),
    ):
        job = created(db, ttl=ttl)
        assert job_of(db, job.id).ttl == ttl
        at = T0 + dt.timedelta(minutes=1)
        assert db.cancel(job.id, now=at)
        assert job_of(db, job.id, now=at).expires_at == at + ttl


def test_an_aware_non_utc_time_is_stored_as_the_same_instant(db: DB) -> None:
    """A caller in another zone gets the same instant back, expressed in UTC."""
    zone = dt.timezone(dt.timedelta(hours=5, minutes=30))
    at = dt.datetime(2030, 1, 1, 5, 30, 0, 250000, tzinfo=zone)
    job = created(db, now=at)
    stored = job_of(db, job.id, now=at)
    assert stored.created_at == at
    assert stored.created_at.utcoffset() == dt.timedelta(0)
    assert stored.created_at.replace(tzinfo=None) == dt.datetime(2030, 1, 1, 0, 0, 0, 250000)


EARLIEST = dt.datetime.min.replace(tzinfo=UTC)
LATEST = dt.datetime.max.replace(tzinfo=UTC)


def dialect_named(name: str) -> Any:
    """A fresh SQLAlchemy dialect of the named backend (``sqlite``, ``postgresql``,
    ``mysql``), for tests of compiled statements that need no server."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    return {"sqlite": sqlite, "postgresql": postgresql, "mysql": mysql}[name].dialect()


def edge_and_random_instants(seed: int) -> list[dt.datetime]:
    """The earliest and latest instants, two edges between, and 2,000 random ones."""
    rng = random.Random(seed)
    span = (LATEST - EARLIEST).total_seconds()
    return [
        EARLIEST,
        LATEST,
        dt.datetime(2030, 1, 1, tzinfo=UTC),
        dt.datetime(999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        *(EARLIEST + dt.timedelta(seconds=rng.uniform(0, span)) for _ in range(2000)),
    ]


def test_sqlite_stores_each_time_as_sqlalchemys_own_text_for_it() -> None:
    """On SQLite the store's UTC times are written in one step (one ``%`` format); the text
    must be what SQLAlchemy's DATETIME writes for the same instant, or comparisons in SQL
    (leases, purge) between old and new rows would go wrong. Checked against SQLAlchemy's
    own processor over edge and random instants, other zones and subclasses included."""
    from sqlalchemy import DateTime
    from sqlalchemy.dialects import sqlite

    from dcache._schema import UTCDateTime

    dialect = sqlite.dialect()
    ours = UTCDateTime().dialect_impl(dialect).bind_processor(dialect)
    sqlalchemys = DateTime().dialect_impl(dialect).bind_processor(dialect)
    assert ours is not None and sqlalchemys is not None

    class Sub(dt.datetime):
        pass

    lo, hi = EARLIEST, LATEST
    instants = edge_and_random_instants(12)
    zone = dt.timezone(dt.timedelta(hours=-7, minutes=-30))
    day = dt.timedelta(days=1)
    for at in instants:
        expected = sqlalchemys(at.replace(tzinfo=None))
        assert ours(at) == expected, at
        assert ours(Sub(*at.timetuple()[:6], at.microsecond, tzinfo=UTC)) == expected, at
        if lo + day < at < hi - day:  # the same instant in another zone
            assert ours(at.astimezone(zone)) == expected, at
    assert ours(None) is None
    with pytest.raises(ValueError):
        ours(dt.datetime(2030, 1, 1))


@pytest.mark.parametrize("dialect_name", ["sqlite", "postgresql", "mysql"])
def test_each_stored_time_reads_back_as_sqlalchemys_own_conversion_reads_it(
    dialect_name: str,
) -> None:
    """Reads convert stored times in one step (SQLite's text with ``fromisoformat``, a
    server's naive time with ``combine``): the same aware UTC time SQLAlchemy's own
    processor and ``replace(tzinfo=utc)`` give, over edge and random instants, for the
    text the store writes and for any other text SQLite may hold."""
    from sqlalchemy import DateTime

    from dcache._schema import UTCDateTime

    dialect = dialect_named(dialect_name)
    ours = UTCDateTime().dialect_impl(dialect).result_processor(dialect, None)
    write = UTCDateTime().dialect_impl(dialect).bind_processor(dialect)
    sqlalchemys = DateTime().dialect_impl(dialect).result_processor(dialect, None)
    assert ours is not None

    def reference(stored: object) -> dt.datetime:
        naive = sqlalchemys(stored) if sqlalchemys is not None else stored
        assert isinstance(naive, dt.datetime)
        return naive.replace(tzinfo=UTC)

    instants = edge_and_random_instants(13)
    for at in instants:
        stored = write(at) if write is not None else at.replace(tzinfo=None)
        back = ours(stored)
        assert back == reference(stored) == at, at
        assert back.tzinfo is UTC and type(back) is dt.datetime, at
    assert ours(None) is None
    if dialect_name == "sqlite":  # text SQLAlchemy reads that the store does not write
        for text in ("2030-01-02 03:04:05", "2030-01-02"):  # (3.10 reads no ".5")
            assert ours(text) == reference(text), text


@pytest.mark.parametrize(
    ("naive", "error"),
    [
        (dt.datetime(2030, 1, 1), ValueError),
        ("2030-01-01T00:00:00+00:00", TypeError),
        (dt.date(2030, 1, 1), TypeError),
        (1_900_000_000, TypeError),
    ],
    ids=["naive", "str", "date", "int"],
)
def test_a_naive_datetime_is_rejected(db: DB, naive: Any, error: type[Exception]) -> None:
    """Naive times are ambiguous (local or UTC?): every time-taking method refuses them,
    and a value that is no datetime at all is a TypeError saying so."""
    job = created(db)
    with pytest.raises(error):
        submit(db, now=naive)
    calls = [
        lambda: db.get_job(job.id, now=naive),
        lambda: db.get_job_with_targets(job.id, now=naive),
        lambda: db.list_jobs(now=naive),
        lambda: db.batch_job_by_idem("alice", job.idem_key, now=naive),
        lambda: db.write_target(job.id, 0, status="done", ttl=TTL, now=naive),
        lambda: db.cancel(job.id, now=naive),
        lambda: db.fail_job(job.id, "x", now=naive),
        lambda: db.mark_finished(job.id, now=naive),
        lambda: db.mark_in_flight_failed("x", now=naive),
        lambda: db.heartbeat("o", now=naive),
        lambda: db.reap_orphans("x", dt.timedelta(minutes=1), now=naive),
        lambda: db.purge_expired(now=naive),
    ]
    for call in calls:
        with pytest.raises(error, match="naive datetime" if error is ValueError else "now must be"):
            call()
    stored = job_of(db, job.id)
    assert (stored.status, stored.targets_done) == ("running", 0)
    assert db.live_batch_jobs_total() == 1


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres@127.0.0.1:1/nothing",
        "mysql+pymysql://root@127.0.0.1:1/nothing",
    ],
)
def test_an_unreachable_server_is_a_store_unavailable_error(url: str) -> None:
    """No sqlalchemy.exc type crosses the API: a dead server is dcache's own, retryable error."""
    with pytest.raises(dcache.StoreError) as info:
        DB.open(url)
    assert isinstance(info.value, dcache.StoreUnavailableError)
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)
    assert isinstance(info.value.__cause__, sa_exc.SQLAlchemyError)
    assert dcache.is_transient(info.value.__cause__)


def test_an_unopenable_sqlite_file_is_a_store_error(tmp_path: Path) -> None:
    """A bad path is a permanent StoreError (not a retry), with the cause chained."""
    with pytest.raises(dcache.StoreError) as info:
        DB.open(f"sqlite:///{tmp_path / 'missing-dir' / 'x.sqlite3'}")
    assert not isinstance(info.value, sa_exc.SQLAlchemyError)
    assert isinstance(info.value.__cause__, sa_exc.SQLAlchemyError)


def test_store_unavailable_is_a_store_error() -> None:
    """Callers that catch StoreError also catch the transient kind."""
    assert issubclass(dcache.StoreUnavailableError, dcache.StoreError)
    assert issubclass(dcache.SchemaVersionError, dcache.StoreError)
    assert not issubclass(dcache.StoreError, sa_exc.SQLAlchemyError)


def test_open_rejects_an_unknown_synchronous_mode(tmp_path: Path) -> None:
    """A typo in the durability setting must not silently fall back to something weaker."""
    with pytest.raises(ValueError):
        DB.open(f"sqlite:///{tmp_path / 'x.sqlite3'}", synchronous="sometimes")


def test_the_store_is_a_context_manager_and_close_is_idempotent(tmp_path: Path) -> None:
    """Scripts use `with DB.open(...)`; closing twice must be harmless."""
    with DB.open(f"sqlite:///{tmp_path / 'ctx.sqlite3'}") as db:
        created(db)
        assert "ctx.sqlite3" in repr(db)
    db.close()


def test_a_closed_store_refuses_every_use_and_opens_no_connection(
    backend: str, tmp_path: Path
) -> None:
    """A drain that outlived ``close()`` (a hung fetch) wrote through a fresh connection
    that nothing would ever close; every method now says the store is closed."""
    db = open_backend(backend, tmp_path)
    job = created(db, n=2)
    db.close()
    refused: list[Any] = [
        lambda: db.write_target(job.id, 0, status="done", result="x", ttl=TTL, now=T0),
        lambda: db.get_job(job.id, now=T0),
        lambda: db.get_job_with_targets(job.id, now=T0),
        lambda: db.poll_job(job.id, now=T0),
        lambda: db.cancel(job.id, now=T0),
        lambda: db.heartbeat("someone", now=T0),
        lambda: db.owners(),
        lambda: submit(db, caller="bob"),
        lambda: db.purge_expired(now=T0),
    ]
    for call in refused:
        with pytest.raises(dcache.StoreClosedError, match="closed"):
            call()
    pool = db.engine.pool
    assert getattr(pool, "checkedin", lambda: 0)() == 0
    assert getattr(pool, "checkedout", lambda: 0)() == 0
    db.close()  # still idempotent


def test_a_write_under_way_when_the_store_closes_is_told_it_closed(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed after the write passed its own check and before the group writer took a
    connection for it: the write raises StoreClosedError itself (a drain tells that from
    a refused result), not a StoreError wrapping it."""
    db = open_backend(backend, tmp_path)
    job = created(db, n=1)
    check = db._check_open
    closed: list[bool] = []

    def check_then_close() -> None:
        check()
        if not closed:
            closed.append(True)
            db.close()  # another thread's close(), landing in this very window

    monkeypatch.setattr(db, "_check_open", check_then_close)
    with pytest.raises(dcache.StoreClosedError, match="closed"):
        db.write_target(job.id, 0, status="done", result="x", ttl=TTL, now=T0)
    assert closed == [True]


# -- query plans ---------------------------------------------------------------------------


@pytest.fixture
def captured(db: DB) -> Iterator[list[tuple[str, Any]]]:
    """The SELECT statements the store sends to the database, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool
    ) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, params))

    event.listen(db.engine, "before_cursor_execute", record)
    yield seen
    event.remove(db.engine, "before_cursor_execute", record)


LOOKUPS: dict[str, str | tuple[str, ...]] = {
    "live_batch_jobs": "ix_batch_job_caller_status",
    "live_batch_jobs_total": "ix_batch_job_status",
    "batch_job_by_idem": "ix_batch_job_idem",
}


def finished_jobs(db: DB, n: int, callers: Sequence[str]) -> None:
    """Add ``n`` finished jobs, a quarter of them shared out among ``callers`` and the rest
    of one caller each (copies of a stored row, written straight to the table), and refresh
    the planner's statistics: a store's table as production has it, where only the
    selective index is cheap, not a few rows any index serves."""

    def caller(i: int) -> str:
        return callers[i % len(callers)] if i < n // 4 else f"bulk-{i}"

    with db.engine.begin() as conn:
        model = dict(conn.execute(select(jobs).order_by(jobs.c.id).limit(1)).mappings().one())
        rows = [
            {**model, "id": f"bulk{i:028d}", "caller": caller(i), "status": "done"}
            | {"finished_at": model["updated_at"]}
            | {"idem_key": hashlib.sha256(str(i).encode()).hexdigest()}
            for i in range(n)
        ]
        conn.execute(jobs.insert(), rows)
    with db.engine.begin() as conn:
        if db.dialect == "postgresql":
            conn.exec_driver_sql("ANALYZE batch_job")
        elif db.dialect == "mysql":
            conn.exec_driver_sql("ANALYZE TABLE batch_job")
        else:
            conn.exec_driver_sql("ANALYZE")


def test_the_submit_lookups_use_an_index(db: DB, captured: list[tuple[str, Any]]) -> None:
    """The submit transaction runs these under the global lock: a table scan would
    serialise. Each is served by its own index, by a range of it, on a table of many
    callers' finished jobs."""
    for caller in ("a", "b", "c"):
        job = created(db, caller=caller)
        db.cancel(job.id, now=T0)
        created(db, caller=caller)
    finished_jobs(db, 2000, ("a", "b", "c"))
    for lookup, index in LOOKUPS.items():
        captured.clear()
        if lookup == "live_batch_jobs":
            db.live_batch_jobs("a")
        elif lookup == "live_batch_jobs_total":
            db.live_batch_jobs_total()
        else:
            db.batch_job_by_idem("a", idem("a", "x"), now=T0)
        assert len(captured) == 1
        assert_index_used(db, *captured[0], index)


def assert_index_used(
    db: DB, statement: str, params: Any, index: str | tuple[str, ...], *, sorted_by_it: bool = False
) -> None:
    """EXPLAIN the statement as the store sent it and insist one of the named indexes
    serves it (and, with ``sorted_by_it``, its ORDER BY too: no sort step, so a LIMIT stops
    the index walk).

    On a table of a handful of rows a planner may serve a lookup through any index (a
    full walk of one with a filter costs nothing there): give the table rows first.
    """
    names = (index,) if isinstance(index, str) else index

    def named(step: str) -> bool:
        return any(re.search(rf"\b{n}\b", step) for n in names)

    with db.engine.begin() as conn:
        if db.dialect == "sqlite":
            plan = [r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)]
            assert any(named(step) for step in plan), plan
            assert not any(step.startswith("SCAN batch_") for step in plan), plan
            sorts = [step for step in plan if "TEMP B-TREE" in step]
        elif db.dialect == "postgresql":
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            if sorted_by_it:
                # On a table of a few rows the planner may as well sort what a bitmap scan
                # found (it did, in CI, with stats left by earlier tests): ask whether an
                # ordered walk of the index exists, the plan a large table gets.
                conn.exec_driver_sql("SET LOCAL enable_sort = off")
                conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
            plan = [r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, params)]
            assert any("Index" in step and named(step) for step in plan), plan
            assert not any("Seq Scan" in step for step in plan), plan
            sorts = [step for step in plan if "Sort" in step]
        else:
            rows = conn.exec_driver_sql("EXPLAIN " + statement, params).mappings().all()
            assert all(r["key"] and r["type"] != "ALL" for r in rows), rows
            # "ix_a|ix_b": MariaDB reads ix_a and filters by a rowid filter built from ix_b.
            assert any(r["key"].split("|")[0] in names for r in rows), rows
            sorts = [r for r in rows if "filesort" in (r["Extra"] or "")]
        if sorted_by_it:
            assert not sorts, sorts


def test_purge_walks_the_expiry_indexes_oldest_first(
    db: DB, captured: list[tuple[str, Any]]
) -> None:
    """Purge runs every period against the whole table: its searches for lapsed jobs and
    old tombstones are index ranges in index order, so each batch reads about ``limit``
    rows, however many jobs and targets the store holds (no scan, no sort), and the jobs
    whose leases lapsed first go first."""
    offset = {}
    for i, caller in enumerate("abcdefgh"):
        job = created(db, caller=caller, n=3)
        offset[job.id] = (5 * i) % 8  # a permutation: expiry order is not creation order
        assert db.fail_job(job.id, "x", now=T0 + dt.timedelta(seconds=offset[job.id]))
    live = created(db, caller="z")  # never purged
    # Two tombstones already (offsets 0 and 1), so the tombstone search has rows to plan on.
    assert db.purge_expired(now=T0 + TTL + dt.timedelta(seconds=1.5)) == 2
    assert tombstone_count(db) == 2
    captured.clear()
    assert db.purge_expired(now=T0 + TTL + dt.timedelta(seconds=9), limit=2, max_batches=1) == 2
    left = {r[0] for r in sql(db, "SELECT id FROM batch_job")}
    assert left == {i for i, o in offset.items() if o >= 4} | {live.id}
    picks = [(s, p) for s, p in captured if "LIMIT" in s.upper()]
    assert len(picks) == 2, captured  # one for old tombstones, one for lapsed jobs
    (tomb, tomb_params), (lapsed, lapsed_params) = picks
    assert "batch_tombstone" in tomb and "batch_job" in lapsed
    assert_index_used(db, tomb, tomb_params, "ix_batch_tombstone_expired", sorted_by_it=True)
    assert_index_used(db, lapsed, lapsed_params, "ix_batch_job_expires", sorted_by_it=True)


def test_old_tombstones_go_in_bounded_batches_oldest_first(db: DB) -> None:
    """Each purge deletes at most ``max_batches x limit`` old tombstones, oldest first; the
    rest wait for the next one. A tombstone answers "expired" for ``TOMBSTONE_TTL`` and
    no longer, even while it waits to be deleted."""
    ids = []
    for i, caller in enumerate("abcde"):
        job = created(db, caller=caller, n=1)
        assert db.fail_job(job.id, "x", now=T0 + dt.timedelta(seconds=i))
        ids.append(job.id)
    assert db.purge_expired(now=T0 + TTL + dt.timedelta(seconds=5)) == 5
    assert tombstone_count(db) == 5
    young = T0 + TTL + dcache.TOMBSTONE_TTL - dt.timedelta(seconds=1)
    assert db.purge_expired(now=young, limit=2, max_batches=1) == 0
    assert tombstone_count(db) == 5
    assert {db.lookup(i, now=young).state for i in ids} == {"expired"}
    # Tombstones 0, 1 and 2 are past their time; 3 and 4 are not.
    mid = T0 + TTL + dcache.TOMBSTONE_TTL + dt.timedelta(seconds=2.5)
    assert [db.lookup(i, now=mid).state for i in ids] == ["unknown"] * 3 + ["expired"] * 2
    assert db.purge_expired(now=mid, limit=2, max_batches=1) == 0
    assert tombstone_ids(db) == set(ids[2:])
    assert db.purge_expired(now=mid, limit=2, max_batches=1) == 0
    assert tombstone_ids(db) == set(ids[3:])
    assert db.purge_expired(now=mid, limit=2) == 0
    assert tombstone_count(db) == 2
    assert [db.lookup(i, now=mid).state for i in ids] == ["unknown"] * 3 + ["expired"] * 2
    old = mid + dt.timedelta(seconds=10)
    assert db.purge_expired(now=old) == 0
    assert tombstone_count(db) == 0


def test_the_store_keeps_tombstones_for_its_own_tombstone_ttl(db: DB) -> None:
    """``DB.tombstone_ttl`` (``DB.open(tombstone_ttl=...)``) is the period both lookups and
    purges honour; a purge may still name another."""
    job = created(db, n=1)
    assert db.fail_job(job.id, "x", now=T0)
    assert db.purge_expired(now=T0 + TTL) == 1
    db.tombstone_ttl = dt.timedelta(days=30)
    later = T0 + TTL + dt.timedelta(days=8)
    assert db.purge_expired(now=later) == 0
    assert tombstone_count(db) == 1
    assert db.lookup(job.id, now=later).state == "expired"
    db.tombstone_ttl = dt.timedelta(days=1)
    assert db.lookup(job.id, now=later).state == "unknown"
    assert tombstone_count(db) == 1
    assert db.purge_expired(now=later, tombstone_ttl=dt.timedelta(days=9)) == 0
    assert tombstone_count(db) == 1
    assert db.purge_expired(now=later) == 0
    assert tombstone_count(db) == 0


def test_a_job_id_used_again_after_its_purge_is_purged_again(db: DB) -> None:
    """A caller of the store may choose a job's id: one used again after the first job of
    that id was purged gets the newer tombstone (the purge failed on the old one, and
    every purge after it, with the other jobs of its batch)."""
    first = created(db, n=1, job_id="reused-id")
    assert db.fail_job(first.id, "x", now=T0)
    assert db.purge_expired(now=T0 + TTL) == 1
    later = T0 + TTL + dt.timedelta(hours=1)
    again = created(db, n=1, job_id="reused-id", now=later)
    other = created(db, n=1, now=later)
    for job in (again, other):
        assert db.fail_job(job.id, "x", now=later)
    assert db.purge_expired(now=later + TTL) == 2
    found = db.lookup("reused-id", now=later + TTL)
    assert (found.state, found.expired_at) == ("expired", later + TTL)
    assert tombstone_count(db) == 2


def test_a_job_id_of_the_columns_full_64_characters_ends_and_releases_its_key(db: DB) -> None:
    """A job id of 64 characters (a SHA-256 in hex, say): the job's end, whose
    notification id and released key are made from its id, fits their columns too (on the
    servers neither did: such a job could not end)."""
    job = created(db, n=1, job_id="j" * 64)
    assert db.fail_job(job.id, "drain could not start", now=T0, release_key=True)
    assert job_of(db, job.id).status == "failed"
    again = submit(db, key=job.idem_key)
    assert again.kind == "created"
    assert again.job is not None and again.job.id != job.id
    # Ended by its drain's last write too (its notification's id fits its column).
    other = created(db, n=1, job_id="k" * 64)
    out = db.write_target(other.id, 0, status="done", result="x", ttl=TTL, now=T0)
    assert (out.stored, out.status, out.finished) == (True, "done", True)
    ids = {dcache._outbox.message_id(i) for i in ("j" * 64, "k" * 64, "j" * 60)}
    assert len(ids) == 3 and all(len(i) <= 64 and i.startswith("msg_") for i in ids)
    assert dcache._outbox.message_id("j" * 60) == "msg_" + "j" * 60


def test_a_lapsed_job_not_yet_purged_answers_as_its_tombstone_would(db: DB) -> None:
    """Purge's progress does not change the answer: a job lapsed longer ago than the
    tombstone period is unknown, deleted or not."""
    job = created(db, n=1)
    assert db.fail_job(job.id, "x", now=T0)
    lapsed = T0 + TTL
    within = lapsed + dcache.TOMBSTONE_TTL
    assert db.lookup(job.id, now=within).state == "expired"
    past = within + dt.timedelta(seconds=1)
    assert db.lookup(job.id, now=past).state == "unknown"
    assert db.purge_expired(now=lapsed) == 1
    assert db.lookup(job.id, now=within).state == "expired"
    assert db.lookup(job.id, now=past).state == "unknown"


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///{tmp}/ttl.sqlite3"])
def test_open_takes_the_tombstone_ttl_and_refuses_a_bad_one(tmp_path: Path, url: str) -> None:
    url = url.format(tmp=tmp_path)
    with DB.open(url, tombstone_ttl=dt.timedelta(hours=1)) as db:
        assert db.tombstone_ttl == dt.timedelta(hours=1)
    with DB.open(url) as db:
        assert db.tombstone_ttl == dcache.TOMBSTONE_TTL
    for bad in (dt.timedelta(seconds=-1), dt.timedelta(days=10**6), 3600, None):
        with pytest.raises(ValueError, match="tombstone_ttl"):
            DB.open(url, tombstone_ttl=bad)  # type: ignore[arg-type]
    # The longest period allowed still reads and purges (its cutoff is a date).
    with DB.open(url, tombstone_ttl=dt.timedelta(days=100 * 365)) as db:
        assert db.lookup("0" * 32).state == "unknown"
        assert db.purge_expired() == 0


def test_a_table_made_by_an_older_build_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """create_all never alters tables: a missing column must say so at open, not mid-query."""
    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    DB.open(url).close()
    with DB.open(url) as db, db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE batch_owner DROP COLUMN started_at"))
    with pytest.raises(dcache.SchemaVersionError, match="started_at"):
        DB.open(url)


def test_stores_of_one_kind_share_their_compiled_statements(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """Compiling was half of what opening a store cost: a second store whose dialect is
    configured alike reuses the first's compiled statements; another configuration does not."""
    from sqlalchemy.dialects.postgresql import psycopg

    from dcache import _prepared
    from dcache._shared import Q_STATUS

    Prepared = _prepared.Prepared

    def another() -> DB:
        return DB.memory() if backend == "memory" else DB.open(backend_url(backend, tmp_path))

    with another(), another():  # (a dialect may set itself up as it first compiles)
        known = len(_prepared._CACHE)
    with another() as one, another() as two:
        assert len(_prepared._CACHE) == known  # nothing compiled again
        assert two._group._job is one._group._job
        assert two._status_read is one._status_read
        assert two._status_brief is one._status_brief
    first, alike, older = psycopg.dialect(), psycopg.dialect(), psycopg.dialect()
    older.server_version_info = (9, 6)
    assert Prepared(Q_STATUS, first) is Prepared(Q_STATUS, alike)
    assert Prepared(Q_STATUS, first) is not Prepared(Q_STATUS, older)
    assert Prepared(Q_STATUS, first).sql == Prepared(Q_STATUS, older).sql


@pytest.mark.parametrize("dialect_name", ["sqlite", "postgresql", "mysql"])
def test_values_bound_once_give_each_statement_its_own_parameters(dialect_name: str) -> None:
    """The per-target write converts an outcome's values once for its statements
    (``Binder``): each statement's parameters from the bound values are exactly those it
    converts for itself, fixed values included (the same anonymous name means another
    value in each statement; 1 and True, 0 and False stay apart)."""
    from sqlalchemy import Integer, bindparam, literal, select

    from dcache._prepared import Binder, Prepared
    from dcache._writer import _shaped

    dialect = dialect_named(dialect_name)
    statements = [
        Prepared(s, dialect)
        for s in (*_shaped(False, True), *_shaped(False, True, whole=True), *_shaped(True, True))
    ]
    # Values no processor converts: 1 and True (0 and False) would share one key.
    flags = select(
        literal(1, Integer()), literal(True, Integer()), literal(0, Integer()), literal(False)
    ).where(jobs.c.id == bindparam("job_id"))
    statements.append(Prepared(flags, dialect))
    binder = Binder(statements)
    rng = random.Random(7)

    def typed(params: Any) -> list[tuple[Any, ...]]:  # 1 == True: compare the types too
        items = sorted(params.items()) if isinstance(params, dict) else enumerate(params)
        return [(k, type(v), v) for k, v in items]

    for at in edge_and_random_instants(3)[:200]:
        values = {
            "whole": rng.random() < 0.5,
            "job_id": f"job-{rng.random()}",
            "idx": rng.randrange(32),
            "status": rng.choice(["done", "failed"]),
            "result": rng.choice([None, "", "x" * rng.randrange(100)]),
            "result_bytes": rng.randrange(10**6),
            "error": rng.choice(["", "boom"]),
            "hint": "",
            "now": at,
            "expires_at": at,
            "msg_id": "msg_1",
            "failures": rng.randrange(2),
        }
        bound = binder.bind(values)
        for statement in statements:
            assert typed(statement.bound(bound)) == typed(statement.params(values)), statement.sql
    odd = select(literal(1)).where(jobs.c.id == bindparam("now"))  # "now" as a string
    with pytest.raises(ValueError, match="'now'"):
        Binder([statements[0], Prepared(odd, dialect)])


@pytest.mark.parametrize("dialect_name", ["sqlite", "postgresql", "mysql"])
def test_rows_with_shared_values_get_each_its_own_parameters(dialect_name: str) -> None:
    """An ``executemany`` whose rows share values (the submit's targets: the job, status,
    times) converts the shared ones once: every row's parameters are those of the row
    with the shared values, as ``Prepared.params`` gives them."""

    from dcache._prepared import Prepared
    from dcache._submit import _JOB_INSERT, _TARGET_INSERT

    dialect = dialect_named(dialect_name)
    rng = random.Random(5)
    instants = edge_and_random_instants(9)[:50]
    insert_targets = Prepared(_TARGET_INSERT, dialect)
    common = {"job_id": "j", "status": "pending", "error": "", "hint": "", "result": None}
    for at in instants:
        rows = [
            {
                "idx": i,
                "url": f"https://example.com/{rng.random()}",
                "options": "{}",
                "updated_at": rng.choice([None, at]),
                "result_bytes": rng.choice([None, i]),
            }
            for i in range(rng.randrange(1, 5))
        ]
        shared = {**common, "updated_at": at} if rng.random() < 0.5 else common
        rows = [{k: v for k, v in row.items() if k not in shared} for row in rows]
        expected = [insert_targets.params({**shared, **row}) for row in rows]
        assert insert_targets.params_many(shared, rows) == expected
    insert_job = Prepared(_JOB_INSERT, dialect)  # every value shared: one row, no names
    job = {c.name: None for c in jobs.c} | {"created_at": instants[0], "ttl_us": 5}
    assert insert_job.params_many(job, [{}]) == [insert_job.params(job)]


def test_mariadb_works_in_pymysqls_default_tls_mode(tmp_path: Path) -> None:
    """The tests' MariaDB URL says ssl_disabled; the store works without it too (PyMySQL
    then offers TLS and, the server having none, goes on in plain text)."""
    url = make_url(backend_url("mariadb", tmp_path))
    plain = url.difference_update_query(["ssl_disabled"]).render_as_string(hide_password=False)
    with DB.open(plain) as db:
        wipe(db)
        job = created(db, n=1)
        assert db.write_target(job.id, 0, status="done", result="{}", ttl=TTL, now=T0).stored
        found = db.get_job_with_targets(job.id, now=T0)
        assert found is not None and found[0].status == "done"
        wipe(db)


def test_a_missing_table_is_created_at_open_beside_the_others(tmp_path: Path) -> None:
    """Open creates only the tables that are missing and keeps what the others hold."""
    url = f"sqlite:///{tmp_path / 'partial.sqlite3'}"
    with DB.open(url) as db:
        job_id = created(db).id
        with db.engine.begin() as conn:
            conn.execute(text("DROP TABLE batch_tombstone"))
    with DB.open(url) as db:
        assert db.get_job(job_id, now=T0) is not None
        assert db.fail_job(job_id, "x", now=T0)
        assert db.purge_expired(now=T0 + TTL + dt.timedelta(seconds=1)) == 1
        assert tombstone_ids(db) == {job_id}


def test_a_version_1_database_is_migrated_in_place_and_keeps_its_jobs(
    db: DB, backend: str, tmp_path: Path
) -> None:
    """Version 2 added batch_owner.beats and version 3 batch_target.result_bytes: opening
    an older database adds both, data intact; the results it already holds are measured
    when a read leaves them out, the ones written after have their size stored."""
    from dcache._schema import meta

    job_id = created(db, n=2).id
    text_0 = '{"content": "é😀 old", "meta": {}}'
    assert db.write_target(job_id, 0, status="done", result=text_0, ttl=TTL, now=T0).stored
    db.heartbeat("old-runner", now=T0)
    with db.engine.begin() as conn:
        conn.execute(text("ALTER TABLE batch_target DROP COLUMN result_bytes"))
        conn.execute(text("ALTER TABLE batch_owner DROP COLUMN beats"))
        drop = "DROP INDEX ix_batch_job_created"
        conn.execute(text(drop + (" ON batch_job" if db.dialect in ("mysql", "mariadb") else "")))
        conn.execute(update(meta).where(meta.c.key == "schema_version").values(value="1"))
    if db.dialect == "sqlite" and db.engine.url.database in (None, "", ":memory:"):
        db._create_schema()  # an in-memory store cannot be opened twice
        again = db
    else:
        # The URL the fixture opened: the engine's has lost ``?pgbouncer=true``, and
        # without it psycopg prepares statements that collide behind the bouncer.
        again = DB.open(backend_url(backend, tmp_path))
    try:
        assert again.schema_version() == dcache.SCHEMA_VERSION == 3
        assert again.get_job(job_id, now=T0) is not None
        text_1 = '{"content": "ü new", "meta": {}}'
        assert again.write_target(job_id, 1, status="done", result=text_1, ttl=TTL, now=T0).stored
        with again.engine.connect() as conn:
            stored = dict(
                conn.execute(
                    select(targets.c.idx, targets.c.result_bytes).where(targets.c.job_id == job_id)
                ).all()
            )
        assert stored == {0: None, 1: len(text_1.encode())}  # measured when read, or stored
        brief = again.get_job_with_targets(job_id, now=T0, results=False)
        assert brief is not None
        assert [t.result_bytes for t in brief[1]] == [len(text_0.encode()), len(text_1.encode())]
        found = again.get_target(job_id, 0, now=T0, results=False)
        assert found is not None and found[1].result_bytes == len(text_0.encode())
        with again.engine.connect() as conn:
            names = {i["name"] for i in sa_inspect(conn).get_indexes("batch_job")}
        assert "ix_batch_job_created" in names
        [row] = [o for o in again.owners() if o.owner == "old-runner"]
        assert (row.present, row.beats) == (True, 0)
        again.heartbeat("old-runner", now=T0)
        [row] = [o for o in again.owners() if o.owner == "old-runner"]
        assert row.beats == 1
    finally:
        if again is not db:
            again.close()


def test_every_status_is_spelled_once_by_the_status_enum(db: DB) -> None:
    """The store writes, the values report and the OpenAPI document allow one set of names."""
    from batch._openapi import document

    assert dcache.JOB_STATUSES == ("queued", "running", "done", "failed", "partial", "cancelled")
    every = set(dcache.TARGET_STATUSES) | set(dcache.JOB_STATUSES)
    assert every == {s.value for s in dcache.Status}
    assert dcache.Status.DONE == "done" and str(dcache.Status.CANCELLED) == "cancelled"
    schemas = document()["components"]["schemas"]
    assert schemas["Job"]["properties"]["status"]["enum"] == list(dcache.JOB_STATUSES)
    assert schemas["TargetStatus"]["properties"]["status"]["enum"] == list(dcache.TARGET_STATUSES)
    # Drive jobs through every stored status and read back what the rows hold.
    ended = submit(db, n=2).job
    assert ended is not None
    db.write_target(ended.id, 0, status="done", result="{}", ttl=TTL, now=T0)
    db.write_target(ended.id, 1, status="failed", error="boom", ttl=TTL, now=T0)
    cancelled = submit(db).job
    assert cancelled is not None and db.cancel(cancelled.id, now=T0)
    failed = submit(db).job
    assert failed is not None and db.fail_job(failed.id, "gone", now=T0)
    with db.engine.connect() as conn:
        job_rows = set(conn.execute(select(dcache._schema.jobs.c.status)).scalars())
        target_rows = set(conn.execute(select(dcache._schema.targets.c.status)).scalars())
    assert job_rows == {"partial", "cancelled", "failed"} <= set(dcache.JOB_STATUSES)
    assert target_rows == {"done", "failed", "pending"} <= set(dcache.TARGET_STATUSES)
