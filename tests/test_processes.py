"""Many processes on one database: crashes, racing submits, orphan reaping, remote cancel.

The multi-process tests start real children (multiprocessing ``forkserver``, as fresh as
spawned ones; entry points in ``_proc_workers``), each with its own ``dcache.DB`` and
``batch.Runner``, on the backends a deployment can share: the SQLite file, PostgreSQL and
MariaDB. They coordinate through
multiprocessing Events and a queue, never by sleeping; every wait has a timeout, and the
``procs`` fixture kills whatever is left. The exact staleness rules (three periods, one
period of clock skew) are unit tested in one process with an injected clock, without
sleeping.
"""

from __future__ import annotations

import datetime as dt
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import _proc_workers as workers
import pytest
from _proc_workers import content_for, meta_for, read_fetches, record_fetch, target_url, url_index
from conftest import Clock, forkserver
from sqlalchemy import select

import batch
import dcache
from dcache._schema import owners

CTX = forkserver()
HEARTBEAT = 0.25  # seconds: the short period the multi-process tests run their runners with
JOIN = 45.0  # seconds: the most any handshake or join may take before the test fails
PERIOD = dt.timedelta(seconds=60)  # the injected-clock tests' period (never elapses for real)


# -- helpers and fixtures -----------------------------------------------------------------


@pytest.fixture
def store(shared_url: str) -> Iterator[dcache.DB]:
    """The parent's own handle on the database the children share."""
    db = dcache.DB.open(shared_url)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def procs() -> Iterator[list[BaseProcess]]:
    """Children started by a test; any still alive afterwards is killed and reaped."""
    started: list[BaseProcess] = []
    try:
        yield started
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(10)


def spawn(procs: list[BaseProcess], fn: Callable[..., None], *args: Any) -> BaseProcess:
    """Start ``fn(*args)`` in a fresh interpreter; the ``procs`` fixture cleans it up."""
    p = CTX.Process(target=fn, args=args, daemon=True)
    p.start()
    procs.append(p)
    return p


def expect(out: Any, kind: str, children: list[BaseProcess]) -> tuple[Any, ...]:
    """The next message on ``out``, which must be ``kind``; fail fast if a child died."""
    msg = take(out, [], children, lambda m: True)
    assert msg[0] == kind, msg
    return msg


def take(
    out: Any,
    stash: list[tuple[Any, ...]],
    children: list[BaseProcess],
    wanted: Callable[[tuple[Any, ...]], bool],
) -> tuple[Any, ...]:
    """The first message that is ``wanted``; others are kept in ``stash`` for later."""
    for i, msg in enumerate(stash):
        if wanted(msg):
            return stash.pop(i)
    deadline = time.monotonic() + JOIN
    while time.monotonic() < deadline:
        try:
            msg: tuple[Any, ...] = out.get(timeout=0.1)
        except queue.Empty:
            dead = [p.exitcode for p in children if p.exitcode not in (None, 0)]
            if dead:
                pytest.fail(f"a child process died with exit code {dead[0]}")
            continue
        if wanted(msg):
            return msg
        stash.append(msg)
    pytest.fail(f"no awaited message from the children within {JOIN} s (stashed: {stash})")


def poll(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Call ``fn`` until it returns something truthy (a database observation, not a sleep)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout} s")
        pause.wait(0.02)


def owner_row(db: dcache.DB, owner: str) -> Any:
    """The owner's heartbeat row (``heartbeat_at``, ``started_at``), or None."""
    with db.engine.begin() as conn:
        q = select(owners.c.heartbeat_at, owners.c.started_at).where(owners.c.owner == owner)
        return conn.execute(q).first()


def logging_fetch(log_path: str, who: str) -> batch.Fetch:
    """A fetch that only records that it was called (the tests expect it never is)."""

    def fetch(target: batch.Target) -> batch.Result:
        record_fetch(log_path, who, url_index(target.url))
        return batch.Result("should never run")

    return fetch


def targets(*idxs: int) -> list[dict[str, str]]:
    """JSON-shaped targets for the given indexes."""
    return [{"url": target_url(i)} for i in idxs]


