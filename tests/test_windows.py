"""The windows between the designed paths (issue 10): each fault as a regression test.

A commit whose reply is lost, a drain thread that cannot start, a pool that drains
exhaust, an outage while a cancelled job's last target is stored, ``close()`` racing a
submit, a ``fetch`` that never returns, values past what ``datetime`` or ``json`` can take.
Where a fault needs a moment no real server can be told to pick (an error exactly after
COMMIT), a store subclass raises a real ``StoreUnavailableError`` at that moment, after the
real work was done; the wire-level cuts of the same windows are in test_cut_points.py.
Wall-clock steps are in test_processes.py.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fetchers import WAIT, FakeFetch, wait_for
from conftest import SERVER_URLS, backend_url, wipe

import batch
import dcache
from dcache import StoreUnavailableError

FAST = batch.Config(heartbeat=dt.timedelta(seconds=0.05), jobs_per_caller=8, jobs_total=64)


class FlakyDB(dcache.DB):
    """A real store that can be told to fail chosen calls after (or instead of) them."""

    lose_submit_reply = 0  # submits whose reply is "lost" after their COMMIT
    refuse: frozenset[str] = frozenset()  # methods that raise StoreUnavailableError
    refuse_writes = False  # the drain's per-target writes raise
    lose_write_replies = 0  # per-target writes whose reply is "lost" after their COMMIT
    after_write: Any = None  # called with (job_id, idx) after each per-target write
    hold_submit_reply: threading.Event | None = None  # a slow reply: wait for it after COMMIT
    submit_committed = threading.Event()

    def submit(self, **kw: Any) -> dcache.SubmitOutcome:
        out = super().submit(**kw)
        if self.hold_submit_reply is not None:
            self.submit_committed.set()
            self.hold_submit_reply.wait(WAIT)
        if self.lose_submit_reply:
            self.lose_submit_reply -= 1
            raise StoreUnavailableError("connection lost after COMMIT (reply lost)")
        return out

    def fail_job(self, *args: Any, **kw: Any) -> bool:
        if "fail_job" in self.refuse:
            raise StoreUnavailableError("outage")
        return super().fail_job(*args, **kw)

    def mark_finished(self, *args: Any, **kw: Any) -> bool:
        if "mark_finished" in self.refuse:
            raise StoreUnavailableError("outage")
        return super().mark_finished(*args, **kw)

    def get_job(self, *args: Any, **kw: Any) -> Any:
        if "get_job" in self.refuse:
            raise StoreUnavailableError("outage")
        return super().get_job(*args, **kw)

    def writer(self) -> dcache.Writer:
        return _FlakyWriter(self)


class _FlakyWriter(dcache.Writer):
    def __init__(self, db: FlakyDB) -> None:
        super().__init__(db)
        self._flaky = db

    def write_target(self, *args: Any, **kw: Any) -> dcache.WriteOutcome:
        if self._flaky.refuse_writes:
            raise StoreUnavailableError("outage while storing")
        out = super().write_target(*args, **kw)
        if self._flaky.after_write is not None:
            self._flaky.after_write(*args[:2])
        if self._flaky.lose_write_replies:
            self._flaky.lose_write_replies -= 1
            raise StoreUnavailableError("connection lost after COMMIT (reply lost)")
        return out


@pytest.fixture
def flaky(backend: str, tmp_path: Path) -> Iterator[FlakyDB]:
    """A FlakyDB on each backend, emptied first."""
    if backend == "memory":
        db = FlakyDB.memory()
    else:
        db = FlakyDB.open(backend_url(backend, tmp_path))
        if backend in SERVER_URLS:
            wipe(db)
    try:
        yield db
    finally:
        db.close()


@pytest.fixture
def fetch() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


def urls(*names: str) -> list[dict[str, str]]:
    return [{"url": f"https://example.com/{n}"} for n in names]


def recorded_later(runner: batch.Runner, job_id: str) -> batch.Job:
    """The job once the maintenance thread has recorded its end (finished_at set)."""

    def recorded() -> bool:
        job = runner.job(job_id)
        return job is not None and job.finished_at is not None

    wait_for(recorded, "the maintenance thread to record the job's end")
    job = runner.job(job_id)
    assert job is not None
    return job


def one_fetch_each(fetch: FakeFetch, *names: str) -> None:
    assert sorted(fetch.calls) == sorted(f"https://example.com/{n}" for n in names)


# -- fault 1: a committed job with no drain -------------------------------------------------


def test_a_submit_whose_commit_reply_is_lost_still_gets_its_job_drained(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """The job committed but submit raised: the runner finds it and drains it, once."""
    flaky.lose_submit_reply = 1
    with batch.Runner(flaky, fetch, FAST) as runner:
        with pytest.raises(StoreUnavailableError):
            runner.submit("alice", "free", urls("a", "b"))
        [job] = runner.jobs()
        final = runner.wait(job.id, timeout=WAIT)
        assert final is not None
        assert (final.status, final.targets_done) == ("done", 2)
        # The client's retry of the same submission is handed that job, finished.
        assert runner.submit("alice", "free", urls("a", "b")) == (job.id, True)
    one_fetch_each(fetch, "a", "b")


def test_a_slow_submit_reply_is_left_to_its_submit_not_taken_for_a_lost_one(
    flaky: FlakyDB, fetch: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """Maintenance passes while a healthy submit waits for its reply: they leave it alone.

    The submit starts the drain itself once the reply comes; the maintenance thread
    neither starts it first nor warns that a committed job was left undrained.
    """
    flaky.hold_submit_reply = threading.Event()
    flaky.submit_committed = threading.Event()
    seen: list[batch.events.Event] = []
    with batch.Runner(flaky, fetch, FAST, observers=[seen.append]) as runner:
        done: list[tuple[str, bool]] = []
        t = threading.Thread(target=lambda: done.append(runner.submit("alice", "free", urls("a"))))
        t.start()
        assert flaky.submit_committed.wait(WAIT)
        time.sleep(20 * FAST.heartbeat.total_seconds())  # many maintenance passes
        assert not fetch.calls, "maintenance started the drain of a submit still in progress"
        flaky.hold_submit_reply.set()
        t.join(WAIT)
        [(job_id, reused)] = done
        assert not reused
        final = runner.wait(job_id, timeout=WAIT)
        assert final is not None and final.status == "done"
    one_fetch_each(fetch, "a")
    assert not [r for r in caplog.records if "not drained" in r.getMessage()]
    submitted = [e for e in seen if isinstance(e, batch.events.JobSubmitted)]
    assert [e.job_id for e in submitted] == [job_id]


def test_a_retry_right_after_a_lost_reply_gets_the_job_and_it_finishes(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """A retry before the maintenance thread looks: the reused job is drained at once."""
    flaky.lose_submit_reply = 1
    slow = batch.Config(heartbeat=dt.timedelta(hours=1), jobs_per_caller=8, jobs_total=64)
    with batch.Runner(flaky, fetch, slow) as runner:
        with pytest.raises(StoreUnavailableError):
            runner.submit("alice", "free", urls("a", "b"))
        job_id, reused = runner.submit("alice", "free", urls("a", "b"))
        assert reused
        final = runner.wait(job_id, timeout=WAIT)
        assert final is not None
        assert (final.status, final.targets_done) == ("done", 2)
        # close() without a timeout returns: no drain is left waiting on nothing.
    one_fetch_each(fetch, "a", "b")


def test_a_drain_thread_that_cannot_start_is_started_again_by_maintenance(
    flaky: FlakyDB, fetch: FakeFetch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "can't start new thread" after the commit: the job is not left running for ever."""
    real_start = threading.Thread.start
    refused: list[str] = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("batch-job-") and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with batch.Runner(flaky, fetch, FAST) as runner:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            runner.submit("alice", "free", urls("a"))
        [job] = runner.jobs()
        final = runner.wait(job.id, timeout=WAIT)
        assert final is not None
        assert (final.status, final.targets_done) == ("done", 1)
    assert refused
    one_fetch_each(fetch, "a")


