"""SQLite's WAL checkpoints run on the store's checkpointer thread, not on drains' commits.

SQLite only (the servers checkpoint on their own). Real files, real threads: a drain's
writes grow the log, the thread copies it back into the database file, the connections'
own threshold bounds the log should the thread not run, and closing the store stops it.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _fetchers import wait_for

import dcache
from dcache import DB, NewTarget, _checkpoint
from dcache._checkpoint import AUTOCHECKPOINT_PAGES, EVERY_OUTCOMES, Checkpointer

TTL = dt.timedelta(hours=1)
RESULT = '{"content": "' + "x" * 1000 + '"}'
THREAD = "dcache-checkpoint"


def new_job(db: DB, n: int) -> str:
    job_id = uuid.uuid4().hex
    out = db.submit(
        job_id=job_id,
        caller="alice",
        caller_class="user",
        idem_key=uuid.uuid4().hex * 2,
        targets=[NewTarget(f"https://checkpoint.example/{job_id}/{i}", "{}") for i in range(n)],
        ttl=TTL,
        jobs_per_caller=10_000,
        jobs_total=10_000,
    )
    assert out.kind == "created"
    return job_id


def drain_commits(db: DB, commits: int) -> None:
    """``commits`` per-target writes, each its own commit (one drain, so no batching)."""
    per_job = 32
    with db.writer() as writer:
        for _ in range(-(-commits // per_job)):
            job_id = new_job(db, per_job)
            for idx in range(per_job):
                writer.write_target(job_id, idx, status="done", result=RESULT, ttl=TTL)


def log_sequence(db_path: Path) -> int:
    """How many times the log has started over: the checkpoint sequence number that
    SQLite writes into the ``-wal`` file's header (bytes 12-15, big-endian) each time its
    first frame is written again."""
    with open(f"{db_path}-wal", "rb") as wal:
        header = wal.read(16)
    return int.from_bytes(header[12:16], "big")


def log_high_water(db_path: Path) -> int:
    """The most pages the log has held: its file is written from the start again when
    the log starts over and never truncated (no ``journal_size_limit``), so its size is
    its longest length (each page a frame with a 24-byte header, after a 32-byte one)."""
    size = Path(f"{db_path}-wal").stat().st_size
    return (size - 32) // (4096 + 24)


def checkpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


@pytest.fixture
def file_db(tmp_path: Path) -> Iterator[DB]:
    db = DB.open(f"sqlite:///{tmp_path / 'store.sqlite3'}")
    yield db
    db.close()


def test_the_stores_connections_checkpoint_on_their_own_only_past_the_bound(
    file_db: DB,
) -> None:
    with file_db.engine.connect() as conn:
        pages = conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar()
    assert pages == AUTOCHECKPOINT_PAGES > 1000  # SQLite's default is 1,000


def test_a_drains_commits_wake_the_thread_that_copies_the_log_back(
    file_db: DB, tmp_path: Path
) -> None:
    """No commit crosses the connections' bound here, so only the thread can have copied
    the log's pages into the database file."""
    path = tmp_path / "store.sqlite3"
    size_before = path.stat().st_size
    checkpointer = file_db._checkpointer
    drain_commits(file_db, EVERY_OUTCOMES)
    wait_for(lambda: checkpointer.checkpoints >= 1, "a checkpoint by the thread")
    assert len(checkpoint_threads()) == 1
    wal_pages = (tmp_path / "store.sqlite3-wal").stat().st_size // 4096
    assert wal_pages < AUTOCHECKPOINT_PAGES  # the bound was not what checkpointed
    # The pages of ~256 targets of 1 KiB each are in the database file now.
    assert path.stat().st_size >= size_before + EVERY_OUTCOMES * 1024
    assert checkpointer.failures == 0


def test_fewer_commits_than_a_wake_up_start_no_thread(file_db: DB) -> None:
    drain_commits(file_db, EVERY_OUTCOMES - 32)
    assert file_db._checkpointer.checkpoints == 0
    assert checkpoint_threads() == []


def test_closing_the_store_stops_the_thread(tmp_path: Path) -> None:
    db = DB.open(f"sqlite:///{tmp_path / 'store.sqlite3'}")
    drain_commits(db, EVERY_OUTCOMES)
    wait_for(lambda: db._checkpointer.checkpoints >= 1, "a checkpoint by the thread")
    (thread,) = checkpoint_threads()
    db.close()
    assert not thread.is_alive()
    db._checkpointer.wake()  # closed: starts nothing
    assert checkpoint_threads() == []


