"""Fuzzing: a stateful model of the runner's rules, and properties of the canonical form.

``RunnerMachine`` (a hypothesis ``RuleBasedStateMachine``) drives a real ``batch.Runner``
through submit, cancel, status, wait, purge, fetch outcomes and the passage of time (an
injected clock), on in-memory SQLite and on PostgreSQL, against a small model of the
rules; after every step it checks the invariants: never more live jobs than the caps,
idempotent reuse within the lease, terminal statuses that match the target outcomes,
``targets_done`` equal to the stored targets, lapsed jobs invisible, no target fetched
twice. Every fetch blocks until the machine decides its outcome, so the machine always
knows what each drain is doing; it never sleeps.

The property tests pin the canonical form behind idempotency keys (any key order, white
space or default-valued option gives the same key; any real difference a different one)
and ``Target.from_json`` / ``normalize_targets`` (any JSON value parses or raises
``InvalidTargetsError``, nothing else).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import Clock, backend_url, wipe
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import batch
import dcache
from batch import InvalidTargetsError, Options, Target
from batch._runner import result_json, result_of_json
from batch._values import decode_options, encode_options

WAIT = 10.0  # the most a drain may take to reach its next fetch or end
UTC = dt.timezone.utc
T0 = dt.datetime(2030, 1, 1, tzinfo=UTC)
TTL = dt.timedelta(minutes=10)
CONFIG = batch.Config(
    ttl=TTL,
    targets_per_job=3,
    jobs_per_caller=2,
    jobs_total=3,
    heartbeat=dt.timedelta(days=1),  # the heartbeat thread never wakes during a run
    purge_interval=dt.timedelta(days=1),  # the runner never purges; the machine does
)
CALLERS = ("alice", "bob", "carol")
URLS = tuple(f"https://fuzz.example/{c}" for c in "abcde")
OUTCOMES = ("ok", "fetch_error", "crash", "bad_type", "exit")
TERMINAL = ("done", "failed", "partial", "cancelled")


# -- the controlled fetch -------------------------------------------------------------------


def job_of_thread() -> str:
    return threading.current_thread().name.removeprefix("batch-job-")


class Gate:
    """A fetch that blocks until the machine names its outcome; counts every call."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.entered: dict[str, str] = {}  # job id -> URL of the fetch it is held in
        self.outcomes: dict[str, str] = {}  # job id -> outcome for its held fetch
        self.calls: Counter[tuple[str, str]] = Counter()
        self.closed = False

    def __call__(self, target: Target) -> batch.Result:
        job_id = job_of_thread()
        with self.cond:
            self.calls[(job_id, target.url)] += 1
            self.entered[job_id] = target.url
            self.cond.notify_all()
            self.cond.wait_for(lambda: job_id in self.outcomes or self.closed, WAIT)
            outcome = self.outcomes.pop(job_id, "ok")
            self.entered.pop(job_id, None)
        return produce(outcome, job_id, target.url)  # type: ignore[return-value]

    def wait_entered(self, job_id: str, url: str) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.entered.get(job_id) == url, WAIT)

    def release(self, job_id: str, outcome: str) -> None:
        with self.cond:
            self.outcomes[job_id] = outcome
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def produce(outcome: str, job_id: str, url: str) -> object:
    """What the fetch does for each outcome the machine can choose."""
    if outcome == "ok":
        return batch.Result(f"{job_id} {url} \N{SNOWMAN}", {"url": url})
    if outcome == "fetch_error":
        raise batch.FetchError(f"no {url}", hint="try later")
    if outcome == "crash":
        raise RuntimeError(f"boom {url}")
    if outcome == "exit":
        raise SystemExit(3)
    return "not a result"  # bad_type


def expected_write(outcome: str, job_id: str, url: str) -> tuple[str, str | None, str, str]:
    """(status, content, error, hint) the runner must store for an outcome."""
    if outcome == "ok":
        return "done", f"{job_id} {url} \N{SNOWMAN}", "", ""
    return {
        "fetch_error": ("failed", None, f"no {url}", "try later"),
        "crash": ("failed", None, f"RuntimeError: boom {url}", ""),
        "exit": ("failed", None, "SystemExit: 3", ""),
        "bad_type": ("failed", None, "TypeError: fetch returned str, not batch.Result", ""),
    }[outcome]


# -- the model --------------------------------------------------------------------------------