def job_of(runner: batch.Runner, job_id: str) -> batch.Job:
    """The job as ``runner`` reads it; it must exist."""
    job = runner.job(job_id)
    assert job is not None
    return job


def stored(idx: int) -> batch.Result:
    """The exact result every fetch in these tests stores for target ``idx``."""
    return batch.Result(content_for(idx), meta_for(idx))


def assert_targets(ts: list[batch.TargetStatus], done: int, total: int) -> None:
    """Targets ``0..done-1`` hold their exact results; the rest are pending and empty."""
    assert [t.idx for t in ts] == list(range(total))
    assert [t.url for t in ts] == [target_url(i) for i in range(total)]
    assert [t.status for t in ts] == ["done"] * done + ["pending"] * (total - done)
    for t in ts[:done]:
        assert t.result == stored(t.idx)
        assert t.error == ""
    for t in ts[done:]:
        assert t.result is None


# -- issue 3: one real crash ----------------------------------------------------------------


@pytest.mark.slow
def test_sigkilled_drain_is_failed_by_mark_in_flight_failed_and_nothing_reruns(
    shared_url: str, store: dcache.DB, procs: list[BaseProcess], tmp_path: Path
) -> None:
    """A crash mid-job must leave stored targets readable and must never repeat a fetch."""
    log = str(tmp_path / "fetches.log")
    reached, release, out = CTX.Event(), CTX.Event(), CTX.Queue()
    child = spawn(procs, workers.drain_one_job, shared_url, 5, 10.0, 2, reached, release, log, out)
    _, job_id, owner = expect(out, "submitted", [child])
    assert reached.wait(JOIN), "the child never reached target 2"

    child.kill()
    child.join(JOIN)
    assert child.exitcode == -signal.SIGKILL
    before = store.get_job(job_id)
    assert before is not None
    assert (before.status, before.targets_done, before.owner) == ("running", 2, owner)

    assert store.mark_in_flight_failed("restart") == 1
    assert store.mark_in_flight_failed("restart") == 0

    with batch.Runner(store, logging_fetch(log, "parent")) as runner:
        found = runner.status(job_id)
        assert found is not None
        job, ts = found
        assert (job.status, job.error, job.targets_done) == ("failed", "restart", 2)
        assert job.finished_at is not None
        assert_targets(ts, done=2, total=5)
        assert runner.wait(job_id, timeout=5) == job
        # Resubmitting the same job hands back the failed one: no resume, no second run.
        again = runner.submit("proc-caller", "test", targets(*range(5)))
        assert again == (job_id, True)
        assert runner.status(job_id) == found
    assert [i for _, i in read_fetches(log)] == [0, 1, 2]
    assert {who for who, _ in read_fetches(log)} == {f"child-{child.pid}"}


# -- issue 4: racing submits across processes -----------------------------------------------


