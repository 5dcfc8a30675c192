"""The runner's rules, thread by thread, on every backend of the store fixture.

Fetches are fakes from ``_fetchers``: a test holds one on an Event, checks what the runner
and the store say meanwhile, and releases it. Time-dependent rules (leases, purges) move
the injected clock instead of sleeping. Multi-process crash tests live elsewhere.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _fetchers import WAIT, FakeFetch, join_threads, wait_for
from conftest import backend_url, failed_jobs
from sqlalchemy import event

import batch
import dcache
from batch import (
    BusyError,
    CallerBusyError,
    Config,
    FetchError,
    InvalidTargetsError,
    Job,
    Options,
    Result,
    Runner,
    RunnerClosedError,
    Target,
    TargetStatus,
    TooManyTargetsError,
)
from batch._values import MAX_OPTION_LENGTH

if TYPE_CHECKING:
    from conftest import Clock

A = "https://example.com/a"
B = "https://example.com/b"
C = "https://example.com/c"
TTL = dt.timedelta(hours=24)

MakeRunner = Callable[..., Runner]


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def fake() -> FakeFetch:
    """A recording fetch whose URLs a test can hold and release."""
    return FakeFetch()


@pytest.fixture
def make_runner(db: dcache.DB, clock: Clock, fake: FakeFetch) -> Iterator[MakeRunner]:
    """Build runners on the test's store and clock; release held fetches and close them all."""
    made: list[Runner] = []

    def make(
        config: Config | None = None, *, fetch: Any = None, log: logging.Logger | None = None
    ) -> Runner:
        runner = Runner(db, fetch if fetch is not None else fake, config, log, clock=clock)
        made.append(runner)
        return runner

    yield make
    fake.release_all()
    for runner in made:
        runner.close(timeout=WAIT)
    # A purge started by a submit is not joined by close(): let it end before the store
    # fixture checks that no connection is left checked out.


@pytest.fixture
def runner(make_runner: MakeRunner) -> Runner:
    """A runner with the default Config."""
    return make_runner()


@pytest.fixture
def second_runner(
    db: dcache.DB, backend: str, clock: Clock, fake: FakeFetch, tmp_path: Path
) -> Iterator[Runner]:
    """Another runner on the same database: a second DB object where the backend allows it.

    ``memory`` lives in one DB object only, so there the second runner shares it.
    """
    # The fixture's URL, not the engine's: that one has lost ``?pgbouncer=true``.
    store = db if backend == "memory" else dcache.DB.open(backend_url(backend, tmp_path))
    other = Runner(store, fake, clock=clock)
    yield other
    fake.release_all()
    other.close(timeout=WAIT)
    if store is not db:
        store.close()


def found(runner: Runner, job_id: str) -> tuple[Job, list[TargetStatus]]:
    """``runner.status(job_id)``, which must exist."""
    got = runner.status(job_id)
    assert got is not None, f"job {job_id} not found"
    return got


def statuses(runner: Runner, job_id: str) -> list[str]:
    """The target statuses of a job, in index order."""
    return [t.status for t in found(runner, job_id)[1]]


def finished(runner: Runner, job_id: str) -> Job:
    """Wait for a job's end (bounded) and return it."""
    job = runner.wait(job_id, timeout=WAIT)
    assert job is not None
    assert job.terminal
    assert job.finished_at is not None
    return job


def drain_threads(job_id: str) -> list[threading.Thread]:
    """Live threads named after the job."""
    return [t for t in threading.enumerate() if t.name == f"batch-job-{job_id}"]


def assert_drain_ends(job_id: str) -> None:
    """The job's thread ends promptly (wait() itself joins it: see the test on wait())."""
    join_threads([f"batch-job-{job_id}"])


def submit(runner: Runner, caller: str, *urls: str) -> str:
    """Submit a fresh job of plain URLs; return its id."""
    job_id, reused = runner.submit(caller, "web", [{"url": u} for u in urls])
    assert not reused
    return job_id