@attrs.define
class MJob:
    """The model of one job."""

    id: str
    caller: str
    key: tuple[tuple[str, str], ...]  # the targets as (url, mode): what idempotency compares
    created: dt.datetime
    expires: dt.datetime
    status: str = "running"
    written: list[tuple[str, str | None, str, str]] = attrs.Factory(list)
    in_flight: int | None = 0  # index of the target whose fetch is held; None: drain ended
    purged: bool = False

    @property
    def urls(self) -> list[str]:
        return [u for u, _ in self.key]

    @property
    def live(self) -> bool:
        return self.status == "running"


def terminal_for(written: list[tuple[str, str | None, str, str]]) -> str:
    statuses = {w[0] for w in written}
    if statuses == {"done"}:
        return "done"
    if statuses == {"failed"}:
        return "failed"
    return "partial"


def as_submitted(key: tuple[tuple[str, str], ...], forms: list[int]) -> list[Any]:
    """The targets in one of several equivalent spellings (objects, dicts, defaults spelt out)."""
    out: list[Any] = []
    for (url, mode), form in zip(key, forms):
        if form == 0:
            out.append(Target(url, Options(mode=mode)))
        elif form == 1:
            out.append({"url": url, "options": {"mode": mode}} if mode else {"url": url})
        else:  # key order reversed, default-valued options spelt out
            out.append({"options": {"recover": False, "mode": mode, "grep": ""}, "url": url})
    return out