@pytest.mark.slow
def test_racing_submits_from_four_processes_make_one_job_per_key_and_never_exceed_jobs_total(
    shared_url: str, store: dcache.DB, procs: list[BaseProcess]
) -> None:
    """Idempotency and the global cap must hold across gunicorn workers, not just threads."""
    go_identical, go_distinct, release, out = CTX.Event(), CTX.Event(), CTX.Event(), CTX.Queue()
    children = [
        spawn(
            procs,
            workers.race_submits,
            shared_url,
            n,
            8,
            3,
            go_identical,
            go_distinct,
            release,
            out,
        )
        for n in range(4)
    ]

    stash: list[tuple[Any, ...]] = []  # the children's messages of two rounds interleave

    def race(go: Any, name: str) -> list[tuple[str, Any]]:
        for _ in children:
            take(out, stash, children, lambda m: m[:1] + m[2:3] == ("ready", name))
        go.set()
        got = [
            take(out, stash, children, lambda m: m[:1] + m[2:3] == ("results", name))
            for _ in children
        ]
        assert sorted(msg[1] for msg in got) == list(range(len(children)))
        return [r for msg in got for r in msg[3]]

    samples: list[int] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            samples.append(store.live_batch_jobs_total())

    watcher = threading.Thread(target=monitor, name="live-monitor", daemon=True)
    try:
        # Round 1: 32 identical submits (one caller, same targets) -> one job, one id.
        identical = race(go_identical, "identical")
        assert Counter(kind for kind, _ in identical) == {"created": 1, "reused": 31}, identical
        ids = {job_id for _, job_id in identical}
        assert len(ids) == 1
        assert [j.id for j in store.list_jobs(limit=100)] == list(ids)
        poll(lambda: store.live_batch_jobs_total() == 0, JOIN, "the identical job's end")

        # Round 2: 32 distinct submits, jobs_total=3, fetches blocked so the jobs stay live;
        # the monitor samples the live count from before the go until after the last result.
        watcher.start()
        poll(lambda: samples, JOIN, "a first sample of the live count")
        distinct = race(go_distinct, "distinct")
        sampled = len(samples)
        poll(lambda: len(samples) > sampled + 1, JOIN, "a sample after the race")
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(JOIN)
        release.set()
    for c in children:
        c.join(JOIN)
        assert c.exitcode == 0
    assert Counter(kind for kind, _ in distinct) == {"created": 3, "busy": 29}, distinct
    assert {live for kind, live in distinct if kind == "busy"} == {3}
    assert samples[0] == 0
    assert samples[-1] == 3
    assert max(samples) <= 3
    created = sorted(j for kind, j in distinct if kind == "created")
    jobs = store.list_jobs(limit=100)
    assert sorted(j.id for j in jobs if j.id not in ids) == created
    assert {j.status for j in jobs} == {"done"}


# -- issue 4: heartbeats and orphan reaping across processes --------------------------------