def test_what_was_written_reads_back_after_the_thread_checkpointed(
    file_db: DB, tmp_path: Path
) -> None:
    """The copied-back database file alone (the log deleted) holds every commit."""
    drain_commits(file_db, EVERY_OUTCOMES)
    wait_for(lambda: file_db._checkpointer.checkpoints >= 1, "a checkpoint by the thread")
    done = sum(1 for j in file_db.list_jobs(limit=1000) if j.status == "done")
    file_db.close()
    # Closing the last connection checkpoints the rest and removes the log; read the file
    # with a plain sqlite3 connection.
    assert not (tmp_path / "store.sqlite3-wal").exists()
    with sqlite3.connect(tmp_path / "store.sqlite3") as raw:
        query = "SELECT count(*) FROM batch_target WHERE status = 'done'"
        (stored,) = raw.execute(query).fetchone()
    assert stored == EVERY_OUTCOMES
    assert done == EVERY_OUTCOMES // 32


def test_an_in_memory_store_has_no_log_and_no_thread() -> None:
    db = DB.memory()
    try:
        drain_commits(db, EVERY_OUTCOMES + 32)
        assert db._checkpointer.checkpoints == 0
        assert checkpoint_threads() == []
    finally:
        db.close()


def test_a_checkpoint_that_fails_is_counted_and_not_raised(tmp_path: Path) -> None:
    """A store file that cannot be opened (its directory is gone): the thread goes on."""
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{tmp_path / 'missing' / 'store.sqlite3'}")
    checkpointer = Checkpointer(engine)
    try:
        assert checkpointer.checkpoint() is None
        assert checkpointer.failures == 1
    finally:
        checkpointer.close()
        engine.dispose()


def test_a_store_on_a_shared_single_connection_gets_no_thread(tmp_path: Path) -> None:
    """A ``StaticPool`` shares one connection: the thread must not use it concurrently."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import StaticPool

    engine = create_engine(
        f"sqlite:///{tmp_path / 'store.sqlite3'}",
        poolclass=StaticPool,
        connect_args={"check_same_thread": False},
    )
    db = dcache.DB(engine)
    try:
        drain_commits(db, EVERY_OUTCOMES + 32)
        assert db._checkpointer.checkpoints == 0
        assert checkpoint_threads() == []
    finally:
        db.close()
        engine.dispose()


def test_outcomes_not_commits_wake_the_thread(file_db: DB) -> None:
    """Eight drains share commits; each outcome still adds its pages to the log."""
    drains = 8
    jobs = [new_job(file_db, EVERY_OUTCOMES // drains) for _ in range(drains)]
    errors: list[BaseException] = []

    def drain(job_id: str) -> None:
        try:
            with file_db.writer() as writer:
                for idx in range(EVERY_OUTCOMES // drains):
                    writer.write_target(job_id, idx, status="done", result=RESULT, ttl=TTL)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert file_db._group.commits < EVERY_OUTCOMES  # batches of several outcomes
    wait_for(lambda: file_db._checkpointer.checkpoints >= 1, "a checkpoint by the thread")


def test_two_stores_on_one_file_checkpoint_side_by_side(tmp_path: Path) -> None:
    """Two stores (two processes' worth of connections and threads) draining one file:
    their checkpoints overlap or take turns; no write fails and nothing is lost."""
    url = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    stores = [DB.open(url), DB.open(url)]
    errors: list[BaseException] = []

    def drain(db: DB) -> None:
        try:
            drain_commits(db, 3 * EVERY_OUTCOMES)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=drain, args=(db,)) for db in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for db in stores:
            wait_for(lambda db=db: db._checkpointer.checkpoints >= 1, "each store's checkpoint")
        with stores[0].engine.connect() as conn:
            query = "SELECT count(*) FROM batch_target WHERE status = 'done'"
            done = conn.exec_driver_sql(query).scalar()
        assert done == 2 * 3 * EVERY_OUTCOMES
    finally:
        for db in stores:
            db.close()


# -- starting the log over ------------------------------------------------------------


@pytest.fixture
def small_restarts(monkeypatch: pytest.MonkeyPatch) -> int:
    """Restarts due from a log of 200 pages: a thread's first checkpoint (after
    EVERY_OUTCOMES outcomes, about nine pages each) marks one, far below the connections'
    own bound, so only the leader's restart can start the log over."""
    monkeypatch.setattr(_checkpoint, "RESTART_PAGES", 200)
    return 200