class RunnerMachine(RuleBasedStateMachine):
    """A real Runner against a model of the rules; see the module docstring."""

    open_db: Callable[[], dcache.DB] = staticmethod(dcache.DB.memory)  # type: ignore[assignment]
    close_db: Callable[[dcache.DB], None] = staticmethod(lambda db: db.close())  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.db = self.open_db()
        self.clock = Clock(T0)
        self.gate = Gate()
        self.runner = batch.Runner(self.db, self.gate, CONFIG, clock=self.clock)
        self.jobs: list[MJob] = []

    def teardown(self) -> None:
        self.gate.close()
        try:
            self.runner.close(timeout=WAIT)
        finally:
            self.close_db(self.db)

    # -- model helpers --------------------------------------------------------------------

    @property
    def now(self) -> dt.datetime:
        return self.clock.now

    def visible(self, job: MJob) -> bool:
        return not job.purged and (job.live or job.expires > self.now)

    def live(self, caller: str | None = None) -> int:
        return sum(j.live for j in self.jobs if caller is None or j.caller == caller)

    def pick(self, data: st.DataObject, jobs: list[MJob]) -> MJob:
        return jobs[data.draw(st.integers(0, len(jobs) - 1), label="job")]

    def held(self) -> list[MJob]:
        return [j for j in self.jobs if j.in_flight is not None]

    # -- rules ----------------------------------------------------------------------------

    @rule(
        caller=st.sampled_from(CALLERS),
        key=st.lists(
            st.tuples(st.sampled_from(URLS), st.sampled_from(("", "text"))),
            min_size=1,
            max_size=4,
            unique_by=lambda t: t[0],
        ).map(tuple),
        forms=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    )
    def submit(self, caller: str, key: tuple[tuple[str, str], ...], forms: list[int]) -> None:
        same = [j for j in self.jobs if j.caller == caller and j.key == key and self.visible(j)]
        try:
            job_id, reused = self.runner.submit(caller, "user", as_submitted(key, forms))
        except batch.TooManyTargetsError:
            assert not same and len(key) > CONFIG.targets_per_job
            return
        except batch.CallerBusyError:
            assert not same and len(key) <= CONFIG.targets_per_job
            assert self.live(caller) >= CONFIG.jobs_per_caller
            return
        except batch.BusyError:
            assert not same and self.live(caller) < CONFIG.jobs_per_caller
            assert self.live() >= CONFIG.jobs_total
            return
        if same:
            newest = max(same, key=lambda j: j.created)
            assert (job_id, reused) == (newest.id, True)
            return
        assert not reused
        assert len(key) <= CONFIG.targets_per_job
        assert self.live(caller) < CONFIG.jobs_per_caller and self.live() < CONFIG.jobs_total
        job = MJob(job_id, caller, key, created=self.now, expires=self.now + TTL)
        self.jobs.append(job)
        note(f"created {job_id[:6]} for {caller}: {key}")
        assert self.gate.wait_entered(job_id, job.urls[0]), "the drain never started"

    @precondition(lambda self: any(j.in_flight is not None for j in self.jobs))
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def finish_fetch(self, data: st.DataObject, outcome: str) -> None:
        job = self.pick(data, self.held())
        idx = job.in_flight
        assert idx is not None
        url = job.urls[idx]
        note(f"fetch {job.id[:6]}[{idx}] -> {outcome}")
        self.gate.release(job.id, outcome)
        if job.purged:
            job.in_flight = None  # the write finds no job; the drain just ends
        else:
            job.written.append(expected_write(outcome, job.id, url))
            job.expires = self.now + TTL  # every target write moves the lease
            if job.live and len(job.written) < len(job.key):
                job.in_flight = idx + 1
            else:
                if job.live:
                    job.status = terminal_for(job.written)
                job.in_flight = None
        if job.in_flight is not None:
            assert self.gate.wait_entered(job.id, job.urls[job.in_flight]), "drain stalled"
        else:
            self.runner.wait(job.id, timeout=WAIT)  # the drain has ended: nothing in flight

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        job = self.pick(data, self.jobs)
        won = self.runner.cancel(job.id)
        assert won == (job.live and not job.purged), (job.status, won)
        if won:
            job.status = "cancelled"
            job.expires = self.now + TTL

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def status(self, data: st.DataObject) -> None:
        self.check_status(self.pick(data, self.jobs))

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        job = self.pick(data, self.jobs)
        if job.in_flight is not None:
            with pytest.raises(TimeoutError):
                self.runner.wait(job.id, timeout=0.02)
            return
        got = self.runner.wait(job.id, timeout=WAIT)
        if not self.visible(job):
            assert got is None
            return
        assert got is not None
        assert got.status == job.status and got.status in TERMINAL
        assert got.finished_at is not None

    @rule()
    def unknown_ids_are_inert(self) -> None:
        ghost = batch.new_job_id()
        assert self.runner.status(ghost) is None
        assert self.runner.cancel(ghost) is False
        assert self.runner.wait(ghost, timeout=1) is None

    @rule(seconds=st.sampled_from((1, 59, 300, 599, 600, 601, 3600)))
    def time_passes(self, seconds: int) -> None:
        self.clock.advance(seconds=seconds)

    @rule()
    def purge(self) -> None:
        lapsed = [j for j in self.jobs if not j.purged and not self.visible(j)]
        assert self.db.purge_expired(now=self.now) == len(lapsed)
        for j in lapsed:
            j.purged = True

    # -- invariants -------------------------------------------------------------------------

    def check_status(self, job: MJob) -> None:
        found = self.runner.status(job.id)
        if not self.visible(job):
            assert found is None, f"lapsed job {job.id} is visible"
            return
        assert found is not None, f"job {job.id} vanished within its lease"
        got, targets = found
        assert (got.status, got.error, got.caller) == (job.status, "", job.caller)
        assert (got.targets_total, got.targets_done) == (len(job.key), len(job.written))
        # The job's counters agree with its stored targets, and its status with their outcomes.
        stored = [t.status for t in targets if t.status not in ("pending", "running")]
        assert got.targets_done == len(stored)
        assert got.targets_failed == stored.count("failed")
        if got.status in ("done", "failed", "partial"):
            assert len(stored) == got.targets_total
            assert got.status == terminal_for([(s, None, "", "") for s in stored])
        assert (got.finished_at is not None) == (job.in_flight is None)
        assert [t.url for t in targets] == job.urls
        for t in targets:
            if t.idx < len(job.written):
                status, content, error, hint = job.written[t.idx]
                assert (t.status, t.error, t.hint) == (status, error, hint)
                if content is None:
                    assert t.result is None
                else:
                    assert t.result == batch.Result(content, {"url": t.url})
            else:
                running = job.live and t.idx == len(job.written)
                assert t.status == ("running" if running else "pending")
                assert t.result is None

    @invariant()
    def caps_hold_and_match_the_model(self) -> None:
        assert self.db.live_batch_jobs_total() == self.live() <= CONFIG.jobs_total
        live = Counter(j.caller for j in self.runner.jobs(live_only=True))
        for caller in CALLERS:
            assert live[caller] == self.live(caller) <= CONFIG.jobs_per_caller

    @invariant()
    def every_job_reads_as_the_model_says(self) -> None:
        for job in self.jobs:
            self.check_status(job)

    @invariant()
    def no_target_is_fetched_twice_or_out_of_order(self) -> None:
        with self.gate.cond:
            calls = dict(self.gate.calls)
        assert all(n == 1 for n in calls.values()), calls
        for job in self.jobs:
            fetched = [u for u in job.urls if (job.id, u) in calls]
            n = len(job.written) + (job.in_flight is not None)
            if job.purged:
                continue
            assert fetched == job.urls[:n], (job.id, fetched, n)