@pytest.mark.slow
def test_reaping_by_a_starting_runner_leaves_a_live_peers_job_alone(
    shared_url: str,
    store: dcache.DB,
    procs: list[BaseProcess],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A recycled or added worker must never fail the jobs its live peers are draining."""
    log = str(tmp_path / "fetches.log")
    reached, release, out = CTX.Event(), CTX.Event(), CTX.Queue()
    child = spawn(
        procs, workers.drain_one_job, shared_url, 3, HEARTBEAT, 1, reached, release, log, out
    )
    _, job_id, owner_a = expect(out, "submitted", [child])
    assert reached.wait(JOIN)

    config = batch.Config(heartbeat=HEARTBEAT)
    with batch.Runner(store, logging_fetch(log, "B"), config) as runner_b:
        job = runner_b.job(job_id)
        assert job is not None
        assert job.status == "running"  # B's reap at construction spared it
        period = dt.timedelta(seconds=HEARTBEAT)

        def b_beats() -> bool:
            row = owner_row(store, runner_b.owner)
            return row is not None and row.heartbeat_at - row.started_at >= 5 * period

        # B's fifth beat lands after its fourth reap: B has reaped at least five times,
        # and A's job is older than the three periods after which a silent owner is dead.
        poll(b_beats, JOIN, "five heartbeats of runner B")
        job = runner_b.job(job_id)
        assert job is not None
        assert (job.status, job.error, job.owner, job.targets_done) == ("running", "", owner_a, 1)
        assert job.finished_at is None
        a_row = owner_row(store, owner_a)
        assert a_row is not None
        assert a_row.heartbeat_at > a_row.started_at  # A has been beating all along

        release.set()
        job = runner_b.wait(job_id, timeout=JOIN)
        assert job is not None
        assert (job.status, job.error, job.targets_done) == ("done", "", 3)
        assert expect(out, "finished", [child]) == ("finished", "done", "")
        found = runner_b.status(job_id)
        assert found is not None
        assert_targets(found[1], done=3, total=3)
    child.join(JOIN)
    assert child.exitcode == 0
    assert read_fetches(log) == [(f"child-{child.pid}", i) for i in range(3)]
    assert not [r for r in caplog.records if r.name == "batch" and r.levelname != "INFO"]


@pytest.mark.slow
def test_sigkilled_process_job_is_reaped_as_restart_within_a_few_heartbeats(
    shared_url: str, store: dcache.DB, procs: list[BaseProcess], tmp_path: Path
) -> None:
    """With many workers, a dead one's jobs must end on their own, soon, and not re-run."""
    log = str(tmp_path / "fetches.log")
    reached, release, out = CTX.Event(), CTX.Event(), CTX.Queue()
    child = spawn(
        procs, workers.drain_one_job, shared_url, 5, HEARTBEAT, 2, reached, release, log, out
    )
    _, job_id, owner_a = expect(out, "submitted", [child])
    assert reached.wait(JOIN)
    period = dt.timedelta(seconds=HEARTBEAT)

    config = batch.Config(heartbeat=HEARTBEAT)
    with batch.Runner(store, logging_fetch(log, "B"), config) as runner_b:
        job = runner_b.job(job_id)
        assert job is not None
        assert job.status == "running"

        child.kill()
        killed_at = time.monotonic()
        child.join(JOIN)
        assert child.exitcode == -signal.SIGKILL
        last_beat = owner_row(store, owner_a)  # A's final heartbeat (unless reaped already)

        def reaped() -> batch.Job | None:
            j = runner_b.job(job_id)
            return j if j is not None and j.status != "running" else None

        job = poll(reaped, 10 * HEARTBEAT + 10, "the reaping of the dead process's job")
        elapsed = time.monotonic() - killed_at
        assert (job.status, job.error, job.targets_done) == ("failed", "restart", 2)
        assert job.finished_at is not None
        assert elapsed < 10 * HEARTBEAT + 1.5, f"reaped {elapsed:.2f} s after the kill"
        if last_beat is not None:
            # Never before the owner has been silent for three full periods.
            assert job.finished_at - last_beat.heartbeat_at >= 3 * period
        assert owner_row(store, owner_a) is None  # the dead owner's row went with its jobs

        found = runner_b.status(job_id)
        assert found is not None
        assert_targets(found[1], done=2, total=5)
        assert runner_b.wait(job_id, timeout=5) == job
    assert read_fetches(log) == [(f"child-{child.pid}", i) for i in range(3)]


@pytest.mark.slow
def test_cancel_from_another_process_stops_the_drain_after_its_in_flight_target(
    shared_url: str, store: dcache.DB, procs: list[BaseProcess], tmp_path: Path
) -> None:
    """A cancel may reach any worker; the draining one must honour it at its next write."""
    log = str(tmp_path / "fetches.log")
    reached, release, out = CTX.Event(), CTX.Event(), CTX.Queue()
    child = spawn(
        procs, workers.drain_one_job, shared_url, 4, HEARTBEAT, 1, reached, release, log, out
    )
    _, job_id, _ = expect(out, "submitted", [child])
    assert reached.wait(JOIN)

    config = batch.Config(heartbeat=HEARTBEAT)
    with batch.Runner(store, logging_fetch(log, "B"), config) as runner_b:
        assert runner_b.cancel(job_id) is True
        assert runner_b.cancel(job_id) is False
        job = runner_b.job(job_id)
        assert job is not None
        assert (job.status, job.finished_at) == ("cancelled", None)
        with pytest.raises(TimeoutError):  # A has not stored its in-flight target yet
            runner_b.wait(job_id, timeout=2 * HEARTBEAT)

        release.set()
        released_at = time.monotonic()
        job = runner_b.wait(job_id, timeout=JOIN)
        elapsed = time.monotonic() - released_at
        assert job is not None
        assert elapsed < 3.0, f"wait returned {elapsed:.2f} s after the drain ended"
        assert (job.status, job.error, job.targets_done) == ("cancelled", "", 2)
        assert job.finished_at is not None
        found = runner_b.status(job_id)
        assert found is not None
        assert_targets(found[1], done=2, total=4)
        assert expect(out, "finished", [child]) == ("finished", "cancelled", "")
    child.join(JOIN)
    assert child.exitcode == 0
    assert read_fetches(log) == [(f"child-{child.pid}", 0), (f"child-{child.pid}", 1)]


# -- staleness rules with injected clocks (one process, no sleeping) ------------------------
#
# A judge takes an owner for dead only when it has itself seen the owner's beat token
# unchanged for the staleness window on its own monotonic clock (issue 10, fault 3): the
# tests move a fake monotonic clock and call ``check_owners()`` (what the maintenance
# thread does every period); wall clocks are injected separately and may jump.


class Gate:
    """A fetch that blocks on target ``block_at`` until released and records every call."""

    def __init__(self, block_at: int = -1) -> None:
        self.block_at = block_at
        self.calls: list[int] = []
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, target: batch.Target) -> batch.Result:
        idx = url_index(target.url)
        self.calls.append(idx)
        if idx == self.block_at:
            self.reached.set()
            self.release.wait(30)
        return stored(idx)


