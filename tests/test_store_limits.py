"""The store's edges: list limits, in-memory URLs, and the largest result each backend holds.

Run on every backend (the ``db`` fixture of ``conftest``). The result limit is tested at
its edge on MariaDB, whose default ``max_allowed_packet`` (16 MiB) is what an 8 MiB
result of the worst content (every byte escaped by PyMySQL) overflows.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import backend_url, wipe
from sqlalchemy import text

import batch
import dcache
from dcache import DB, NewTarget

MiB = 1024 * 1024
TTL = dt.timedelta(hours=1)
WORST = '"\\'  # each byte doubles in JSON, then again in PyMySQL's escaping


def new_job(db: DB, n: int = 1, caller: str = "alice") -> dcache.JobRow:
    out = db.submit(
        job_id=uuid.uuid4().hex,
        caller=caller,
        caller_class="user",
        idem_key=uuid.uuid4().hex * 2,
        targets=[NewTarget(f"https://limits.example/{caller}/{i}", "{}") for i in range(n)],
        ttl=TTL,
        jobs_per_caller=64,
        jobs_total=64,
    )
    assert out.job is not None
    return out.job


def worst(size: int) -> str:
    """``size`` bytes of the content that escapes the most (all ``"`` and ``\\``)."""
    return (WORST * (size // 2 + 1))[:size]


def stored_result(db: DB, job_id: str, idx: int) -> str | None:
    found = db.get_job_with_targets(job_id)
    assert found is not None
    return found[1][idx].result


# -- jobs(limit=...) -------------------------------------------------------------------


@pytest.mark.parametrize("limit", [-1, -100, 1.5, "10", None, True, 2**63, 10**20])
def test_a_limit_out_of_range_or_not_an_int_is_a_value_error_on_every_backend(
    db: DB, limit: Any
) -> None:
    """``jobs(limit=-1)`` returned everything on SQLite and raised a driver error on the
    servers; no database takes a LIMIT past a signed 64-bit integer (SQLite's driver
    raised OverflowError, the servers a raw syntax error, neither a StoreError)."""
    new_job(db)
    with pytest.raises(ValueError, match="limit"):
        db.list_jobs(limit=limit)
    runner = batch.Runner(
        db, lambda t: batch.Result(""), batch.Config(heartbeat=dt.timedelta(hours=1))
    )
    try:
        with pytest.raises(ValueError, match="limit"):
            runner.jobs(limit=limit)
        with pytest.raises(ValueError, match="limit"):
            runner.jobs(caller="x" * 1000, limit=limit)  # checked before the caller is
        assert len(runner.jobs(limit=2**63 - 1)) == 1  # the largest one is a valid limit
    finally:
        runner.close(timeout=10)
    assert len(db.list_jobs(limit=2**63 - 1)) == 1


def test_a_zero_limit_lists_nothing_and_a_positive_one_caps_the_list(db: DB) -> None:
    """0 is a valid, empty page; the limit caps the list on every backend."""
    for _ in range(3):
        new_job(db, caller=uuid.uuid4().hex)
    assert db.list_jobs(limit=0) == []
    assert len(db.list_jobs(limit=2)) == 2
    assert len(db.list_jobs(limit=10)) == 3


# -- in-memory SQLite URLs ----------------------------------------------------------------


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_url_opens_one_database_shared_by_every_connection(url: str) -> None:
    """Each pooled connection got its own empty database: a job vanished between calls."""
    db = DB.open(url)
    try:
        job = new_job(db, n=2)
        # Several connections at once, each from its own thread, all see the same rows.
        seen: list[int] = []
        ready = threading.Barrier(4, timeout=10)

        def read() -> None:
            with db.engine.connect() as conn:
                ready.wait()  # four connections are open at the same time
                n = conn.execute(text("SELECT count(*) FROM batch_target")).scalar_one()
                seen.append(int(n))

        threads = [threading.Thread(target=read) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [2, 2, 2, 2]
        with db.writer() as w:
            assert w.write_target(job.id, 0, status="done", result="r", ttl=TTL).stored
        assert db.get_job(job.id) is not None
        assert stored_result(db, job.id, 0) == "r"
    finally:
        db.close()
    again = DB.open(url)  # a new store is a new, empty database (as DB.memory())
    try:
        assert again.get_job(job.id) is None
    finally:
        again.close()


# -- the largest result -------------------------------------------------------------------


def test_max_result_bytes_is_the_backends_own_limit(db: DB, backend: str) -> None:
    """The runner reads it to fail a too-large result clearly; its value is each backend's limit."""
    if backend == "mariadb":
        with db.engine.connect() as conn:
            packet = conn.execute(text("SELECT @@max_allowed_packet")).scalar_one()
        assert db.max_result_bytes == (int(packet) - 4096) // 2
    elif backend == "postgresql":
        assert db.max_result_bytes == (1 << 30) - (1 << 20) - 2048
    else:
        assert db.max_result_bytes >= 900 * MiB


def test_the_default_8_mib_result_limit_holds_for_the_worst_content_on_every_backend(
    db: DB,
) -> None:
    """Config.max_result_bytes (8 MiB) or the backend's own limit, whichever is less, stores."""
    size = min(8 * MiB, db.max_result_bytes)
    if db.dialect != "mysql":
        assert size == 8 * MiB
    job = new_job(db)
    big = worst(size)
    out = db.write_target(job.id, 0, status="done", result=big, ttl=TTL)
    assert out.stored
    assert stored_result(db, job.id, 0) == big


@pytest.fixture
def mariadb(tmp_path: Path) -> Any:
    store = DB.open(backend_url("mariadb", tmp_path))
    wipe(store)
    try:
        yield store
    finally:
        store.close()


def test_mariadb_stores_the_largest_allowed_result_and_refuses_one_byte_more_cleanly(
    mariadb: DB,
) -> None:
    """At the edge of MariaDB's default packet: the limit's worst case stores, one more byte not.

    The refusal is the store's own (ResultTooLargeError, permanent), made before anything
    is sent: the server would otherwise drop the connection, which reads as an outage the
    drain retries for its whole write budget.
    """
    db = mariadb
    limit = db.max_result_bytes
    assert limit < 8 * MiB, "MariaDB's default 16 MiB packet cannot take 8 MiB of worst content"
    job = new_job(db, n=3)
    with db.writer() as w:
        edge = worst(limit)
        assert w.write_target(job.id, 0, status="done", result=edge, ttl=TTL).stored
        with pytest.raises(dcache.ResultTooLargeError) as info:
            w.write_target(job.id, 1, status="done", result=worst(limit + 1), ttl=TTL)
        err = info.value
        assert isinstance(err, dcache.StoreError) and isinstance(err, ValueError)
        assert not isinstance(err, dcache.StoreUnavailableError)
        assert (err.size, err.limit) == (limit + 1, limit)
        assert str(limit) in str(err)
        # The refusal cost the connection nothing: the same writer stores the next one.
        assert w.write_target(job.id, 1, status="failed", error="too large", ttl=TTL).stored
        # Content that escapes less may go past the limit, up to what really fits.
        plain = "a" * (8 * MiB)
        assert w.write_target(job.id, 2, status="done", result=plain, ttl=TTL).stored
    assert stored_result(db, job.id, 0) == edge
    assert stored_result(db, job.id, 2) == plain
    found = db.get_job_with_targets(job.id)
    assert found is not None
    assert [t.status for t in found[1]] == ["done", "failed", "done"]
    with pytest.raises(dcache.ResultTooLargeError):
        db.write_target(new_job(db).id, 0, status="done", result=worst(8 * MiB), ttl=TTL)