FUZZ_SETTINGS = settings(
    deadline=None,
    stateful_step_count=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_runner_follows_the_model_on_memory() -> None:
    """Every rule, in any order, with time moving: the runner must behave as the model says."""
    run_state_machine_as_test(RunnerMachine, settings=settings(FUZZ_SETTINGS, max_examples=25))


def test_runner_follows_the_model_on_postgresql(tmp_path: Path) -> None:
    """The same model on PostgreSQL, where row locks and READ COMMITTED decide instead."""
    url = backend_url("postgresql", tmp_path)
    shared = dcache.DB.open(url)

    class OnPostgres(RunnerMachine):
        @staticmethod
        def open_db() -> dcache.DB:  # type: ignore[override]
            wipe(shared)
            return shared

        @staticmethod
        def close_db(db: dcache.DB) -> None:  # type: ignore[override]
            pass

    try:
        run_state_machine_as_test(OnPostgres, settings=settings(FUZZ_SETTINGS, max_examples=10))
    finally:
        shared.close()


# -- the canonical form and idempotency keys -----------------------------------------------

_STR_OPTIONS = ("mode", "question", "pages", "grep", "jq")
_BOOL_OPTIONS = ("context", "recover")

# Text every backend can store: no NUL, no lone surrogate (check_text refuses those).
plain_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
urls = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=30
).filter(lambda u: u.strip() == u)
options = st.builds(
    Options,
    **{name: st.one_of(st.just(""), plain_text) for name in _STR_OPTIONS},
    **{name: st.booleans() for name in _BOOL_OPTIONS},
)
target_lists = st.lists(
    st.builds(Target, urls, options),
    min_size=1,
    max_size=5,
    unique_by=lambda t: batch.canonical([t]),
)


@st.composite
def spelled(draw: st.DrawFn, target: Target) -> object:
    """``target`` in any equivalent spelling: an object, or a dict in any key order with any
    subset of its default-valued options spelt out (or ``"options": {}`` / ``None``)."""
    if draw(st.booleans()):
        return target
    opts = {
        name: getattr(target.options, name)
        for name in (*_STR_OPTIONS, *_BOOL_OPTIONS)
        if getattr(target.options, name) or draw(st.booleans())
    }
    opts = dict(draw(st.permutations(list(opts.items()))))
    items: list[tuple[str, object]] = [("url", target.url)]
    if opts:
        items.append(("options", opts))
    else:
        choice = draw(st.sampled_from(("absent", "empty", "null")))
        if choice != "absent":
            items.append(("options", {} if choice == "empty" else None))
    return dict(draw(st.permutations(items)))


@st.composite
def respelled(draw: st.DrawFn, targets: list[Target]) -> list[object]:
    """A whole list respelt, then sent through JSON text with arbitrary white space."""
    forms = [draw(spelled(t)) for t in targets]
    if any(isinstance(f, Target) for f in forms) or draw(st.booleans()):
        return forms
    indent = draw(st.sampled_from((None, 0, 1, 4, "\t", " \n ")))
    sep = draw(st.sampled_from(((",", ":"), (", ", ": "), (" ,\n", " :  "))))
    text = json.dumps(forms, indent=indent, separators=sep, ensure_ascii=draw(st.booleans()))
    loaded: list[object] = json.loads(text)
    return loaded


callers = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(caller=callers, data=st.data(), targets=target_lists)
def test_any_spelling_of_the_same_targets_gives_the_same_idem_key(
    caller: str, data: st.DataObject, targets: list[Target]
) -> None:
    """Field order, white space and default-valued fields must never split one job in two."""
    again = data.draw(respelled(targets))
    normalized = batch.normalize_targets(again)
    assert normalized == targets
    assert batch.canonical(normalized) == batch.canonical(targets)
    assert batch.idem_key(caller, normalized) == batch.idem_key(caller, targets)


