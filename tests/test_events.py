"""The event stream (issue 13): what is emitted, and that no subscriber can harm a drain."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Iterator

import pytest
from _fetchers import WAIT, FakeFetch, join_threads, wait_for

import batch
import dcache
from batch import events

CONFIG = batch.Config(heartbeat=dt.timedelta(seconds=30), jobs_per_caller=1, jobs_total=8)


class Recorder:
    """A subscriber that keeps every event."""

    def __init__(self) -> None:
        self.events: list[events.Event] = []
        self.lock = threading.Lock()

    def __call__(self, event: events.Event) -> None:
        with self.lock:
            self.events.append(event)

    def of(self, kind: type) -> list[events.Event]:
        with self.lock:
            return [e for e in self.events if isinstance(e, kind)]


@pytest.fixture
def fake() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


def boom(target: batch.Target) -> batch.Result:
    raise batch.FetchError("gone", hint="check the URL")


def test_a_jobs_life_is_told_in_order_with_its_numbers(db: dcache.DB, fake: FakeFetch) -> None:
    """Submitted, one TargetStored per target (status, timings, bytes), then JobFinished."""
    rec = Recorder()
    fake.behave("https://e.com/b", boom)
    with batch.Runner(db, fake, CONFIG, observers=[rec]) as runner:
        job_id, _ = runner.submit(
            "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
        )
        assert runner.wait(job_id, timeout=WAIT) is not None
        assert runner.submit(
            "alice", "gold", [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
        ) == (job_id, True)
        wait_for(lambda: len(rec.of(events.JobSubmitted)) == 2, "the reuse event")
    kinds = [type(e).__name__ for e in rec.events]
    assert kinds == ["JobSubmitted", "TargetStored", "TargetStored", "JobFinished", "JobSubmitted"]
    created, a, b, finished, reused = rec.events
    assert isinstance(created, events.JobSubmitted)
    assert (
        created.job_id,
        created.caller,
        created.caller_class,
        created.targets,
        created.reused,
    ) == (
        job_id,
        "alice",
        "gold",
        2,
        False,
    )
    assert isinstance(a, events.TargetStored) and isinstance(b, events.TargetStored)
    assert (a.idx, a.status, a.caller_class) == (0, "done", "gold")
    assert a.result_bytes > len("content of https://e.com/a")
    assert (b.idx, b.status, b.result_bytes) == (1, "failed", 0)
    assert a.fetch_seconds >= 0 and a.store_seconds > 0
    assert isinstance(finished, events.JobFinished)
    assert (finished.job_id, finished.status, finished.caller_class) == (job_id, "partial", "gold")
    assert finished.duration_seconds > 0
    assert isinstance(reused, events.JobSubmitted) and reused.reused


def test_refusals_and_cancels_are_events_too(db: dcache.DB, fake: FakeFetch) -> None:
    """Which cap or which validation refused a submission is what operators alert on."""
    rec = Recorder()
    fake.block("https://e.com/slow")
    with batch.Runner(db, fake, CONFIG, observers=[rec]) as runner:
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/slow"}])
        with pytest.raises(batch.CallerBusyError):
            runner.submit("alice", "free", [{"url": "https://e.com/other"}])
        with pytest.raises(batch.InvalidTargetsError):
            runner.submit("alice", "free", [])
        with pytest.raises(batch.TooManyTargetsError):
            runner.submit("bob", "free", [{"url": f"https://e.com/{i}"} for i in range(33)])
        fake.wait_entered("https://e.com/slow")
        assert runner.cancel(job_id)
        fake.release("https://e.com/slow")
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: bool(rec.of(events.JobFinished)), "the job's end")
    refused = rec.of(events.SubmissionRefused)
    assert [(e.caller, e.reason) for e in refused] == [  # type: ignore[attr-defined]
        ("alice", "caller_busy"),
        ("alice", "invalid"),
        ("bob", "too_many_targets"),
    ]
    assert [e.job_id for e in rec.of(events.JobCancelled)] == [job_id]  # type: ignore[attr-defined]
    [end] = rec.of(events.JobFinished)
    assert (end.status, end.job_id) == ("cancelled", job_id)  # type: ignore[attr-defined]


def test_a_subscriber_that_raises_breaks_nothing(
    db: dcache.DB, fake: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """An observer's bug is logged; drains, submits and the other observers go on."""
    rec = Recorder()

    def broken(event: events.Event) -> None:
        raise RuntimeError("observer bug")

    with (
        caplog.at_level(logging.ERROR, logger="batch"),
        batch.Runner(db, fake, CONFIG, observers=[broken, rec]) as runner,
    ):
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and job.status == "done"
        wait_for(lambda: bool(rec.of(events.JobFinished)), "the other observer's events")
    assert "event subscriber" in caplog.text and "observer bug" in caplog.text