class Mono:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, period: dt.timedelta, times: float = 1.0) -> None:
        self.now += period.total_seconds() * times


class World:
    """Runners on one store with injected clocks; released and closed after the test."""

    def __init__(self, db: dcache.DB) -> None:
        self.db = db
        self.mono = Mono()
        self.gates: list[Gate] = []
        self.runners: list[batch.Runner] = []

    def gate(self, block_at: int = -1) -> Gate:
        g = Gate(block_at)
        self.gates.append(g)
        return g

    def runner(
        self,
        clock: Callable[[], dt.datetime],
        fetch: Gate | None = None,
        heartbeat: dt.timedelta = PERIOD,
    ) -> batch.Runner:
        """A runner: it beats once and observes the owners (its threads never fire)."""
        r = batch.Runner(
            self.db,
            fetch if fetch is not None else self.gate(),
            batch.Config(heartbeat=heartbeat),
            clock=clock,
            monotonic=self.mono,
        )
        self.runners.append(r)
        return r

    def beat(self, runner: batch.Runner, clock: Callable[[], dt.datetime]) -> None:
        """What ``runner``'s heartbeat thread writes each period."""
        self.db.heartbeat(runner.owner, now=clock(), stale_after=3 * runner.config.heartbeat)

    def close(self) -> None:
        for g in self.gates:
            g.release.set()
        for r in self.runners:
            r.close(timeout=10)


@pytest.fixture
def world(db: dcache.DB) -> Iterator[World]:
    """Runners on the ``db`` fixture's store (every backend, ``memory`` included)."""
    w = World(db)
    try:
        yield w
    finally:
        w.close()


def test_live_jobs_of_a_runner_silent_for_over_three_periods_are_reaped_by_another(
    world: World, clock: Any
) -> None:
    """Three missed beats mean the owner is dead: its jobs end failed, stored targets kept."""
    gate = world.gate(block_at=1)
    a = world.runner(clock, gate)
    job_id, _ = a.submit("c", "test", targets(0, 1, 2))
    assert gate.reached.wait(10)
    b = world.runner(clock)  # starts watching A's beats now

    world.mono.advance(PERIOD, 3)  # exactly three periods unchanged: not yet
    assert b.check_owners() == 0
    assert job_of(b, job_id).status == "running"
    assert owner_row(world.db, a.owner) is not None

    world.mono.advance(dt.timedelta(seconds=1))
    assert b.check_owners() == 1
    found = b.status(job_id)
    assert found is not None
    job, ts = found
    assert (job.status, job.error, job.targets_done) == ("failed", "restart", 1)
    assert job.finished_at == clock()
    assert job.expires_at == clock() + batch.Config().ttl  # readable a full TTL from now
    assert_targets(ts, done=1, total=3)
    assert owner_row(world.db, a.owner) is None  # dead owner's row removed after its jobs
    assert owner_row(world.db, b.owner) is not None

    # A was only stalled: its in-flight target is still stored, then its drain stops.
    gate.release.set()
    done = a.wait(job_id, timeout=10)
    assert done is not None
    assert (done.status, done.error, done.finished_at) == ("failed", "restart", job.finished_at)
    found = b.status(job_id)
    assert found is not None
    assert_targets(found[1], done=2, total=3)
    assert gate.calls == [0, 1]
    assert all(not g.calls for g in world.gates if g is not gate)