@st.composite
def mutated(draw: st.DrawFn, caller: str, targets: list[Target]) -> tuple[str, list[Target]]:
    """A (caller, targets) pair with one real difference, or sometimes none at all."""
    how = draw(st.sampled_from(("same", "caller", "url", "option", "swap", "drop", "add", "other")))
    out = list(targets)
    if how == "caller":
        return caller + draw(st.sampled_from(("x", " ", "\u0301"))), out
    i = draw(st.integers(0, len(out) - 1))
    if how == "url":
        out[i] = attrs.evolve(out[i], url=out[i].url + draw(st.sampled_from(("/", "é", "a"))))
    elif how == "option":
        name = draw(st.sampled_from((*_STR_OPTIONS, *_BOOL_OPTIONS)))
        value = getattr(out[i].options, name)
        new = (not value) if isinstance(value, bool) else value + draw(st.sampled_from("x é"))
        out[i] = attrs.evolve(out[i], options=attrs.evolve(out[i].options, **{name: new}))
    elif how == "swap" and len(out) > 1:
        j = (i + 1) % len(out)
        out[i], out[j] = out[j], out[i]
    elif how == "drop" and len(out) > 1:
        del out[i]
    elif how == "add":
        out.append(draw(st.builds(Target, urls, options)))
    elif how == "other":
        return draw(callers), draw(target_lists)
    return caller, out


@settings(max_examples=300, deadline=None)
@given(caller=callers, targets=target_lists, data=st.data())
def test_any_real_difference_gives_a_different_idem_key(
    caller: str, targets: list[Target], data: st.DataObject
) -> None:
    """Two different jobs must never be merged by a key collision of the canonical form."""
    other_caller, other = data.draw(mutated(caller, targets))
    if len({batch.canonical([t]) for t in other}) != len(other):
        return  # the mutation made a duplicate: not a valid target list
    same = (caller, targets) == (other_caller, other)
    assert (batch.canonical(targets) == batch.canonical(other)) == (targets == other)
    assert (batch.idem_key(caller, targets) == batch.idem_key(other_caller, other)) == same


PINNED_KEY = "05e504dd84c8a7d8258eff47733d5405e35c70c1ebc1fefd524f55bdb6aeb8e1"


def test_the_canonical_form_is_pinned() -> None:
    """Keys are persisted: a silent change of the canonical form would orphan every stored key."""
    targets = [
        Target("https://exämple.org/ü", Options(mode="text", context=True, grep="")),
        Target("https://example.org/b"),
    ]
    text = (
        '[{"options":{"context":true,"mode":"text"},"url":"https://exämple.org/ü"},'
        '{"url":"https://example.org/b"}]'
    )
    assert batch.canonical(targets) == text
    assert hashlib.sha256(("caller-1\x00" + text).encode("utf-8")).hexdigest() == PINNED_KEY
    assert batch.idem_key("caller-1", targets) == PINNED_KEY


# -- Target.from_json and normalize_targets: parse or InvalidTargetsError, nothing else ------

hostile_text = st.text(
    st.one_of(
        st.characters(),
        st.characters(categories=["Cs"]),
        st.sampled_from(["\x00", " ", "\t", "\u202e", "\ufeff", "\U0001f600"]),
    ),
    max_size=20,
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | hostile_text,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.one_of(hostile_text, st.sampled_from(["url", "options"])), inner, max_size=4
        )
    ),
    max_leaves=12,
)
option_objects = st.dictionaries(
    st.sampled_from([*_STR_OPTIONS, *_BOOL_OPTIONS, "bogus", "Mode", ""]),
    st.one_of(json_values, hostile_text, st.booleans()),
    max_size=4,
)
target_like = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"url": st.one_of(hostile_text, urls, json_values)},
        optional={"options": st.one_of(option_objects, json_values), "extra": json_values},
    ),
)


@settings(max_examples=300, deadline=None)
@given(obj=target_like)
def test_target_from_json_parses_or_raises_invalid_targets_error_only(obj: object) -> None:
    """Whatever JSON a client sends, the answer is a target or a clean 422, never a crash."""
    try:
        target = Target.from_json(obj)
    except InvalidTargetsError as exc:
        assert isinstance(exc, ValueError) and str(exc)
        assert exc.http_status == 422
        return
    # A parsed target is sound: storable text, and it survives its own JSON round trip.
    assert isinstance(target.url, str) and target.url
    encoded = json.dumps(target.to_json(), ensure_ascii=False)
    encoded.encode("utf-8")
    assert "\x00" not in encoded
    assert Target.from_json(json.loads(encoded)) == target