def race(n: int, fn: Callable[[int], Any]) -> list[tuple[str, Any]]:
    """Run ``fn(i)`` in ``n`` threads released together; ("ok", value) or ("err", exc)."""
    barrier = threading.Barrier(n)
    results: list[tuple[str, Any]] = [("missing", None)] * n

    def run(i: int) -> None:
        barrier.wait(WAIT)
        try:
            results[i] = ("ok", fn(i))
        except BaseException as exc:
            results[i] = ("err", exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
    assert not any(t.is_alive() for t in threads), "a racing submit hung"
    return results


def closed(runner: Runner) -> bool:
    """Whether the runner refuses submissions (probes without creating a job)."""
    try:
        runner.submit("", "", [])
    except RunnerClosedError:
        return True
    except InvalidTargetsError:
        return False
    raise AssertionError("an invalid submit was accepted")


# -- submit and the serial drain ------------------------------------------------------------


def test_submit_returns_with_the_job_running(runner: Runner, fake: FakeFetch) -> None:
    """`queued` is only the crash-window state: callers see `running` at once."""
    fake.block(A)
    job_id = submit(runner, "alice", A, B)
    job, targets = found(runner, job_id)
    assert job.status == "running"
    assert (job.targets_total, job.targets_done, job.error) == (2, 0, "")
    assert (job.caller, job.caller_class) == ("alice", "web")
    assert job.finished_at is None
    assert [t.url for t in targets] == [A, B]
    assert re.fullmatch(r"[0-9a-f]{32}", job_id)


def test_targets_are_fetched_one_at_a_time_in_index_order(runner: Runner, fake: FakeFetch) -> None:
    """Target i+1 starts only after target i is stored: the seed's core guarantee."""
    urls = [f"https://example.com/{i}" for i in range(5)]
    submitted = threading.Event()
    box: dict[str, str] = {}
    seen: list[tuple[str, int, list[str]]] = []

    def observe(target: Target) -> Result:
        # Runs in the drain thread: a second, independent read of the store.
        assert submitted.wait(WAIT)
        job, targets = found(runner, box["id"])
        seen.append((target.url, job.targets_done, [t.status for t in targets]))
        return Result("page " + target.url)

    for url in urls:
        fake.behave(url, observe)
    box["id"] = submit(runner, "alice", *urls)
    submitted.set()
    job = finished(runner, box["id"])
    assert job.status == "done"
    assert fake.calls == urls
    assert fake.peak == 1
    assert len(seen) == len(urls)
    for i, (url, done, target_statuses) in enumerate(seen):
        assert url == urls[i]
        assert done == i
        assert target_statuses == ["done"] * i + ["running"] + ["pending"] * (len(urls) - i - 1)


def test_jobs_of_different_callers_drain_side_by_side(runner: Runner, fake: FakeFetch) -> None:
    """One thread per job: a slow job never holds up another caller's job."""
    fake.block(A)
    slow = submit(runner, "alice", A)
    fake.wait_entered(A)
    quick = submit(runner, "bob", B)
    assert finished(runner, quick).status == "done"
    assert found(runner, slow)[0].status == "running"
    fake.release(A)
    assert finished(runner, slow).status == "done"


def test_drain_thread_is_a_daemon_named_after_its_job(runner: Runner, fake: FakeFetch) -> None:
    """`batch-job-<id>` in a thread dump tells an operator which job is stuck."""
    seen: dict[str, Any] = {}

    def observe(target: Target) -> Result:
        me = threading.current_thread()
        seen.update(name=me.name, daemon=me.daemon)
        return Result("x")

    fake.behave(A, observe)
    job_id = submit(runner, "alice", A)
    finished(runner, job_id)
    assert seen == {"name": f"batch-job-{job_id}", "daemon": True}


def test_no_drain_thread_outlives_its_job(runner: Runner, fake: FakeFetch) -> None:
    """A long-running web app must not accumulate threads, whatever way a job ends."""
    before = {t.name for t in threading.enumerate()}
    fake.behave(B, _boom)
    fake.block(C)
    done = submit(runner, "alice", A)
    failed = submit(runner, "bob", B)
    cancelled = submit(runner, "carol", C, A)
    fake.wait_entered(C)
    assert runner.cancel(cancelled)
    fake.release(C)
    for job_id, status in [(done, "done"), (failed, "failed"), (cancelled, "cancelled")]:
        assert finished(runner, job_id).status == status
        assert_drain_ends(job_id)
    assert {t.name for t in threading.enumerate()} <= before


def test_wait_returns_only_after_the_drain_thread_has_exited(clock: Clock, fake: FakeFetch) -> None:
    """wait() promises the drain has stopped: right after it, the job's thread is gone.

    The window between the drain's done-event and its thread's exit is microseconds (about
    1 wait in 1500 sees the thread alive), so a trace hook widens it: the drain thread is
    held for a second as ``Runner._drain`` returns. A wait() that joins the thread rides
    that out; one that returns on the done-event alone finds the thread still alive.
    Runner logic only: one backend suffices.
    """
    hold = threading.Event()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            hold.wait(1.0)
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        code_is_drain = frame.f_code.co_name == "_drain"
        if code_is_drain and frame.f_globals.get("__name__") == "batch._runner":
            return local
        return None

    store = dcache.DB.memory()
    runner = Runner(store, fake, clock=clock)
    job_id = ""
    threading.settrace(tracer)  # for threads started from now on: the job's drain
    try:
        job_id = submit(runner, "alice", A)
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and job.status == "done"
        assert drain_threads(job_id) == []
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
        hold.set()
        runner.close(timeout=WAIT)
        join_threads([f"batch-job-{job_id}"])
        store.close()


def test_results_and_options_are_readable_through_status(runner: Runner, fake: FakeFetch) -> None:
    """Callers read each target's URL, options, content and meta back as they sent them."""
    opts = Options(mode="text", question="¿qué?", grep="a|b", context=True)
    job_id, _ = runner.submit("alice", "web", [Target(A, opts), {"url": B}])
    finished(runner, job_id)
    _, targets = found(runner, job_id)
    assert [(t.idx, t.url, t.options) for t in targets] == [(0, A, opts), (1, B, Options())]
    assert targets[0].result == Result(f"content of {A}", {"url": A})
    assert (targets[0].error, targets[0].hint) == ("", "")


# -- failure isolation and terminal statuses ------------------------------------------------


def _boom(target: Target) -> Result:
    raise RuntimeError(f"cannot fetch {target.url}")


def test_one_failed_target_makes_the_job_partial(runner: Runner, fake: FakeFetch) -> None:
    """One bad URL must not cost the caller the other results."""
    fake.behave(B, _boom)
    job_id = submit(runner, "alice", A, B, C)
    job = finished(runner, job_id)
    assert job.status == "partial"
    assert (job.targets_done, job.targets_failed, job.error) == (3, 1, "")
    _, targets = found(runner, job_id)
    assert [t.status for t in targets] == ["done", "failed", "done"]
    assert targets[1].error == f"RuntimeError: cannot fetch {B}"
    assert targets[1].result is None
    assert fake.calls == [A, B, C]


def test_all_targets_failed_makes_the_job_failed(runner: Runner, fake: FakeFetch) -> None:
    """`failed` means nothing usable came back."""
    for url in (A, B):
        fake.behave(url, _boom)
    job = finished(runner, submit(runner, "alice", A, B))
    assert (job.status, job.targets_done, job.targets_failed) == ("failed", 2, 2)


def test_all_targets_done_makes_the_job_done(runner: Runner) -> None:
    """`done` means every target has a result."""
    job = finished(runner, submit(runner, "alice", A, B))
    assert (job.status, job.targets_done, job.targets_failed) == ("done", 2, 0)


def test_terminal_status_is_set_once(runner: Runner, clock: Clock) -> None:
    """A finished job never changes status again: no cancel, no restart marking."""
    job_id = submit(runner, "alice", A)
    first = finished(runner, job_id)
    clock.advance(minutes=1)
    assert runner.cancel(job_id) is False
    assert runner.db.mark_in_flight_failed("restart", now=clock()) == 0
    job, _ = found(runner, job_id)
    assert (job.status, job.error, job.finished_at) == ("done", "", first.finished_at)
    assert job.expires_at == first.expires_at


# -- a misbehaving fetch --------------------------------------------------------------------


def _raising(exc: BaseException) -> Callable[[Target], Any]:
    def fetch(target: Target) -> Any:
        raise exc

    return fetch


class _Unprintable(Exception):
    """An exception whose str() itself fails."""

    def __str__(self) -> str:
        raise ValueError("no text for you")


@dataclasses.dataclass
class _HttpStatus(FetchError):
    """A FetchError subclass whose generated __init__ never runs FetchError's: no
    ``message``, no ``hint``."""

    status: int


def _circular() -> dict[str, Any]:
    meta: dict[str, Any] = {}
    meta["self"] = meta
    return meta


MISBEHAVING: list[tuple[str, Callable[[Target], Any], str, str]] = [
    # (id, fetch, the target's error as a regex, its hint)
    (
        "fetch-error",
        _raising(FetchError("404 not found", hint="check the URL")),
        "404 not found",
        "check the URL",
    ),
    (
        "fetch-error-subclass-without-its-init",
        _raising(_HttpStatus(404)),
        "404",  # its str(): the args its constructor was called with
        "",
    ),
    (
        "fetch-error-hint-none",
        _raising(FetchError("gone", hint=None)),  # type: ignore[arg-type]
        "gone",
        "",
    ),
    ("runtime-error", _raising(RuntimeError("boom")), "RuntimeError: boom", ""),
    ("system-exit", _raising(SystemExit(3)), "SystemExit: 3", ""),
    ("keyboard-interrupt", _raising(KeyboardInterrupt("stop")), "KeyboardInterrupt: stop", ""),
    ("exception-without-text", _raising(ValueError()), "ValueError", ""),
    ("returns-none", lambda t: None, "TypeError: .*NoneType.*", ""),
    ("returns-str", lambda t: "<html>", "TypeError: .*str.*", ""),
    ("set-meta", lambda t: Result("x", {"tags": {"a"}}), "TypeError: .*set.*", ""),
    ("object-meta", lambda t: Result("x", {"o": object()}), "TypeError: .*object.*", ""),
    ("nan-meta", lambda t: Result("x", {"n": float("nan")}), "ValueError: .*", ""),
    ("circular-meta", lambda t: Result("x", _circular()), "ValueError: .*", ""),
    ("bytes-content", lambda t: Result(b"x"), "TypeError: .*", ""),  # type: ignore[arg-type]
    ("list-meta", lambda t: Result("x", ["a"]), "TypeError: .*", ""),  # type: ignore[arg-type]
    ("surrogate-content", lambda t: Result("bad \ud800"), "UnicodeEncodeError: .*", ""),
    ("too-large", lambda t: Result("x" * 2048), "ResultTooLarge: .*", ""),
]


def test_misbehaving_fetch_fails_only_its_target(make_runner: MakeRunner, fake: FakeFetch) -> None:
    """Whatever fetch does, it becomes that target's error and the drain goes on."""
    runner = make_runner(Config(max_result_bytes=1024))
    urls = [f"https://example.com/{name}" for name, *_ in MISBEHAVING]
    for url, (_, bad_fetch, _, _) in zip(urls, MISBEHAVING):
        fake.behave(url, bad_fetch)
    job_id = submit(runner, "alice", *urls, A)
    job = finished(runner, job_id)
    assert (job.status, job.error) == ("partial", "")
    assert (job.targets_done, job.targets_failed) == (len(urls) + 1, len(urls))
    _, targets = found(runner, job_id)
    for target, (name, _, error, hint) in zip(targets, MISBEHAVING):
        assert target.status == "failed", name
        assert re.fullmatch(error, target.error), (name, target.error)
        assert target.hint == hint, name
        assert target.result is None, name
    assert targets[-1].status == "done"
    assert fake.calls == [*urls, A]


ALL = {"memory", "sqlite", "postgresql", "mariadb"}
UNSTORABLE: list[tuple[str, list[BaseException], set[str], str]] = [
    # (id, raised by fetch, backends where it is a known bug, why)
    (
        "unprintable",
        [_Unprintable()],
        ALL,
        "batch/_runner.py _describe() calls str(exc) unguarded; the drain crashes and the "
        "job is failed 'store unavailable' with the target unstored",
    ),
    (
        "lone-surrogate",
        [RuntimeError("bad \ud800"), FetchError("bad", hint="\udc80")],
        ALL,
        "error/hint text is written unsanitised; the driver cannot encode a lone surrogate, "
        "the drain crashes and the job is failed 'store unavailable'",
    ),
    (
        "nul",
        [RuntimeError("bad\x00byte"), FetchError("bad\x00byte", hint="h\x00")],
        {"postgresql"},
        "error/hint text is written unsanitised; PostgreSQL text cannot hold NUL, the write "
        "fails and the job is failed 'store unavailable'",
    ),
    (
        "over-64-kib",
        [RuntimeError("x" * 100_000), FetchError("bad", hint="h" * 100_000)],
        {"mariadb"},
        "error/hint text is written unbounded; batch_target.error/hint are TEXT (64 KiB) on "
        "MariaDB, the write fails and the job is failed 'store unavailable'",
    ),
]


@pytest.mark.parametrize(
    ("excs", "bad_on", "why"),
    [c[1:] for c in UNSTORABLE],
    ids=[c[0] for c in UNSTORABLE],
)
def test_fetch_error_text_the_store_cannot_hold_still_fails_only_its_target(
    request: pytest.FixtureRequest,
    backend: str,
    runner: Runner,
    fake: FakeFetch,
    excs: list[BaseException],
    bad_on: set[str],
    why: str,
) -> None:
    """An exception's text is untrusted input: it must be stored safely, not kill the job."""
    del request, bad_on, why  # the backends where this once failed, and why: see UNSTORABLE
    jobs = []
    for i, exc in enumerate(excs):
        url = f"https://example.com/bad-{i}"
        fake.behave(url, _raising(exc))
        jobs.append(submit(runner, f"caller-{i}", url, B))
    for job_id, exc in zip(jobs, excs):
        job = finished(runner, job_id)
        assert (job.status, job.error) == ("partial", ""), repr(exc)
        _, (bad, good) = found(runner, job_id)
        assert bad.status == "failed"
        expected = "bad" if isinstance(exc, FetchError) else type(exc).__name__
        assert bad.error.startswith(expected), (exc, bad.error)
        assert good.status == "done"


def test_fetch_crash_is_logged_critical_with_the_job_id(
    make_runner: MakeRunner, fake: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """Operators find crashed fetches in the logs, with a traceback and the job id."""
    runner = make_runner(log=logging.getLogger("tests.batch"))
    fake.behave(A, _boom)
    with caplog.at_level(logging.CRITICAL, logger="tests.batch"):
        job_id = submit(runner, "alice", A)
        finished(runner, job_id)
    crit = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert crit, "no critical record"
    assert crit[0].name == "tests.batch"
    assert getattr(crit[0], "job_id", None) == job_id
    assert crit[0].exc_info is not None


# -- idempotency ----------------------------------------------------------------------------


def test_identical_resubmit_returns_the_same_job_without_a_second_drain(
    runner: Runner, fake: FakeFetch
) -> None:
    """A retried HTTP request must not fetch everything twice."""
    fake.block(A)
    targets = [{"url": A}, {"url": B}]
    job_id, reused = runner.submit("alice", "web", targets)
    assert not reused
    fake.wait_entered(A)
    assert runner.submit("alice", "web", targets) == (job_id, True)  # while running
    assert runner.submit("alice", "other-class", targets) == (job_id, True)
    fake.release(A)
    finished(runner, job_id)
    assert runner.submit("alice", "web", targets) == (job_id, True)  # once done
    assert fake.calls == [A, B]
    assert_drain_ends(job_id)


def test_field_order_whitespace_and_default_options_do_not_change_the_key(
    runner: Runner, fake: FakeFetch
) -> None:
    """Clients serialise the same request differently; it is still the same job."""
    job_id, _ = runner.submit(
        "alice", "web", [{"url": A, "options": {"mode": "m", "context": True}}, {"url": B}]
    )
    pretty = (
        '[ { "options" : { "context" : true , "mode" : "m", "grep": "" },\n'
        '    "url" : "https://example.com/a" },\n'
        '  { "url": "https://example.com/b", "options": {"recover": false} } ]'
    )
    spellings: list[Any] = [
        json.loads(pretty),
        [Target(A, Options(context=True, mode="m")), Target(B, Options())],
        [{"url": A, "options": {"context": True, "mode": "m"}}, Target(B)],
        ({"options": {"mode": "m", "context": True, "jq": ""}, "url": A}, {"url": B}),
    ]
    for targets in spellings:
        assert runner.submit("alice", "web", targets) == (job_id, True)
    finished(runner, job_id)
    assert fake.calls == [A, B]


def test_another_caller_gets_its_own_job(runner: Runner, fake: FakeFetch) -> None:
    """Idempotency is per caller: two users asking for the same page get separate jobs."""
    alice = submit(runner, "alice", A)
    bob, reused = runner.submit("bob", "web", [{"url": A}])
    assert not reused
    assert bob != alice
    finished(runner, alice)
    finished(runner, bob)
    assert fake.count(A) == 2


def test_a_different_target_list_is_a_new_job(runner: Runner, fake: FakeFetch) -> None:
    """Order and options are part of the request: a change is never answered by reuse."""
    first = submit(runner, "alice", A, B)
    finished(runner, first)
    for targets in ([{"url": B}, {"url": A}], [{"url": A, "options": {"grep": "x"}}, {"url": B}]):
        job_id, reused = runner.submit("alice", "web", targets)
        assert not reused and job_id != first
        finished(runner, job_id)


def test_resubmit_reuses_a_job_in_any_status(runner: Runner, fake: FakeFetch) -> None:
    """A cancelled or failed job is still the answer to the same request until it lapses."""
    fake.behave(B, _boom)
    fake.block(C)
    failed = submit(runner, "alice", B)
    finished(runner, failed)
    cancelled = submit(runner, "bob", C)
    assert runner.cancel(cancelled)
    fake.release(C)
    finished(runner, cancelled)
    assert runner.submit("alice", "web", [{"url": B}]) == (failed, True)
    assert runner.submit("bob", "web", [{"url": C}]) == (cancelled, True)
    assert fake.calls == [B, C]


def test_resubmit_after_the_lease_lapses_creates_a_fresh_job(
    runner: Runner, fake: FakeFetch, clock: Clock
) -> None:
    """After the TTL the old job is gone, so the same request runs again."""
    job_id = submit(runner, "alice", A)
    expires = finished(runner, job_id).expires_at
    assert expires is not None
    clock.now = expires - dt.timedelta(microseconds=1)
    assert runner.submit("alice", "web", [{"url": A}]) == (job_id, True)
    clock.now = expires
    fresh, reused = runner.submit("alice", "web", [{"url": A}])
    assert not reused and fresh != job_id
    assert runner.status(job_id) is None
    finished(runner, fresh)
    assert fake.count(A) == 2


# -- caps -----------------------------------------------------------------------------------


def test_too_many_targets_is_refused_with_count_and_limit(
    make_runner: MakeRunner, fake: FakeFetch
) -> None:
    """A job larger than targets_per_job is a 422 telling the client the limit."""
    runner = make_runner(Config(targets_per_job=2))
    with pytest.raises(TooManyTargetsError) as info:
        runner.submit("alice", "web", [{"url": u} for u in (A, B, C)])
    assert (info.value.count, info.value.limit, info.value.http_status) == (3, 2, 422)
    assert runner.jobs() == []
    finished(runner, submit(runner, "alice", A, B))  # exactly at the limit is fine


def test_a_caller_with_a_live_job_is_busy(runner: Runner, fake: FakeFetch) -> None:
    """jobs_per_caller keeps one user from hogging the runner."""
    fake.block(A)
    first = submit(runner, "alice", A)
    with pytest.raises(CallerBusyError) as info:
        runner.submit("alice", "web", [{"url": B}])
    err = info.value
    assert (err.caller, err.live, err.limit, err.http_status) == ("alice", 1, 1, 429)
    finished(runner, submit(runner, "bob", B))  # another caller is not affected
    fake.release(A)
    finished(runner, first)
    finished(runner, submit(runner, "alice", B))  # no longer live: free again


def test_all_live_jobs_in_use_make_the_runner_busy(
    make_runner: MakeRunner, fake: FakeFetch
) -> None:
    """jobs_total bounds the threads and connections one deployment uses."""
    runner = make_runner(Config(jobs_total=2, jobs_per_caller=5))
    fake.block(A)
    live = [submit(runner, "alice", A), submit(runner, "bob", A)]
    with pytest.raises(BusyError) as info:
        runner.submit("carol", "web", [{"url": A}])
    assert (info.value.live, info.value.limit, info.value.http_status) == (2, 2, 429)
    with pytest.raises(BusyError):
        runner.submit("alice", "web", [{"url": B}])
    fake.release(A)
    for job_id in live:
        finished(runner, job_id)
    finished(runner, submit(runner, "carol", A))


def test_a_reused_submit_passes_full_caps(make_runner: MakeRunner, fake: FakeFetch) -> None:
    """Idempotency comes before caps: a retry of a running job is never refused as busy."""
    runner = make_runner(Config(jobs_total=1))
    fake.block(A)
    job_id = submit(runner, "alice", A)
    assert runner.submit("alice", "web", [{"url": A}]) == (job_id, True)
    with pytest.raises(CallerBusyError):
        runner.submit("alice", "web", [{"url": B}])
    with pytest.raises(BusyError):
        runner.submit("bob", "web", [{"url": A}])


def test_a_reused_submit_passes_the_target_cap(make_runner: MakeRunner, fake: FakeFetch) -> None:
    """A job made under a larger limit is still returned after the limit was lowered."""
    job_id = submit(make_runner(), "alice", A, B, C)
    strict = make_runner(Config(targets_per_job=2))
    finished(strict, job_id)
    assert strict.submit("alice", "web", [{"url": u} for u in (A, B, C)]) == (job_id, True)
    with pytest.raises(TooManyTargetsError):
        strict.submit("alice", "web", [{"url": u} for u in (C, B, A)])


def test_live_is_by_status_not_lease(runner: Runner, fake: FakeFetch, clock: Clock) -> None:
    """A running job is never hidden, purged or uncounted, however long its fetch takes."""
    fake.block(A)
    job_id = submit(runner, "alice", A)
    clock.advance(seconds=TTL.total_seconds() * 2)
    assert found(runner, job_id)[0].status == "running"
    with pytest.raises(CallerBusyError):
        runner.submit("alice", "web", [{"url": B}])
    assert runner.db.purge_expired(now=clock()) == 0
    assert runner.cancel(job_id)  # a live job is still controllable
    fake.release(A)
    job = finished(runner, job_id)
    assert job.status == "cancelled"
    assert job.expires_at == clock() + TTL


# -- submit validation ----------------------------------------------------------------------


INVALID_SUBMISSIONS: list[tuple[Any, Any, Any, str | None]] = [
    # (caller, caller_class, targets, the field the error names)
    ("alice", "web", [], None),
    ("alice", "web", "https://example.com/a", None),
    ("alice", "web", [{"url": A}, {"url": A}], None),
    ("alice", "web", [{"url": A}, {"url": ""}], "url"),
    ("alice", "web", [{"url": A, "options": {"context": "yes"}}], "options.context"),
    ("", "web", [{"url": A}], "caller"),
    (None, "web", [{"url": A}], "caller"),
    ("x" * 192, "web", [{"url": A}], "caller"),
    ("al\x00ice", "web", [{"url": A}], "caller"),
    ("al\ud800ice", "web", [{"url": A}], "caller"),
    ("alice", "", [{"url": A}], "caller_class"),
    ("alice", 7, [{"url": A}], "caller_class"),
]


def test_invalid_submissions_create_nothing(runner: Runner, fake: FakeFetch) -> None:
    """A 422 must leave no half-made job behind and fetch nothing."""
    for caller, caller_class, targets, field in INVALID_SUBMISSIONS:
        with pytest.raises(InvalidTargetsError) as info:
            runner.submit(caller, caller_class, targets)
        assert info.value.http_status == 422
        assert info.value.field == field, (caller, caller_class, targets)
    assert runner.jobs() == []
    assert fake.count() == 0


def test_the_longest_unicode_caller_is_stored(runner: Runner) -> None:
    """191 four-byte characters fit the key columns on every backend (utf8mb4 on MySQL)."""
    caller, caller_class = "😀" * 191, "é" * 191
    job_id, _ = runner.submit(caller, caller_class, [{"url": "https://exämple.com/😀"}])
    job = finished(runner, job_id)
    assert (job.caller, job.caller_class, job.status) == (caller, caller_class, "done")
    assert runner.submit(caller, caller_class, [{"url": "https://exämple.com/😀"}]) == (
        job_id,
        True,
    )


def test_distinct_callers_have_their_own_caps(runner: Runner, fake: FakeFetch) -> None:
    """Callers are compared exactly, as in Python: case, accents and emoji all count."""
    fake.block(A)
    for caller in ["Alice", "alice", "résumé", "resume", "😀", "🙂"]:
        job_id, reused = runner.submit(caller, "web", [{"url": A}])
        assert not reused, caller
        assert found(runner, job_id)[0].caller == caller


def test_a_trailing_space_makes_another_caller(runner: Runner, fake: FakeFetch) -> None:
    """A caller named "bob " is not "bob": caps and lock rows must not merge them."""
    fake.block(A)
    submit(runner, "bob", A)
    job_id, reused = runner.submit("bob ", "web", [{"url": A}])
    assert not reused
    assert found(runner, job_id)[0].caller == "bob "


def test_options_at_their_size_limit_are_stored(runner: Runner) -> None:
    """Options that pass validation must fit the store on every backend (MySQL TEXT: 64 KiB)."""
    most = "😀" * MAX_OPTION_LENGTH  # 4 UTF-8 bytes each; 12 when JSON-escaped
    opts = Options(mode=most, question=most, pages=most, grep=most, jq=most, context=True)
    job_id, _ = runner.submit("alice", "web", [Target(A, opts)])
    finished(runner, job_id)
    assert found(runner, job_id)[1][0].options == opts


# -- cancel ---------------------------------------------------------------------------------


def test_cancel_stores_the_in_flight_target_and_leaves_later_ones_pending(
    runner: Runner, fake: FakeFetch, clock: Clock
) -> None:
    """Cancel never throws away a fetch already paid for, and starts no new one."""
    fake.block(A)
    job_id = submit(runner, "alice", A, B, C)
    fake.wait_entered(A)
    assert statuses(runner, job_id) == ["running", "pending", "pending"]
    clock.advance(minutes=5)
    assert runner.cancel(job_id) is True
    job, targets = found(runner, job_id)
    assert job.status == "cancelled"
    assert job.expires_at == clock() + TTL  # a status change bumps the lease
    assert [t.status for t in targets] == ["pending"] * 3  # nothing is running any more
    with pytest.raises(TimeoutError):
        runner.wait(job_id, timeout=0.05)  # the in-flight target is not stored yet
    assert runner.cancel(job_id) is False  # cancel again
    fake.release(A)
    job = finished(runner, job_id)
    assert (job.status, job.targets_done) == ("cancelled", 1)
    _, targets = found(runner, job_id)
    assert [t.status for t in targets] == ["done", "pending", "pending"]
    assert targets[0].result == Result(f"content of {A}", {"url": A})
    assert fake.calls == [A]
    assert runner.cancel(job_id) is False
    assert_drain_ends(job_id)


def test_cancel_from_inside_a_fetch_stops_before_the_next_target(
    runner: Runner, fake: FakeFetch
) -> None:
    """A cancel landing between a fetch and its write still stores that target."""
    box: dict[str, str] = {}
    submitted = threading.Event()

    def cancel_then_return(target: Target) -> Result:
        assert submitted.wait(WAIT)
        assert runner.cancel(box["id"])
        return Result("kept")

    fake.behave(A, cancel_then_return)
    box["id"] = submit(runner, "alice", A, B)
    submitted.set()
    assert finished(runner, box["id"]).status == "cancelled"
    assert statuses(runner, box["id"]) == ["done", "pending"]
    assert fake.calls == [A]


def test_cancel_of_a_finished_job_is_false(runner: Runner, fake: FakeFetch) -> None:
    """Terminal is final: done, failed and partial jobs cannot be cancelled."""
    fake.behave(B, _boom)
    ids = [submit(runner, "alice", A), submit(runner, "bob", B), submit(runner, "carol", A, B)]
    for job_id, status in zip(ids, ["done", "failed", "partial"]):
        assert finished(runner, job_id).status == status
        assert runner.cancel(job_id) is False
        assert found(runner, job_id)[0].status == status


def test_cancel_from_a_second_runner_stops_the_drain(
    runner: Runner, second_runner: Runner, fake: FakeFetch
) -> None:
    """With several processes, a cancel reaches the job whichever process serves it."""
    fake.block(A)
    job_id = submit(runner, "alice", A, B, C)
    fake.wait_entered(A)
    assert second_runner.cancel(job_id) is True
    assert found(runner, job_id)[0].status == "cancelled"
    with pytest.raises(TimeoutError):
        second_runner.wait(job_id, timeout=0.05)  # the drain has not stopped yet
    assert second_runner.cancel(job_id) is False
    fake.release(A)
    job = second_runner.wait(job_id, timeout=WAIT)
    assert job is not None
    assert (job.status, job.targets_done) == ("cancelled", 1)
    assert job.finished_at is not None
    assert statuses(second_runner, job_id) == ["done", "pending", "pending"]
    finished(runner, job_id)
    assert fake.calls == [A]
    assert_drain_ends(job_id)


# -- bad ids --------------------------------------------------------------------------------

BAD_IDS: list[Any] = [
    None,
    123,
    "",
    "x" * 1000,
    "'; DROP TABLE batch_job; --",
    "\x00",
    "\ud800",
    b"abc",
    "%",
    " ",
    "ä" * 10,
    ["id"],
]


def test_bad_ids_are_unknown_and_never_raise(runner: Runner) -> None:
    """Ids come from URLs: garbage must read as "not found", never as a 500."""
    job_id = submit(runner, "alice", A)
    finished(runner, job_id)
    for bad in [*BAD_IDS, batch.new_job_id()]:
        assert runner.status(bad) is None, bad
        assert runner.cancel(bad) is False, bad
        assert runner.wait(bad, timeout=1) is None, bad
    assert found(runner, job_id)[0].status == "done"  # the table survived, too


def test_job_ids_are_matched_exactly(runner: Runner) -> None:
    """An id that differs only in case names no job, on every backend."""
    job_id = submit(runner, "alice", A)
    finished(runner, job_id)
    assert runner.status(job_id.upper()) is None
    assert runner.wait(job_id.upper(), timeout=1) is None
    assert runner.cancel(job_id.upper()) is False


def test_a_job_id_with_a_trailing_space_names_no_job(runner: Runner, fake: FakeFetch) -> None:
    """An id with a stray trailing space (a sloppy URL) must not find or cancel the job."""
    fake.block(A)
    job_id = submit(runner, "alice", A)
    assert runner.status(job_id + " ") is None
    assert runner.cancel(job_id + " ") is False
    assert found(runner, job_id)[0].status == "running"


# -- racing submits -------------------------------------------------------------------------


def test_identical_submits_racing_from_16_threads_make_one_job(
    runner: Runner, fake: FakeFetch
) -> None:
    """A double-clicked button or a retry storm still creates exactly one job."""
    results = race(16, lambda i: runner.submit("alice", "web", [{"url": A}, {"url": B}]))
    assert all(kind == "ok" for kind, _ in results), results
    ids = {value[0] for _, value in results}
    assert len(ids) == 1
    assert sorted(value[1] for _, value in results) == [False] + [True] * 15
    finished(runner, ids.pop())
    assert fake.calls == [A, B]


def test_a_reused_submit_never_starts_a_second_drain_of_a_job_that_just_ended(
    db: dcache.DB, clock: Clock, fake: FakeFetch
) -> None:
    """The first submit's drain starts, runs and ends before that submit marks its job
    resolved; an identical submit that got the job back while it still ran adopts it
    only then. It found the job unresolved and drained it again: target 0 fetched twice,
    two JobFinished. Both moments are held open here, not left to thread switches."""
    adopting, ended = threading.Event(), threading.Event()
    second: list[Any] = []

    class Paused(Runner):
        def _adopt(self, row: Any) -> None:
            if threading.current_thread().name == "second":
                adopting.set()
                assert ended.wait(WAIT)  # the first drain has ended meanwhile
            super()._adopt(row)

        def _launch(self, drain: Any) -> None:
            if threading.current_thread().name == "second":
                return super()._launch(drain)
            worker = threading.Thread(
                target=lambda: second.append(self.submit("alice", "web", [{"url": A}])),
                name="second",
            )
            worker.start()
            assert adopting.wait(WAIT)  # its submit got the running job back
            super()._launch(drain)
            assert drain.thread is not None
            drain.thread.join(WAIT)  # the first drain ran to the end
            ended.set()
            worker.join(WAIT)

    finishes: list[Any] = []
    runner = Paused(db, fake, clock=clock)
    ended_events = batch.events.JobFinished
    runner.subscribe(lambda e: finishes.append(e) if isinstance(e, ended_events) else None)
    try:
        job_id, reused = runner.submit("alice", "web", [{"url": A}])
        assert not reused and second == [(job_id, True)]
        finished(runner, job_id)
        wait_for(lambda: bool(finishes), "the job's end event")
        threading.Event().wait(0.2)  # a second drain, were one started, would fetch by now
        assert fake.calls == [A]
        assert [e.job_id for e in finishes] == [job_id]
    finally:
        runner.close(timeout=WAIT)


def test_racing_submits_never_exceed_jobs_total(make_runner: MakeRunner, fake: FakeFetch) -> None:
    """The global cap holds under a race: the database lock decides, not luck."""
    runner = make_runner(Config(jobs_total=3))
    fake.block(A)
    results = race(16, lambda i: runner.submit(f"caller-{i}", "web", [{"url": A}]))
    created = [value[0] for kind, value in results if kind == "ok"]
    refused = [value for kind, value in results if kind == "err"]
    assert len(created) == 3
    assert all(isinstance(e, BusyError) and (e.live, e.limit) == (3, 3) for e in refused), refused
    assert runner.db.live_batch_jobs_total() == 3
    fake.release(A)
    for job_id in created:
        finished(runner, job_id)


def test_racing_submits_never_exceed_jobs_per_caller(
    make_runner: MakeRunner, fake: FakeFetch
) -> None:
    """The per-caller cap holds when one caller fires many different jobs at once."""
    runner = make_runner(Config(jobs_per_caller=2))
    urls = [f"https://example.com/{i}" for i in range(16)]
    fake.block(*urls)
    results = race(16, lambda i: runner.submit("alice", "web", [{"url": urls[i]}]))
    created = [value[0] for kind, value in results if kind == "ok"]
    refused = [value for kind, value in results if kind == "err"]
    assert len(created) == 2
    assert all(isinstance(e, CallerBusyError) and e.limit == 2 for e in refused), refused
    assert runner.db.live_batch_jobs("alice") == 2
    fake.release_all()
    for job_id in created:
        finished(runner, job_id)


# -- wait -----------------------------------------------------------------------------------


def test_wait_returns_the_finished_job(runner: Runner) -> None:
    """A script blocks on wait and gets the final job, with when it finished."""
    job_id = submit(runner, "alice", A, B)
    got: list[Job | None] = []
    waiter = threading.Thread(target=lambda: got.append(runner.wait(job_id)))  # no timeout
    waiter.start()
    waiter.join(WAIT)
    assert not waiter.is_alive(), "wait() without a timeout never returned"
    [job] = got
    assert job is not None
    assert (job.id, job.status, job.targets_done, job.terminal) == (job_id, "done", 2, True)
    assert job.finished_at is not None
    assert job.created_at is not None and job.finished_at >= job.created_at
    assert runner.wait(job_id, timeout=0) == job  # already finished: no waiting


def test_wait_answers_the_job_its_drain_ended_without_reading_it(
    runner: Runner, fake: FakeFetch
) -> None:
    """The drain's last write answers the job as it ended: a wait for a job drained here
    returns it, equal to a read, and the waiting thread runs no statement of its own."""
    fake.block(B)
    job_id = submit(runner, "alice", A, B)
    fake.wait_entered(B)
    waiter = threading.get_ident()
    ran: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == waiter:
            ran.append(statement)

    event.listen(runner.db.engine, "before_cursor_execute", seen)
    try:
        threading.Timer(0.05, fake.release, args=(B,)).start()
        job = runner.wait(job_id, timeout=WAIT)
        assert ran == []
        # The listener sees the reads this thread makes (the check above is not vacuous).
        assert job == runner.job(job_id)
        assert ran, "a read on this thread ran no statement the listener saw"
    finally:
        event.remove(runner.db.engine, "before_cursor_execute", seen)
    assert job is not None
    assert (job.status, job.targets_done, job.terminal) == ("done", 2, True)


def test_wait_times_out_while_a_fetch_blocks(runner: Runner, fake: FakeFetch) -> None:
    """A web handler can bound its wait and answer "still running"."""
    fake.block(A)
    job_id = submit(runner, "alice", A)
    fake.wait_entered(A)
    with pytest.raises(TimeoutError):
        runner.wait(job_id, timeout=0.05)
    with pytest.raises(TimeoutError):
        runner.wait(job_id, timeout=0)
    fake.release(A)
    assert finished(runner, job_id).status == "done"


def test_wait_for_an_unknown_or_lapsed_id_is_none(runner: Runner, clock: Clock) -> None:
    """There is nothing to wait for: answer at once instead of blocking forever."""
    assert runner.wait(batch.new_job_id(), timeout=1) is None
    job_id = submit(runner, "alice", A)
    finished(runner, job_id)
    clock.advance(seconds=TTL.total_seconds() + 1)
    assert runner.wait(job_id, timeout=1) is None


def test_wait_from_a_second_runner_returns_after_the_job_ends(
    runner: Runner, second_runner: Runner, fake: FakeFetch
) -> None:
    """A process that does not drain the job can still wait for it."""
    fake.block(B)
    job_id = submit(runner, "alice", A, B)
    fake.wait_entered(B)
    with pytest.raises(TimeoutError):
        second_runner.wait(job_id, timeout=0.05)
    fake.release(B)
    job = second_runner.wait(job_id, timeout=WAIT)
    assert job is not None
    assert (job.status, job.targets_done) == ("done", 2)
    assert job.finished_at is not None


def test_wait_for_a_job_drained_elsewhere_polls_at_least_every_quarter_second(
    runner: Runner, second_runner: Runner, fake: FakeFetch
) -> None:
    """The docs promise an answer within 0.25 s of the end of a job another process
    drains: the backoff of wait()'s polls stops growing there (it reached 0.5 s)."""
    fake.block(B)
    job_id = submit(runner, "alice", A, B)
    fake.wait_entered(B)
    polls: list[float] = []
    read = second_runner.job

    def job(jid: str) -> Any:
        polls.append(time.monotonic())
        return read(jid)

    second_runner.job = job  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        second_runner.wait(job_id, timeout=2.5)
    fake.release(B)
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    assert len(gaps) >= 8, gaps
    # The last gaps are the capped ones; a little over the cap is the machine's latency.
    assert max(gaps) < 0.4, gaps
    assert max(gaps) > 0.2, gaps  # it does back off


# -- close ----------------------------------------------------------------------------------


def test_submit_after_close_is_refused(runner: Runner) -> None:
    """A shutting-down app must not accept work it will never drain."""
    job_id = submit(runner, "alice", A)
    runner.close()
    runner.close()  # idempotent
    with pytest.raises(RunnerClosedError) as info:
        runner.submit("bob", "web", [{"url": B}])
    assert isinstance(info.value, RuntimeError)
    # Reads still work: the runner does not own the store.
    assert found(runner, job_id)[0].status == "done"
    beat = f"batch-heartbeat-{runner.owner[:8]}"
    assert not any(t.name == beat for t in threading.enumerate())  # close() stopped it


def test_runner_is_a_context_manager(db: dcache.DB, clock: Clock, fake: FakeFetch) -> None:
    """`with Runner(...)` closes it, after the jobs inside have finished."""
    fake.block(A)

    def release_once_started() -> None:
        fake.wait_entered(A)
        fake.release(A)

    releaser = threading.Thread(target=release_once_started)
    releaser.start()
    with Runner(db, fake, clock=clock) as runner:
        job_id = submit(runner, "alice", A, B)
    releaser.join(WAIT)
    assert found(runner, job_id)[0].status == "done"
    with pytest.raises(RunnerClosedError):
        runner.submit("bob", "web", [{"url": B}])


def test_close_with_timeout_fails_a_blocked_job_after_storing_its_target(
    runner: Runner, fake: FakeFetch
) -> None:
    """Shutdown keeps the fetch in flight, then fails the rest with "shutdown"."""
    fake.block(A)
    job_id = submit(runner, "alice", A, B, C)
    fake.wait_entered(A)
    # Private, but the one signal that close() has asked this drain to stop.
    stop = runner._drains[job_id].stop

    def release_when_asked() -> None:
        if stop.wait(WAIT):
            fake.release(A)

    releaser = threading.Thread(target=release_when_asked)
    releaser.start()
    runner.close(timeout=0.1)
    releaser.join(WAIT)
    job, targets = found(runner, job_id)
    assert (job.status, job.error) == ("failed", "shutdown")
    assert job.finished_at is not None
    assert [t.status for t in targets] == ["done", "pending", "pending"]
    assert fake.calls == [A]
    assert_drain_ends(job_id)


def test_close_gives_up_on_a_fetch_that_ignores_shutdown(clock: Clock, fake: FakeFetch) -> None:
    """A hung fetch cannot block shutdown forever; its late result is still kept.

    Runner logic only, and it costs close()'s one-second grace: one backend suffices.
    """
    store = dcache.DB.memory()
    runner = Runner(store, fake, clock=clock)
    try:
        fake.block(A)
        job_id = submit(runner, "alice", A, B)
        fake.wait_entered(A)
        runner.close(timeout=0.05)  # returns after its grace period, the fetch still held
        job, _ = found(runner, job_id)
        assert (job.status, job.error) == ("failed", "shutdown")
        assert job.finished_at is not None
        fake.release(A)
        join_threads([f"batch-job-{job_id}"])
        job2, targets = found(runner, job_id)
        assert (job2.status, job2.error) == ("failed", "shutdown")
        assert job2.finished_at == job.finished_at
        assert [t.status for t in targets] == ["done", "pending"]
        assert fake.calls == [A]
    finally:
        fake.release_all()
        runner.close(timeout=WAIT)
        store.close()


def test_a_drain_that_outlives_its_closed_store_says_so_once_without_alarm(
    tmp_path: Path, clock: Clock, fake: FakeFetch, caplog: pytest.LogCaptureFixture
) -> None:
    """A script's ``runner.close(timeout)`` then ``db.close()`` with a fetch still held:
    the late result cannot be stored. One warning says why; no "result refused by the
    store" retry as failed, no CRITICAL (the job already ended "shutdown")."""
    store = dcache.DB.open(f"sqlite:///{tmp_path / 'late.sqlite3'}")
    log = logging.getLogger("tests.batch.late")
    runner = Runner(store, fake, log=log, clock=clock)
    try:
        fake.block(A)
        job_id = submit(runner, "alice", A, B)
        fake.wait_entered(A)
        runner.close(timeout=0.05)
        store.close()
        caplog.clear()  # close() said the job did not stop in time: expected
        with caplog.at_level(logging.DEBUG, logger="tests.batch.late"):
            fake.release(A)
            join_threads([f"batch-job-{job_id}"])
        late = [r for r in caplog.records if r.name == "tests.batch.late"]
        assert [r.levelno for r in late] == [logging.WARNING], [r.getMessage() for r in late]
        assert "closed" in late[0].getMessage()
    finally:
        fake.release_all()
    with dcache.DB.open(f"sqlite:///{tmp_path / 'late.sqlite3'}") as again:
        found_ = again.get_job_with_targets(job_id, now=clock())
        assert found_ is not None
        assert (found_[0].status, found_[0].error) == ("failed", "shutdown")
        assert [t.status for t in found_[1]] == ["pending", "pending"]


def test_close_without_timeout_waits_for_jobs_to_finish(runner: Runner, fake: FakeFetch) -> None:
    """A script's final close() must not cut its own jobs short."""
    fake.block(A)
    job_id = submit(runner, "alice", A, B)
    fake.wait_entered(A)
    closer = threading.Thread(target=runner.close)
    closer.start()
    wait_for(lambda: closed(runner), "close() to begin")
    assert closer.is_alive()  # held by the job, whose fetch is still blocked
    fake.release(A)
    closer.join(WAIT)
    assert not closer.is_alive()
    job, targets = found(runner, job_id)
    assert (job.status, job.error) == ("done", "")
    assert [t.status for t in targets] == ["done", "done"]
    assert_drain_ends(job_id)


# -- leases ---------------------------------------------------------------------------------


def test_every_write_moves_the_lease(
    make_runner: MakeRunner, fake: FakeFetch, clock: Clock
) -> None:
    """A long job stays readable: each stored target extends it by the TTL."""
    ttl = dt.timedelta(hours=1)
    runner = make_runner(Config(ttl=3600))
    urls = [f"https://example.com/{i}" for i in range(3)]
    seen: list[tuple[dt.datetime, Job]] = []

    def observe(target: Target) -> Result:
        jobs = runner.jobs(caller="alice")
        seen.append((clock(), jobs[0]))
        clock.advance(minutes=7)  # the write of this target happens 7 minutes later
        return Result("x")

    for url in urls:
        fake.behave(url, observe)
    start = clock()
    job_id = submit(runner, "alice", *urls)
    job = finished(runner, job_id)
    assert seen[0][1].expires_at == start + ttl  # set by the submit
    for now, observed in seen[1:]:
        assert observed.expires_at == now + ttl  # set by the previous target's write
        assert observed.updated_at == now
    assert job.expires_at == clock() + ttl
    assert clock() == start + dt.timedelta(minutes=21)


def test_a_finished_job_is_readable_until_its_lease_lapses(runner: Runner, clock: Clock) -> None:
    """Results stay for exactly one TTL after the last write, then are gone."""
    job_id = submit(runner, "alice", A)
    job = finished(runner, job_id)
    assert job.expires_at is not None and job.finished_at is not None
    assert job.expires_at == job.finished_at + TTL
    clock.now = job.expires_at - dt.timedelta(microseconds=1)
    assert found(runner, job_id)[0].status == "done"
    clock.now = job.expires_at
    assert runner.status(job_id) is None
    assert runner.cancel(job_id) is False


# -- big and odd results --------------------------------------------------------------------


def test_an_8_mib_unicode_result_round_trips(runner: Runner, fake: FakeFetch) -> None:
    """Fetched pages are megabytes of any script; every backend must hold them intact."""
    unit = "Grüße, 世界! 😀 ∑ naïve — \n"
    limit = runner.config.max_result_bytes
    unit_bytes = len(json.dumps(unit, ensure_ascii=False).encode("utf-8")) - 2  # as stored
    content = unit * ((limit - 4096) // unit_bytes)
    meta = {"title": "😀 ünïcode", "chars": len(content)}
    stored = json.dumps(Result(content, meta).to_json(), ensure_ascii=False).encode("utf-8")
    assert 8 * 1024 * 1024 - 8192 < len(stored) <= limit
    fake.behave(A, lambda t: Result(content, meta))
    job_id = submit(runner, "alice", A)
    assert finished(runner, job_id).status == "done"
    result = found(runner, job_id)[1][0].result
    assert result is not None
    assert result.meta == meta
    assert result.content == content


def test_result_text_with_nul_and_astral_characters_round_trips(
    runner: Runner, fake: FakeFetch
) -> None:
    """Binary-ish pages (NUL) and emoji are valid text results on every backend."""
    content = "a\x00b \U0001f600 \U0010ffff \t\r\n end"
    meta = {"k\x00": "v\x00", "emoji": "🙂"}
    fake.behave(A, lambda t: Result(content, meta))
    job_id = submit(runner, "alice", A)
    assert finished(runner, job_id).status == "done"
    assert found(runner, job_id)[1][0].result == Result(content, meta)


# -- restart --------------------------------------------------------------------------------


def test_mark_in_flight_failed_mid_fetch_stops_the_drain_and_resumes_nothing(
    make_runner: MakeRunner, fake: FakeFetch, clock: Clock
) -> None:
    """After a restart, jobs in flight end failed "restart"; what was stored stays."""
    runner = make_runner()
    fake.block(B)
    job_id = submit(runner, "alice", A, B, C)
    fake.wait_entered(B)
    assert runner.db.mark_in_flight_failed("restart", now=clock()) == 1
    job, _ = found(runner, job_id)
    assert (job.status, job.error) == ("failed", "restart")
    fake.release(B)
    job = finished(runner, job_id)
    assert (job.status, job.error, job.targets_done) == ("failed", "restart", 2)
    _, targets = found(runner, job_id)
    assert [t.status for t in targets] == ["done", "done", "pending"]
    assert targets[0].result == Result(f"content of {A}", {"url": A})
    make_runner()  # a fresh runner on the same store resumes nothing
    assert runner.db.mark_in_flight_failed("restart", now=clock()) == 0
    assert statuses(runner, job_id) == ["done", "done", "pending"]
    assert fake.calls == [A, B]


# -- purge ----------------------------------------------------------------------------------


def test_purge_deletes_lapsed_jobs_but_never_live_ones(
    runner: Runner, fake: FakeFetch, clock: Clock
) -> None:
    """The store stays bounded without ever losing a job still in flight."""
    old = submit(runner, "alice", A)
    finished(runner, old)
    fake.block(B)
    live = submit(runner, "bob", B)
    start = clock()
    clock.advance(seconds=TTL.total_seconds() + 60)
    assert runner.db.purge_expired(now=clock()) == 1
    assert found(runner, live)[0].status == "running"
    clock.now = start  # rewound: a row that were still stored would be visible again
    assert runner.status(old) is None
    assert found(runner, live)[0].status == "running"
    fake.release(B)
    finished(runner, live)


def test_a_backlog_of_lapsed_jobs_is_purged_at_every_beat_until_it_is_gone(
    db: dcache.DB, make_runner: MakeRunner, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge transaction takes what fits in a few MiB (here: one job each), so one
    purge of 4 transactions per interval could fall behind for good: a purge that found
    more than its time allowed goes on at the next beat instead."""
    import dcache._upkeep

    monkeypatch.setattr(dcache._upkeep, "PURGE_BATCH_BYTES", 1)
    past = clock() - dt.timedelta(days=2)
    failed_jobs(db, 60, past)

    def left() -> int:
        return len(db.list_jobs(now=past, limit=1000))

    assert left() == 60
    make_runner(
        Config(heartbeat=dt.timedelta(seconds=0.02), purge_interval=dt.timedelta(seconds=1))
    )
    # One purge of four one-job transactions a second would take 15 s.
    wait_for(lambda: left() == 0, "the backlog to be purged", timeout=6.0)


def test_the_maintenance_thread_purges_lapsed_jobs_at_most_once_per_interval(
    make_runner: MakeRunner, clock: Clock
) -> None:
    """A store that only ever receives submits stays bounded, at a bounded cost, off-request."""
    beat = dt.timedelta(seconds=0.02)
    lazy = make_runner(Config(heartbeat=beat))  # purge_interval: 60 s of real time
    old = submit(lazy, "alice", A)
    finished(lazy, old)
    start = clock()
    clock.advance(seconds=TTL.total_seconds() + 60)
    later = clock()
    threading.Event().wait(0.2)  # ten beats: none of them is due to purge
    clock.now = start
    assert found(lazy, old)[0].status == "done"  # still stored
    clock.now = later
    eager = make_runner(Config(heartbeat=beat, purge_interval=dt.timedelta(microseconds=1)))

    def purged() -> bool:
        clock_then = clock.now
        clock.now = start
        try:
            return eager.status(old) is None
        finally:
            clock.now = clock_then

    wait_for(purged, "the eager runner's maintenance thread to purge the lapsed job")