def test_a_subscriber_that_blocks_never_slows_a_drain(db: dcache.DB, fake: FakeFetch) -> None:
    """A stuck observer (a slow metrics push) must not hold jobs: they finish regardless."""
    gate = threading.Event()
    entered = threading.Event()

    def stuck(event: events.Event) -> None:
        entered.set()
        gate.wait(WAIT)

    with batch.Runner(db, fake, batch.Config(jobs_per_caller=4), observers=[stuck]) as runner:
        try:
            ids = [
                runner.submit(
                    "alice", "free", [{"url": f"https://e.com/{i}-{k}"} for k in range(4)]
                )[0]
                for i in range(4)
            ]
            assert entered.wait(WAIT)
            for job_id in ids:  # all 16 targets stored while the observer is stuck
                job = runner.wait(job_id, timeout=WAIT)
                assert job is not None and job.status == "done"
            assert not gate.is_set()
        finally:
            gate.set()


def test_unsubscribe_stops_delivery(db: dcache.DB, fake: FakeFetch) -> None:
    """subscribe() hands back the way to stop listening (the dashboard's live view)."""
    rec = Recorder()
    with batch.Runner(db, fake, CONFIG) as runner:
        stop = runner.subscribe(rec)
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: bool(rec.of(events.JobFinished)), "the first job's end")
        stop()
        seen = len(rec.events)
        job_id, _ = runner.submit("bob", "free", [{"url": "https://e.com/b"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
    assert len(rec.events) == seen
    with pytest.raises(TypeError):
        runner.subscribe("not callable")  # type: ignore[arg-type]


def test_result_bytes_are_the_stored_results_utf8_bytes(db: dcache.DB) -> None:
    """As the store counts them (and batch_result_bytes_total says): not characters."""
    rec = Recorder()
    with batch.Runner(db, lambda t: batch.Result("é😀" * 500), CONFIG) as runner:
        runner.subscribe(rec)
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: bool(rec.of(events.TargetStored)), "the target's event")
        found = runner.status(job_id, results=False)
    assert found is not None
    (stored,) = rec.of(events.TargetStored)
    assert isinstance(stored, events.TargetStored)
    assert stored.result_bytes == found[1][0].result_bytes > 3 * 1000


def test_each_subscription_is_undone_by_its_own_unsubscribe(db: dcache.DB) -> None:
    """One callable subscribed twice gets each event twice; one unsubscribe removes one
    subscription (it removed both)."""
    rec = Recorder()
    with batch.Runner(db, lambda t: batch.Result("x"), CONFIG) as runner:
        first = runner.subscribe(rec)
        runner.subscribe(rec)
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: len(rec.of(events.JobFinished)) == 2, "both subscriptions' ends")
        first()
        first()  # idempotent: the other subscription stays
        job_id, _ = runner.submit("bob", "free", [{"url": "https://e.com/b"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: len(rec.of(events.JobFinished)) == 3, "the remaining one's end")
    assert len(rec.of(events.JobFinished)) == 3


def test_a_cancel_is_told_before_the_end_it_causes(db: dcache.DB, fake: FakeFetch) -> None:
    """JobCancelled comes before the JobFinished(cancelled) of the drain it stopped, even
    when the drain learns of the cancel from its own write the moment the cancel commits
    (here: the in-flight fetch returns then, and the cancel takes a while to return)."""
    rec = Recorder()
    real_cancel = db.cancel

    def slow_cancel(job_id: str, now: dt.datetime | None = None) -> bool:
        won = real_cancel(job_id, now=now)
        fake.release("https://e.com/a")  # the drain stores its target, finds it cancelled
        wait_for(lambda: bool(rec.of(events.TargetStored)), "the in-flight target's write")
        threading.Event().wait(0.2)  # the drain is ending meanwhile
        return won

    with batch.Runner(db, fake, CONFIG) as runner:
        runner.subscribe(rec)
        fake.block("https://e.com/a")
        urls = [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
        job_id, _ = runner.submit("alice", "free", urls)
        fake.wait_entered("https://e.com/a")
        db.cancel = slow_cancel  # type: ignore[method-assign]
        try:
            assert runner.cancel(job_id)
        finally:
            db.cancel = real_cancel  # type: ignore[method-assign]
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: bool(rec.of(events.JobFinished)), "the job's end")
    kinds = [type(e).__name__ for e in rec.events if not isinstance(e, events.TargetStored)]
    assert kinds == ["JobSubmitted", "JobCancelled", "JobFinished"], kinds


def test_a_drain_that_outlives_close_still_has_its_end_told(fake: FakeFetch) -> None:
    """close() fails a job whose fetch ignores shutdown and closes the bus: it tells that
    end itself (the drain's own JobFinished came after the bus closed and was dropped,
    so the live-jobs gauge stayed up), and the drain tells no second end."""
    rec = Recorder()
    runner = batch.Runner(dcache.DB.memory(), fake, CONFIG)
    runner.subscribe(rec)
    fake.block("https://e.com/a")
    job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
    fake.wait_entered("https://e.com/a")
    runner.close(timeout=0.05)
    ends = rec.of(events.JobFinished)
    assert [(e.job_id, e.status, e.error) for e in ends] == [(job_id, "failed", "shutdown")]  # type: ignore[attr-defined]
    fake.release("https://e.com/a")
    join_threads([f"batch-job-{job_id}"])
    assert len(rec.of(events.JobFinished)) == 1
    runner.db.close()


def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    """The emitting thread never waits: past the bound, events are dropped and counted."""
    gate = threading.Event()
    bus = events.EventBus(
        [lambda e: gate.wait(WAIT)], logging.getLogger("batch"), name="t", maxsize=2
    )
    bus.start()
    at = dt.datetime.now(dt.timezone.utc)
    for i in range(10):
        bus.emit(events.JobCancelled(at, str(i)))
    assert bus.dropped >= 7
    gate.set()
    bus.close()


def test_an_event_nobody_wants_is_not_queued_and_declared_interests_are_honoured() -> None:
    """Subscribers that declare their event classes get only those; a kind no subscriber
    wants costs the emitter nothing (the runner's log subscriber skips TargetStored)."""
    import logging

    from batch.events import EventBus, JobFinished, TargetStored, only

    got: list[object] = []
    bus = EventBus([only(JobFinished, fn=got.append)], logging.getLogger("t"), name="t")
    stored = TargetStored(dt.datetime.now(dt.timezone.utc), "j", 0, "c", "done", 0.0, 0.0, 1)
    assert not bus.wants(TargetStored) and bus.wants(JobFinished)  # a drain skips building it
    bus.emit(stored)
    assert bus._queue.qsize() == 0  # not queued at all
    finished = JobFinished(dt.datetime.now(dt.timezone.utc), "j", "c", "done", "", 1.0)
    bus.emit(finished)
    assert bus._queue.qsize() == 1
    everything: list[object] = []
    unsubscribe = bus.subscribe(everything.append)
    assert bus.wants(TargetStored)
    bus.emit(stored)
    assert bus._queue.qsize() == 2
    bus.start()
    bus.close()
    assert got == [finished]
    assert everything == [finished, stored]  # subscribed before the dispatcher ran
    assert not bus.wants(JobFinished)  # closed: nothing is queued any more
    unsubscribe()


def test_a_subscriber_that_wants_events_only_at_times_is_asked_at_every_emit() -> None:
    """``only(..., when=)``: an event only such a subscriber would take is queued while
    ``when()`` says yes, and not queued at all while it says no; a subscriber without
    ``when`` keeps wanting its kinds whatever the other one says."""
    from batch.events import EventBus, JobFinished, only

    got: list[object] = []
    on = [False]
    bus = EventBus(
        [only(JobFinished, fn=got.append, when=lambda: on[0])], logging.getLogger("t"), name="t"
    )
    finished = JobFinished(dt.datetime.now(dt.timezone.utc), "j", "c", "done", "", 1.0)
    assert not bus.wants(JobFinished)
    bus.emit(finished)
    assert bus._queue.qsize() == 0
    on[0] = True  # asked again at the next emit: no cache keeps the old answer
    assert bus.wants(JobFinished)
    bus.emit(finished)
    assert bus._queue.qsize() == 1
    on[0] = False
    always: list[object] = []
    bus.subscribe(only(JobFinished, fn=always.append))
    assert bus.wants(JobFinished)
    bus.emit(finished)
    bus.start()
    bus.close()
    # Two were queued (one for each wanting subscriber at its emit); every queued event
    # goes to every subscriber of its kind.
    assert always == [finished, finished]
    assert got == [finished, finished]


def test_an_event_when_that_raises_is_taken_as_yes_and_breaks_no_drain(
    db: dcache.DB, fake: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """``event_when`` runs on the drain's and the submit's threads: one that raises is
    logged once and counts as a yes, and the job is drained to its end."""
    rec = Recorder()

    def broken_when() -> bool:
        raise RuntimeError("predicate bug")

    subscriber = events.only(events.TargetStored, events.JobSubmitted, fn=rec, when=broken_when)
    urls = [{"url": f"https://e.com/{i}"} for i in range(4)]
    with (
        caplog.at_level(logging.ERROR, logger="batch"),
        batch.Runner(db, fake, CONFIG, observers=[subscriber]) as runner,
    ):
        job_id, _ = runner.submit("alice", "free", urls)
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and (job.status, job.targets_done) == ("done", 4)
        wait_for(lambda: len(rec.of(events.TargetStored)) == 4, "the stored events")
    assert caplog.text.count("taken as yes") == 1  # logged once, not at every emit


@pytest.mark.parametrize(
    "declared", [[events.JobFinished], {events.JobFinished}, events.JobFinished]
)
def test_event_types_may_be_any_collection_of_classes_or_one_class(
    db: dcache.DB, fake: FakeFetch, declared: object
) -> None:
    """A list (not the documented tuple) or a lone class works; the submit that emits
    never meets it (it raised TypeError from issubclass there)."""
    rec = Recorder()
    rec.event_types = declared  # type: ignore[attr-defined]
    with batch.Runner(db, fake, CONFIG) as runner:
        runner.subscribe(rec)
        job_id, _ = runner.submit("alice", "free", [{"url": "https://e.com/a"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(lambda: bool(rec.of(events.JobFinished)), "the finished event")
    assert {type(e) for e in rec.events} == {events.JobFinished}


def test_event_types_that_are_no_classes_are_refused_when_subscribing() -> None:
    """A TypeError on the subscriber's own thread, when it subscribes, not at an emit."""
    bus = events.EventBus([], logging.getLogger("t"), name="t")
    for bad in ("JobFinished", [events.JobFinished, "x"], 3):
        rec = Recorder()
        rec.event_types = bad  # type: ignore[attr-defined]
        with pytest.raises(TypeError, match="event_types"):
            bus.subscribe(rec)


def test_a_subscribe_during_wants_is_not_hidden_by_its_stale_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``wants`` computing its answer from the old subscribers while a subscribe lands
    must not cache that answer for the new ones: the new subscriber gets its events."""
    bus = events.EventBus(
        [events.only(events.JobFinished, fn=lambda e: None)], logging.getLogger("t"), name="t"
    )
    late: list[object] = []
    real = events._wants
    raced = [False]

    def racing(types: object, kind: type) -> bool:
        if not raced[0]:
            raced[0] = True
            bus.subscribe(events.only(events.TargetStored, fn=late.append))
        return real(types, kind)  # type: ignore[arg-type]

    monkeypatch.setattr(events, "_wants", racing)
    assert not bus.wants(events.TargetStored)  # answered from the subscribers it read
    monkeypatch.setattr(events, "_wants", real)
    assert bus.wants(events.TargetStored)  # not from a cache the subscribe made stale


def test_the_runners_log_lines_cost_no_event_while_info_is_off(
    db: dcache.DB, fake: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """The runner's own log subscriber wants job events only while its logger is enabled
    for INFO: with INFO off a submit and a job's end queue nothing (no dispatcher wake-up),
    and once INFO is on the lines are there again, without a new runner."""
    log = logging.getLogger("batch.test-quiet-log")
    log.setLevel(logging.WARNING)
    with batch.Runner(db, fake, CONFIG, log=log) as runner:
        bus = runner._events
        assert not bus.wants(events.JobSubmitted) and not bus.wants(events.JobFinished)
        job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/q1"}])
        assert runner.wait(job_id, timeout=WAIT) is not None
        assert bus._queue.qsize() == 0
        with caplog.at_level(logging.INFO, logger=log.name):
            assert bus.wants(events.JobSubmitted) and bus.wants(events.JobFinished)
            second, _ = runner.submit("alice", "gold", [{"url": "https://e.com/q2"}])
            assert runner.wait(second, timeout=WAIT) is not None
            wait_for(
                lambda: any("finished: done" in r.getMessage() for r in caplog.records),
                "the job's end in the log",
            )
    messages = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert not any(job_id in m for m in messages)  # INFO was off for the first job
    assert any(f"job {second} submitted by alice" in m for m in messages)
    assert any(f"job {second} finished: done" in m for m in messages)