@settings(max_examples=200, deadline=None)
@given(obj=st.one_of(json_values, st.lists(target_like, max_size=5)))
def test_normalize_targets_parses_or_raises_invalid_targets_error_only(obj: object) -> None:
    """The whole submitted list obeys the same rule: a valid list or a 422 naming the fault."""
    try:
        got = batch.normalize_targets(obj)
    except InvalidTargetsError as exc:
        assert str(exc)
        return
    assert got and all(isinstance(t, Target) for t in got)
    assert len({batch.canonical([t]) for t in got}) == len(got)  # no duplicates got through


@settings(max_examples=300, deadline=None)
@given(
    a=st.builds(Target, urls, options),
    b=st.builds(Target, urls, options),
    same_url=st.booleans(),
    spelled=st.sampled_from(("object", "all", "bare")),
    bare_first=st.booleans(),
)
def test_a_duplicate_is_exactly_a_target_of_the_same_canonical_form(
    a: Target, b: Target, same_url: bool, spelled: str, bare_first: bool
) -> None:
    """normalize_targets refuses a later target exactly when its canonical form equals an
    earlier one's, however either is given (objects, JSON with defaults spelled out, or
    the bare ``{"url": ...}`` of a target whose options are all default)."""
    if same_url:
        b = Target(a.url, b.options)
    first: object = {"url": a.url} if bare_first and a.options == Options() else a
    second: object = b
    if spelled == "all":  # every option written out, the defaults too
        second = {"url": b.url, "options": attrs.asdict(b.options)}
    elif spelled == "bare" and b.options == Options():
        second = {"url": b.url}
    same = batch.canonical([a]) == batch.canonical([b])
    try:
        got = batch.normalize_targets([first, second])
    except InvalidTargetsError as exc:
        assert same and exc.index == 1, exc
        return
    assert not same and got == [a, b]


@settings(max_examples=300, deadline=None)
@given(
    content=st.text(
        st.one_of(
            st.characters(),
            st.characters(categories=["Cs"]),  # lone surrogates: refused later, not here
            st.sampled_from(['"', "\\", "\x7f", "\u2028"]),
        )
    ),
    meta=st.one_of(st.just({}), st.dictionaries(plain_text, st.one_of(plain_text, st.integers()))),
)
def test_a_result_is_stored_as_json_dumps_writes_it(content: str, meta: dict[str, Any]) -> None:
    """The drain's shortcut for a result without meta gives json.dumps's text exactly."""
    res = batch.Result(content, meta)
    assert result_json(res) == json.dumps(res.to_json(), ensure_ascii=False, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    content=st.text(
        st.one_of(
            st.characters(),
            st.characters(categories=["Cs"]),
            st.sampled_from(['"', "\\", "}", "\x01", "\u2028"]),
        )
    ),
    meta=st.one_of(st.just({}), st.dictionaries(plain_text, st.one_of(plain_text, st.integers()))),
)
def test_a_stored_result_reads_back_as_it_was_written(content: str, meta: dict[str, Any]) -> None:
    """The status read's decoding gives back the result the drain stored, as json.loads
    and Result.from_json would."""
    res = batch.Result(content, meta)
    text = result_json(res)
    assert result_of_json(text) == batch.Result.from_json(json.loads(text)) == res


def _decoded(decode: Any, text: str) -> object:
    try:
        return decode(text)
    except (ValueError, TypeError, AttributeError, RecursionError):
        return "unreadable"  # what a status read reports for the target


@settings(max_examples=500, deadline=None)
@given(
    text=st.one_of(
        st.text(),
        st.builds(
            lambda body, end: '{"content": "' + body + end,
            st.lists(
                st.one_of(st.characters(), st.sampled_from(['"', "\\", "\\u00e9", '"}', "\x01"]))
            ).map("".join),
            st.sampled_from(['"}', '"} ', '", "meta": {}}', '"}}', "}", ""]),
        ),
    )
)
def test_any_stored_text_reads_as_json_loads_reads_it(text: str) -> None:
    """Whatever text a result column holds (written by an older version, or damaged), the
    status read's decoding and ``Result.from_json(json.loads(text))`` agree: the same
    result, or both unreadable."""
    assert _decoded(result_of_json, text) == _decoded(
        lambda t: batch.Result.from_json(json.loads(t)), text
    )


@settings(max_examples=200, deadline=None)
@given(opts=options)
def test_stored_options_decode_to_the_options_encoded(opts: Options) -> None:
    """What the store keeps of a target's options reads back as the same options."""
    assert decode_options(encode_options(opts)) == opts