def test_a_runner_reaped_while_it_stood_still_starts_no_new_fetch(
    world: World, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped (SIGSTOP, a VM paused) between two targets for longer than the
    staleness window is reaped meanwhile: once it resumes, its drain notices the gap on
    its own monotonic clock, reads the job and starts no fetch of a job already ended
    (which would then have changed after its end was recorded and announced)."""
    gate = world.gate()
    a = world.runner(clock, gate)
    b = world.runner(clock)
    write = world.db.write_target
    reaped: list[int] = []

    def write_then_stand_still(job_id: str, idx: int, **kw: Any) -> Any:
        outcome = write(job_id, idx, **kw)
        if idx == 0:
            # A stands still after storing target 0; B watches it silent, then reaps.
            world.mono.advance(PERIOD, 2)
            assert b.check_owners() == 0
            world.mono.advance(PERIOD, 2)
            reaped.append(b.check_owners())
        return outcome

    monkeypatch.setattr(world.db, "write_target", write_then_stand_still)
    job_id, _ = a.submit("c", "test", targets(0, 1, 2))
    done = a.wait(job_id, timeout=10)
    assert reaped == [1]
    assert done is not None
    assert (done.status, done.error, done.targets_done) == ("failed", "restart", 1)
    assert gate.calls == [0]  # target 1 was never fetched
    found = b.status(job_id)
    assert found is not None
    assert found[0] == done  # unchanged since its end was recorded
    assert_targets(found[1], done=1, total=3)


def assert_reaped_after_a_silent_window(world: World, judge: batch.Runner, job_id: str) -> None:
    """The job's owner silent from now on: not yet dead after exactly the judge's window
    (three periods), reaped a second later (its job failed "restart")."""
    world.mono.advance(PERIOD, 3)
    assert judge.check_owners() == 0
    world.mono.advance(dt.timedelta(seconds=1))
    assert judge.check_owners() == 1
    assert (job_of(judge, job_id).status, job_of(judge, job_id).error) == ("failed", "restart")


def test_a_read_or_beat_of_the_judge_held_up_is_no_evidence_against_a_peer(
    world: World, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock held on the database (SQLite's write lock taken by another writer, or by a
    process stopped mid-commit) holds the judge's read and every peer's beat alike: a
    counter that stood still meanwhile is no evidence, and the watch starts over. A peer
    that then stays silent for a whole window of the judge's own is still reaped."""
    gate = world.gate(block_at=0)
    a = world.runner(clock, gate)
    job_id, _ = a.submit("c", "test", targets(0, 1))
    assert gate.reached.wait(10)
    b = world.runner(clock)  # has watched A once
    read, beat = world.db.owners, world.db.heartbeat

    def held_read() -> Any:
        world.mono.advance(PERIOD, 4)  # the read waited behind a lock for four periods
        return read()

    monkeypatch.setattr(world.db, "owners", held_read)
    assert b.check_owners() == 0
    monkeypatch.setattr(world.db, "owners", read)
    assert job_of(b, job_id).status == "running"

    def held_beat(*args: Any, **kw: Any) -> Any:
        world.mono.advance(PERIOD, 4)  # the judge's own beat waited as long
        return beat(*args, **kw)

    monkeypatch.setattr(world.db, "heartbeat", held_beat)
    b._beat_once()
    monkeypatch.setattr(world.db, "heartbeat", beat)
    assert b.check_owners() == 0
    assert job_of(b, job_id).status == "running"
    # From here A is silent while the judge's reads and beats go through at once.
    assert_reaped_after_a_silent_window(world, b, job_id)


@pytest.mark.parametrize("step", [60, -60, 3600, -86400], ids=lambda s: f"step{s:+d}s")
def test_a_wall_clock_step_never_reaps_a_beating_peer(world: World, clock: Any, step: int) -> None:
    """An NTP step or a VM resume moves wall clocks by minutes: live peers must stay live."""
    gate = world.gate(block_at=0)
    a = world.runner(clock, gate)
    job_id, _ = a.submit("c", "test", targets(0, 1))
    assert gate.reached.wait(10)
    b_clock = Clock(clock())
    b = world.runner(b_clock)
    for round_ in range(8):
        world.mono.advance(PERIOD)
        if round_ == 2:
            b_clock.advance(seconds=step)  # the judge's host steps
        if round_ == 5:
            clock.advance(seconds=-step)  # then the owner's host steps the other way
        world.beat(a, clock)
        assert b.check_owners() == 0
        assert job_of(b, job_id).status == "running"
    # A wall clock is no evidence either way: A falls silent and is reaped on B's own
    # monotonic clock, however far the wall clocks have moved.
    assert_reaped_after_a_silent_window(world, b, job_id)


def test_a_beat_that_the_judge_missed_seeing_still_counts(world: World, clock: Any) -> None:
    """The token changes with every beat, so a judge polling rarely never misreads a peer."""
    gate = world.gate(block_at=0)
    a = world.runner(clock, gate)
    job_id, _ = a.submit("c", "test", targets(0, 1))
    assert gate.reached.wait(10)
    b = world.runner(clock)
    for _ in range(5):
        world.mono.advance(PERIOD, 2.9)
        world.beat(a, lambda: clock())  # the same wall time: only the beat count moves
        assert b.check_owners() == 0
    assert job_of(b, job_id).status == "running"


def test_a_fresh_owner_is_never_reaped_and_owner_ids_are_never_reused(
    world: World, clock: Any
) -> None:
    """A restarted process gets a new owner: old jobs are reaped, the new ones never are."""
    old_gate = world.gate(block_at=0)
    old = world.runner(clock, old_gate)
    old_id, _ = old.submit("c", "test", targets(0, 1))
    assert old_gate.reached.wait(10)
    assert job_of(old, old_id).owner == old.owner

    new_gate = world.gate(block_at=5)
    new = world.runner(clock, new_gate)  # the restarted process: it starts watching
    assert new.owner != old.owner
    assert new.check_owners() == 0  # nothing judged on a first sight
    world.mono.advance(PERIOD, 3.1)  # the old process is gone
    world.beat(new, clock)
    assert new.check_owners() == 1
    assert (job_of(new, old_id).status, job_of(new, old_id).error) == ("failed", "restart")
    new_id, reused = new.submit("c", "test", targets(5, 6))
    assert not reused
    assert new_gate.reached.wait(10)
    assert job_of(new, new_id).owner == new.owner

    late = world.runner(clock)  # a judge starting now has seen nothing yet
    assert late.check_owners() == 0
    world.mono.advance(PERIOD, 2)
    world.beat(new, clock)
    assert late.check_owners() == 0
    job = job_of(new, new_id)
    assert (job.status, job.error, job.finished_at) == ("running", "", None)
    owner_ids = [r.owner for r in world.runners]
    assert len(set(owner_ids)) == len(owner_ids)


def test_jobs_that_ended_before_their_owner_went_silent_are_never_touched(
    world: World, clock: Any
) -> None:
    """Reaping is compare-and-set: a finished job keeps its status, error and timestamps."""
    gate = world.gate(block_at=11)
    a = world.runner(clock, gate)
    done_id, _ = a.submit("c1", "test", targets(0, 1))
    assert a.wait(done_id, timeout=10) is not None
    cancelled_id, _ = a.submit("c2", "test", targets(10, 11, 12))
    assert gate.reached.wait(10)
    clock.advance(seconds=5)
    assert a.cancel(cancelled_id)
    gate.release.set()
    assert a.wait(cancelled_id, timeout=10) is not None
    before = {i: job_of(a, i) for i in (done_id, cancelled_id)}
    assert before[done_id].status == "done"
    assert before[cancelled_id].status == "cancelled"
    assert before[cancelled_id].finished_at is not None

    b = world.runner(clock)
    world.mono.advance(PERIOD, 3.1)
    clock.advance(seconds=1)
    assert b.check_owners() == 0
    assert owner_row(world.db, a.owner) is None  # judged dead all the same
    assert {i: job_of(b, i) for i in before} == before


def test_a_cancelled_job_of_a_dead_owner_is_finished_but_stays_cancelled(
    world: World, clock: Any
) -> None:
    """A cancel that the dead drain never completed must still let wait() return."""
    gate = world.gate(block_at=0)
    a = world.runner(clock, gate)
    job_id, _ = a.submit("c", "test", targets(0, 1))
    assert gate.reached.wait(10)
    b = world.runner(clock)
    assert b.cancel(job_id)
    with pytest.raises(TimeoutError):  # A's in-flight target is not stored yet
        b.wait(job_id, timeout=0.05)

    world.mono.advance(PERIOD, 3.1)
    clock.advance(seconds=7)
    assert b.check_owners() == 0  # nothing failed: the job was cancelled already
    job = b.wait(job_id, timeout=5)
    assert job is not None
    assert (job.status, job.error, job.finished_at) == ("cancelled", "", clock())

    clock.advance(seconds=5)
    gate.release.set()  # A was only stalled: it stores the target, keeps the end time
    after = a.wait(job_id, timeout=10)
    assert after is not None
    assert (after.status, after.error, after.finished_at) == ("cancelled", "", job.finished_at)
    found = b.status(job_id)
    assert found is not None
    assert_targets(found[1], done=1, total=2)
    assert gate.calls == [0]


def test_a_runner_with_a_shorter_heartbeat_does_not_reap_a_punctual_peer(
    world: World, clock: Any
) -> None:
    """Rolling deploys mix settings for a while; a punctual peer must never be reaped."""
    gate = world.gate(block_at=0)
    a = world.runner(clock, gate, heartbeat=PERIOD)
    job_id, _ = a.submit("c", "test", targets(0, 1))
    assert gate.reached.wait(10)
    b = world.runner(clock, heartbeat=PERIOD / 6)  # its own window is half of A's period
    for _ in range(4):
        world.mono.advance(PERIOD / 6)
        for _ in range(5):  # B judges six times per A period
            assert b.check_owners() == 0
            world.mono.advance(PERIOD / 6)
        world.beat(a, clock)
        assert job_of(a, job_id).status == "running"
    # A declared three of its own periods: B honours that, not its own shorter window.
    assert b.check_owners() == 0  # B sees A's last beat
    world.mono.advance(PERIOD, 3)
    assert b.check_owners() == 0
    world.mono.advance(dt.timedelta(seconds=1))
    assert b.check_owners() == 1


def test_a_runners_real_heartbeat_and_maintenance_threads_survive_wall_clock_steps(
    db: dcache.DB,
) -> None:
    """Real threads, short beats, one shared wall clock stepping both ways: nobody is reaped."""
    wall = Clock(dcache.utcnow())
    gate = Gate(block_at=0)
    config = batch.Config(heartbeat=dt.timedelta(seconds=0.2))  # judged dead after 0.6 s
    with (
        batch.Runner(db, gate, config, clock=wall) as a,
        batch.Runner(db, Gate(), config, clock=wall) as b,
    ):
        job_id, _ = a.submit("c", "test", targets(0, 1))
        assert gate.reached.wait(10)
        for step in (60, -120, 3600):
            wall.advance(seconds=step)
            stop = time.monotonic() + 1.5  # over seven periods, two staleness windows
            while time.monotonic() < stop:
                assert job_of(b, job_id).status == "running"
                threading.Event().wait(0.05)
        # A peer that really stopped is still found: an owner that beats once, then never.
        ghost = dcache.NewTarget(target_url(5))
        out = db.submit(
            job_id="f" * 32,
            caller="ghost-caller",
            caller_class="test",
            idem_key="0" * 64,
            targets=[ghost],
            ttl=dt.timedelta(hours=1),
            jobs_per_caller=5,
            jobs_total=50,
            owner="ghost",
            now=wall(),
        )
        assert out.kind == "created"
        db.heartbeat("ghost", now=wall(), stale_after=dt.timedelta(seconds=0.6))
        deadline = time.monotonic() + 10
        while job_of(b, "f" * 32).status == "running" and time.monotonic() < deadline:
            threading.Event().wait(0.02)
        assert (job_of(b, "f" * 32).status, job_of(b, "f" * 32).error) == ("failed", "restart")
        assert job_of(b, job_id).status == "running"
        gate.release.set()