def test_close_ends_a_job_whose_submit_failed_and_frees_its_key(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """Closing before the maintenance thread settled it: the job ends, a retry is fresh."""
    flaky.lose_submit_reply = 1
    slow = batch.Config(heartbeat=dt.timedelta(hours=1), jobs_per_caller=8, jobs_total=64)
    runner = batch.Runner(flaky, fetch, slow)
    with pytest.raises(StoreUnavailableError):
        runner.submit("alice", "free", urls("a"))
    [job] = runner.jobs()
    runner.close()
    ended = runner.job(job.id)
    assert ended is not None
    assert (ended.status, ended.error) == ("failed", "shutdown")
    assert ended.finished_at is not None
    with batch.Runner(flaky, fetch, FAST) as again:
        new_id, reused = again.submit("alice", "free", urls("a"))
        assert (reused, new_id != job.id) == (False, True)
        assert again.wait(new_id, timeout=WAIT) is not None
    one_fetch_each(fetch, "a")


# -- fault 6: close() racing a submit -------------------------------------------------------


def test_a_submit_refused_by_a_racing_close_does_not_poison_its_idempotency_key(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """The client was told "retry later": its retry must get a job that runs."""

    class ClosingDB(FlakyDB):
        runner: batch.Runner | None = None

        def submit(self, **kw: Any) -> dcache.SubmitOutcome:
            out = super().submit(**kw)
            assert self.runner is not None
            self.runner.close()  # lands between the commit and the drain's start
            return out

    closing = ClosingDB(flaky.engine)
    try:
        first = batch.Runner(closing, fetch, FAST)
        closing.runner = first
        with pytest.raises(batch.RunnerClosedError):
            first.submit("alice", "free", urls("a"))
        with batch.Runner(flaky, fetch, FAST) as second:
            job_id, reused = second.submit("alice", "free", urls("a"))
            assert not reused
            final = second.wait(job_id, timeout=WAIT)
            assert final is not None
            assert final.status == "done"
            refused = [j for j in second.jobs() if j.id != job_id]
            assert [(j.status, j.error) for j in refused] == [("failed", "shutdown")]
    finally:
        closing.close()
    one_fetch_each(fetch, "a")


# -- fault 4: drains cannot starve the heartbeat --------------------------------------------


@pytest.mark.slow
def test_more_live_jobs_than_pooled_connections_starve_no_heartbeat_and_lose_nothing(
    shared_url: str, fetch: FakeFetch
) -> None:
    """Six drains on a two-connection pool: beats go on, peers reap nothing, all finish."""
    store = dcache.DB.open(shared_url, pool_size=2, max_overflow=0, pool_timeout=0.3)
    beat = batch.Config(heartbeat=dt.timedelta(seconds=0.1), jobs_per_caller=8, jobs_total=64)
    peer_store = dcache.DB.open(shared_url)
    names = [f"j{i}-{k}" for i in range(6) for k in range(3)]
    for i in range(6):
        fetch.block(f"https://example.com/j{i}-0", f"https://example.com/j{i}-1")
    try:
        with (
            batch.Runner(store, fetch, beat) as runner,
            batch.Runner(peer_store, FakeFetch(), beat) as peer,
        ):
            ids = [
                runner.submit(f"caller-{i}", "free", urls(*(f"j{i}-{k}" for k in range(3))))[0]
                for i in range(6)
            ]
            # Every drain has its first result in hand and needs a connection to store
            # it; two get one and keep it (a drain holds its connection for the job's
            # life), then block mid-job; four wait at checkout, their results in hand.
            fetch.release(*(f"https://example.com/j{i}-0" for i in range(6)))
            wait_for(
                lambda: sum(fetch.count(f"https://example.com/j{i}-1") for i in range(6)) >= 2,
                "two drains to hold both connections",
            )

            def beats() -> int:
                return next(o.beats for o in peer_store.owners() if o.owner == runner.owner)

            before = beats()
            stop = time.monotonic() + 1.0  # ten periods, over three staleness windows
            while time.monotonic() < stop:
                assert all(peer.job(i).status == "running" for i in ids)  # type: ignore[union-attr]
                threading.Event().wait(0.1)
            assert beats() >= before + 5, "the heartbeat was starved"
            fetch.release_all()
            for job_id in ids:
                final = runner.wait(job_id, timeout=WAIT * 3)
                assert final is not None
                assert (final.status, final.targets_done) == ("done", 3), final
    finally:
        store.close()
        peer_store.close()
    one_fetch_each(fetch, *names)


# -- fault 5: a cancelled job whose last write met an outage --------------------------------


def test_a_cancelled_job_whose_in_flight_write_gave_up_still_gets_finished_at(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """Otherwise wait() in every process, ?wait=N and `batch run` hang on it for ever."""
    fetch.block("https://example.com/a")
    config = batch.Config(
        heartbeat=dt.timedelta(seconds=0.05), write_retry=dt.timedelta(seconds=0.2)
    )
    with batch.Runner(flaky, fetch, config) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a", "b"))
        fetch.wait_entered("https://example.com/a")
        assert runner.cancel(job_id)
        flaky.refuse_writes = True
        flaky.refuse = frozenset({"fail_job", "mark_finished"})
        fetch.release("https://example.com/a")
        drained = runner.wait(job_id, timeout=WAIT)  # our drain has ended ...
        assert drained is not None
        assert drained.finished_at is None  # ... but could not record it yet
        flaky.refuse = frozenset()  # the store answers again
        assert recorded_later(runner, job_id).status == "cancelled"
    with batch.Runner(flaky, fetch, FAST) as other:  # another process's wait() returns
        assert other.wait(job_id, timeout=WAIT) is not None
    one_fetch_each(fetch, "a")


def test_a_cancel_seen_between_targets_whose_end_cannot_be_recorded_is_finished_later(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """A cancel the drain notices between two targets ends it without a write; if that
    mark_finished fails, maintenance records the end later (wait() hung for ever)."""
    with batch.Runner(flaky, fetch, FAST) as runner:

        def cancel_after_first(written: str, idx: int) -> None:
            if idx == 0:
                flaky.after_write = None
                flaky.refuse = frozenset({"mark_finished"})
                assert runner.cancel(written)

        flaky.after_write = cancel_after_first
        job_id, _ = runner.submit("alice", "free", urls("a", "b", "c"))
        wait_for(lambda: flaky.refuse == frozenset({"mark_finished"}), "the cancel")
        wait_for(lambda: not runner._drains, "the drain to stop")
        flaky.refuse = frozenset()  # the store answers again
        job = recorded_later(runner, job_id)
        assert (job.status, job.targets_done) == ("cancelled", 1)
    with batch.Runner(flaky, fetch, FAST) as other:  # another process's wait() returns
        assert other.wait(job_id, timeout=WAIT) is not None
    one_fetch_each(fetch, "a")


def test_a_last_write_whose_reply_is_lost_is_announced_as_the_store_has_it(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """The COMMIT of the job's last target landed but its reply was lost: the retry finds
    the target stored. The job is done, and JobFinished and on_finish say so (the event
    said failed, 'store unavailable')."""
    ended: list[batch.events.Event] = []
    handed: list[batch.Job] = []
    flaky.lose_write_replies = 1
    with batch.Runner(
        flaky,
        fetch,
        FAST,
        observers=[batch.events.only(batch.events.JobFinished, fn=ended.append)],
        on_finish=handed.append,
    ) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a"))
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and job.status == "done"
        wait_for(lambda: bool(ended) and bool(handed), "the job's end to be announced")
    assert [(e.status, e.error) for e in ended] == [("done", "")]  # type: ignore[union-attr]
    assert [j.status for j in handed] == ["done"]
    one_fetch_each(fetch, "a")


def test_on_finish_is_called_once_the_store_answers_again(flaky: FlakyDB, fetch: FakeFetch) -> None:
    """on_finish reads the job after its last commit; if the store blinks right then, it
    is asked again every heartbeat instead of being lost."""
    handed: list[batch.Job] = []
    fetch.block("https://example.com/a")
    with batch.Runner(flaky, fetch, FAST, on_finish=handed.append) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a"))
        fetch.wait_entered("https://example.com/a")
        flaky.refuse = frozenset({"get_job"})
        fetch.release("https://example.com/a")
        assert runner.wait(job_id, timeout=WAIT) is not None  # answered from the write
        time.sleep(0.3)  # several heartbeats with the store refusing the read
        assert handed == []
        # The event thread held up (a slow subscriber) while the store comes back: the
        # retries of several heartbeats queue up behind it, and only one hands it over.
        gate = threading.Event()
        runner._events.call_soon(lambda: gate.wait(WAIT))
        time.sleep(0.3)
        flaky.refuse = frozenset()
        gate.set()
        wait_for(lambda: bool(handed), "on_finish once the store answers")
        time.sleep(0.2)
    assert [(j.id, j.status) for j in handed] == [(job_id, "done")]


def test_on_finish_of_a_job_whose_drain_gave_up_gets_the_job_as_it_ended(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """The drain gave up storing (its job still running in the store); maintenance fails
    the job, and on_finish gets it failed, once, not running."""
    handed: list[batch.Job] = []
    config = batch.Config(
        heartbeat=dt.timedelta(seconds=0.05), write_retry=dt.timedelta(seconds=0.2)
    )
    flaky.refuse_writes = True
    flaky.refuse = frozenset({"fail_job"})
    with batch.Runner(flaky, fetch, config, on_finish=handed.append) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a"))
        wait_for(lambda: not runner._drains, "the drain to give up")
        time.sleep(0.3)
        assert handed == []  # the job is still running in the store: not its end yet
        flaky.refuse = frozenset()
        wait_for(lambda: bool(handed), "on_finish once maintenance ended the job")
        time.sleep(0.2)
    assert [(j.status, j.error) for j in handed] == [("failed", "store unavailable")]


# -- fault 7: deep meta ---------------------------------------------------------------------


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"k": value}
    return value


def test_meta_nested_past_the_limit_fails_its_target_and_every_read_still_works(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """json encodes 1000 levels but cannot decode them: refuse at write, not on each read."""
    fetch.behave("https://example.com/deep", lambda t: batch.Result("x", nested(1000)))
    limit = batch._values.MAX_META_DEPTH
    fetch.behave("https://example.com/edge", lambda t: batch.Result("y", nested(limit)))
    with batch.Runner(flaky, fetch, FAST) as runner:
        job_id, _ = runner.submit("alice", "free", urls("deep", "edge"))
        assert runner.wait(job_id, timeout=WAIT) is not None
        found = runner.status(job_id)
        assert found is not None
        deep, edge = found[1]
        assert (deep.status, deep.result) == ("failed", None)
        assert deep.error == f"ResultTooDeep: meta nests more than {limit} levels"
        assert edge.status == "done"
        assert edge.result == batch.Result("y", nested(limit))


def test_a_stored_result_that_cannot_be_decoded_does_not_break_status(
    flaky: FlakyDB,
) -> None:
    """Rows written by an older version may hold anything: the read must survive it."""
    job = flaky.submit(
        job_id="a" * 32,
        caller="c",
        caller_class="free",
        idem_key="0" * 64,
        targets=[dcache.NewTarget("https://example.com/a"), dcache.NewTarget("https://x/b")],
        ttl=dt.timedelta(hours=1),
        jobs_per_caller=1,
        jobs_total=8,
    )
    assert job.kind == "created"
    deep = '{"content": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    flaky.write_target("a" * 32, 0, status="done", result=deep, ttl=dt.timedelta(hours=1))
    flaky.write_target("a" * 32, 1, status="done", result="not json", ttl=dt.timedelta(hours=1))
    with batch.Runner(flaky, FakeFetch(), FAST) as runner:
        found = runner.status("a" * 32)
        assert found is not None
        t0, t1 = found[1]
        assert (t0.status, t0.result) == ("done", None)
        assert t0.error == "stored result unreadable (RecursionError)"
        assert (t1.result, t1.error) == (None, "stored result unreadable (JSONDecodeError)")


# -- Config.fetch_timeout -------------------------------------------------------------------


def test_a_hung_fetch_fails_its_target_at_the_deadline_and_the_drain_goes_on(
    flaky: FlakyDB, fetch: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """One hung fetch must not hold a job (and its caps) for ever; a late result is dropped."""
    fetch.block("https://example.com/hang")
    config = batch.Config(heartbeat=dt.timedelta(seconds=0.05), fetch_timeout=0.3)
    with batch.Runner(flaky, fetch, config) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a", "hang", "b"))
        final = runner.wait(job_id, timeout=WAIT)
        assert final is not None
        assert (final.status, final.targets_done) == ("partial", 3)
        found = runner.status(job_id)
        assert found is not None
        assert [(t.status, t.error) for t in found[1]] == [
            ("done", ""),
            ("failed", "FetchTimeout: no result within 0.3 s"),
            ("done", ""),
        ]
        # The seed's order: b was fetched only after hang's failure was stored.
        assert fetch.calls == [f"https://example.com/{n}" for n in ("a", "hang", "b")]
        with caplog.at_level(logging.WARNING, logger="batch"):
            fetch.release("https://example.com/hang")
            wait_for(lambda: "result discarded" in caplog.text, "the late result to be dropped")
        again = runner.status(job_id)
        assert again is not None
        assert again[1][1].error == "FetchTimeout: no result within 0.3 s"


def test_a_cancel_during_a_hung_fetch_stops_the_job_at_the_deadline(
    flaky: FlakyDB, fetch: FakeFetch
) -> None:
    """wait() after a cancel returns by the fetch deadline, not when the fetch returns."""
    fetch.block("https://example.com/hang")
    config = batch.Config(heartbeat=dt.timedelta(seconds=0.05), fetch_timeout=0.5)
    with batch.Runner(flaky, fetch, config) as runner:
        job_id, _ = runner.submit("alice", "free", urls("hang", "b"))
        fetch.wait_entered("https://example.com/hang")
        assert runner.cancel(job_id)
        final = runner.wait(job_id, timeout=WAIT)
        assert final is not None
        assert (final.status, final.targets_done) == ("cancelled", 1)
        assert final.finished_at is not None
        found = runner.status(job_id)
        assert found is not None
        assert [t.status for t in found[1]] == ["failed", "pending"]
    assert fetch.calls == ["https://example.com/hang"]


# -- fault 10: values past what datetime and threads take -----------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"ttl": 1e30},
        {"ttl": dt.timedelta(days=10**6)},
        {"heartbeat": dt.timedelta(days=10**6)},
        {"heartbeat": math.nan},
        {"write_retry": math.inf},
        {"fetch_timeout": -1},
        {"fetch_timeout": math.nan},
    ],
)
def test_config_durations_past_what_datetime_can_hold_are_a_value_error(
    kw: dict[str, Any],
) -> None:
    """An OverflowError at submit or in a thread is no way to say "too large"."""
    with pytest.raises(ValueError):
        batch.Config(**kw)


def test_the_largest_durations_work_end_to_end(flaky: FlakyDB, fetch: FakeFetch) -> None:
    """A hundred-year TTL and heartbeat are accepted and a job still runs."""
    big = batch._values.MAX_DURATION
    with batch.Runner(flaky, fetch, batch.Config(ttl=big, heartbeat=big, fetch_timeout=big)) as r:
        job_id, _ = r.submit("alice", "free", urls("a"))
        job = r.wait(job_id, timeout=math.inf)
        assert job is not None
        assert job.expires_at is not None
        assert job.status == "done"


def test_wait_takes_infinity_and_refuses_nan(flaky: FlakyDB, fetch: FakeFetch) -> None:
    """inf means "no limit" (it raised OverflowError); NaN used to poll for ever."""
    with batch.Runner(flaky, fetch, FAST) as runner:
        job_id, _ = runner.submit("alice", "free", urls("a"))
        with pytest.raises(ValueError, match="NaN"):
            runner.wait(job_id, timeout=math.nan)
        job = runner.wait(job_id, timeout=math.inf)
        assert job is not None
        assert runner.wait("0" * 32, timeout=math.inf) is None
        assert runner.wait(job_id, timeout=-1) is not None  # finished: no wait needed
    assert json.dumps(batch.Config().fetch_timeout) == "null"


# -- the group writer's lead ----------------------------------------------------------

_INTERRUPTED_FOLLOWER = """
import datetime as dt, signal, sys, threading, time
import dcache
from dcache import _writer

# Started with SIGINT ignored (a shell's background job), Python leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

ttl = dt.timedelta(hours=1)
db = dcache.DB.open("sqlite://")
job = db.submit(job_id="j", caller="c", caller_class="x", idem_key="k",
                targets=[dcache.NewTarget(url=f"https://example.com/{i}") for i in range(4)],
                ttl=ttl, jobs_per_caller=9, jobs_total=9).job.id
real = _writer.GroupWriter._commit_held
started, handled = threading.Event(), threading.Event()
def slow(self, batch):  # the first batch lasts until the follower's interrupt was handled
    started.set(); handled.wait(60); return real(self, batch)
_writer.GroupWriter._commit_held = slow
leader = threading.Thread(target=db.write_target, args=(job, 0),
                          kwargs=dict(status="done", ttl=ttl))
leader.start()
started.wait()
main = threading.main_thread().ident
def interrupt():  # once the main thread's write waits in the queue, not before
    deadline = time.monotonic() + 60
    while not db._group._queued and time.monotonic() < deadline:
        time.sleep(0.005)
    signal.pthread_kill(main, signal.SIGINT)
threading.Thread(target=interrupt).start()
try:
    db.write_target(job, 1, status="done", ttl=ttl)  # queued behind the leader's batch
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
handled.set()
leader.join()
_writer.GroupWriter._commit_held = real
later = threading.Thread(target=db.write_target, args=(job, 2),
                         kwargs=dict(status="done", ttl=ttl), daemon=True)
later.start(); later.join(10)
print("later write", "hung" if later.is_alive() else "returned")
closer = threading.Thread(target=db.close, daemon=True)
closer.start(); closer.join(10)
print("close", "hung" if closer.is_alive() else "returned")
"""


def test_a_drain_interrupted_while_its_write_waits_does_not_strand_the_lead() -> None:
    """An interrupt (KeyboardInterrupt) of a thread whose write waits behind another's
    batch: its outcome stayed queued, the leader handed the lead to it, and nobody took
    it; every later write and close() waited forever. Run in a child process, whose main
    thread the test interrupts."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_FOLLOWER],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["interrupted", "later write returned", "close returned"]