def test_the_log_starts_over_once_the_thread_has_copied_it_back(
    file_db: DB, tmp_path: Path, small_restarts: int
) -> None:
    path = tmp_path / "store.sqlite3"
    checkpointer = file_db._checkpointer
    last = new_job(file_db, 32)  # submitted now: only its writes come after the mark
    drain_commits(file_db, 32)
    started = log_sequence(path)
    # The thread is woken by the last of these writes: its checkpoint finds the whole
    # log written, copies it back and marks the restart, with no batch after it yet.
    drain_commits(file_db, EVERY_OUTCOMES - 32)
    wait_for(lambda: checkpointer.restart_due, "the thread's checkpoint to mark a restart")
    assert log_sequence(path) == started  # marked, not yet run: the leader runs it
    with file_db.writer() as writer:
        for idx in range(32):
            writer.write_target(last, idx, status="done", result=RESULT, ttl=TTL)
    assert checkpointer.restarts == 1
    assert not checkpointer.restart_due
    assert log_sequence(path) == started + 1
    assert checkpointer.failures == 0


def test_a_drain_that_never_pauses_keeps_the_log_short(file_db: DB, tmp_path: Path) -> None:
    """At the real thresholds: a drain writing without a pause, several times the
    connections' bound in all, starts the log over again and again, and the log never
    grows to that bound (where a drain's commit would copy the rest back)."""
    path = tmp_path / "store.sqlite3"
    drain_commits(file_db, 32)
    started = log_sequence(path)
    drain_commits(file_db, 8 * EVERY_OUTCOMES)  # about 9,000 pages of log in all
    assert file_db._checkpointer.restarts >= 2
    assert log_sequence(path) >= started + 2
    assert log_high_water(path) < AUTOCHECKPOINT_PAGES


def test_a_reader_on_an_old_snapshot_keeps_it_while_restarts_are_tried(
    file_db: DB, tmp_path: Path, small_restarts: int
) -> None:
    """A read transaction begun before the writes pins the pages it reads in the log:
    no checkpoint copies past them and the log cannot start over under it, so the
    reader sees its snapshot to the end; once it ends, the log starts over."""
    path = tmp_path / "store.sqlite3"
    drain_commits(file_db, 32)
    query = "SELECT count(*) FROM batch_target WHERE status = 'done'"
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        (before,) = reader.execute(query).fetchone()
        assert before == 32
        started = log_sequence(path)
        drain_commits(file_db, 2 * EVERY_OUTCOMES)
        assert log_sequence(path) == started  # pinned by the reader
        assert reader.execute(query).fetchone() == (before,)
        reader.execute("COMMIT")
        assert reader.execute(query).fetchone() == (32 + 2 * EVERY_OUTCOMES,)
    finally:
        reader.close()
    checkpointer = file_db._checkpointer
    checkpointer.wake()  # the thread may sleep while a restart is due: one more round
    wait_for(
        lambda: checkpointer.restart_due or log_sequence(path) > started,
        "the thread's checkpoint to mark a restart",
    )
    drain_commits(file_db, 32)
    assert log_sequence(path) > started
    with file_db.engine.connect() as conn:
        assert conn.exec_driver_sql(query).scalar() == 32 + 2 * EVERY_OUTCOMES + 32


def test_a_restart_that_fails_leaves_the_writes_alone(
    file_db: DB, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpointer = file_db._checkpointer
    drain_commits(file_db, 32)
    checkpointer.restart_due = True
    monkeypatch.setattr(_checkpoint._sql, "SQLITE_CHECKPOINT", "PRAGMA no_such_checkpoint(")
    drain_commits(file_db, 32)  # each write stored; the restart given up, not retried
    assert not checkpointer.restart_due
    assert checkpointer.restarts == 0
    with file_db.engine.connect() as conn:
        query = "SELECT count(*) FROM batch_target WHERE status = 'done'"
        assert conn.exec_driver_sql(query).scalar() == 64
