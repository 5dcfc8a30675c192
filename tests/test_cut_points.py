"""Cut points: the connection dies at every statement boundary of every store method.

For every public store method of :class:`dcache.DB` and for the per-target write
(``DB.write_target``, ``Writer.write_target``, and the drain's writes through
``Runner.submit``/``Runner.cancel``), each trial cuts the database away at one statement
and checks the promises after recovery:

- PostgreSQL and MariaDB: the store connects through a :class:`_wireproxy.WireProxy` on
  loopback that understands each wire protocol enough to number statements. A scenario is
  first run uncut to list its statements; then, for each statement ``n``, it is run again
  with the connection reset ``before`` the statement, ``after`` its reply, and (COMMIT
  only) ``commit``: COMMIT reached the server and was carried out, its reply never came.
  The per-target write is also run in a child process that the proxy kills (``os._exit``)
  at those points: a crash with a committed-or-not write.
- SQLite: the scenario runs in a child process (``multiprocessing`` forkserver,
  ``_cut_child.py``) whose ``sqlite3`` connections exit the process before statement
  ``n``, or after it (after COMMIT ran, before the call returns); the parent recovers.

Recovery is what a deployment does: after a process died, ``mark_in_flight_failed``
(SQLite: one process) or a new :class:`batch.Runner` with a short heartbeat whose reaper
fails the dead owner's jobs; after a cut in a live process, that process's own runner
(alive and beating) must bring every job to an end. Then the invariants:

- no job live (``queued``/``running``) without a drain or a live owner: every job the
  trial's runner owns finishes (``finished_at`` set) within ``FINISH`` seconds;
- every stored result intact (byte-exact), nothing fetched twice per (job, idx) across
  the trial (the child's fetches are logged to a file);
- ``targets_done``/``targets_failed`` equal to the stored targets;
- every error that left the library is a ``dcache.StoreError`` (``batch.SubmitError``
  from ``Runner.submit``), never a driver or ``sqlalchemy.exc`` type;
- per method: a store method is all or nothing (its store is exactly as before or exactly
  as after the uncut run; multi-transaction ones row by row), and one that returned
  normally returned what the uncut run returned with its effect committed; a ``cancel``
  that raised either happened or not (cancelled, or the job ran to its end); a ``submit``
  that raised leaves no live job behind, and the same submit again gets a job that
  finishes.

Adding a scenario: ``_cut_scenarios.py`` holds two tables, ``STORE`` (``"DB.<method>"`` ->
a function of the prepared store) and ``RUNNER``; a new store method needs a function and
one entry in ``STORE``. ``test_every_store_method_has_a_cut_scenario`` fails for a public
method of ``DB`` or ``Writer`` with no entry (or an entry naming no method); the only
exclusions are in ``EXCLUDED``, each with its reason.

Where the full product of statements and kinds would be too long, ``MAX_CUTS`` statements
per scenario and backend are sampled (evenly, always with every COMMIT and the first and
last statement); every method and every cut kind is covered on every backend. The number
of cut points covered is printed in the terminal summary. Violations are collected over
all trials and reported together, each as ``backend scenario #n kind [statement]:
invariant: detail``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _cut_child
import pytest
from _cut_scenarios import (
    RUNNER,
    STORE,
    Ctx,
    Env,
    Fetch,
    Snapshot,
    SplitDB,
    content_for,
    prepare,
    read_fetch_log,
    restore,
    snapshot,
)
from _wireproxy import EXIT_CODE, KINDS, Cut, Unit, WireProxy, upstream_of, wire_url
from conftest import SERVER_URLS, backend_url, forkserver, wipe
from sqlalchemy import select

import batch
import dcache
from dcache._schema import jobs, owners, targets

# Public names of DB and Writer that need no scenario, and why.
EXCLUDED = {
    "DB.close": "disposes of the pool: closes sockets, runs no statement",
    "DB.engine": "a property: the engine object, no I/O",
    "DB.writer": "builds a Writer, no I/O (Writer.write_target has the scenario)",
    "DB.memory": "in-process SQLite only: no connection to cut, and it dies with its process",
    "Writer.close": "holds no connection since group commit: nothing to give back",
    "DB.max_result_bytes": "a property read from the server at open (DB.open's scenario)",
}
MAX_CUTS = {"sqlite": 10, "postgresql": 12, "mariadb": 11}  # statements sampled per scenario
KILL_ON_SERVERS = ("DB.write_target", "Writer.write_target", "Runner.submit")
KILL_RUNNER_CUTS = 4  # statements of Runner.submit killed on the servers (slow recovery)
WAIT = 4.0  # how long a runner scenario waits for its job
FINISH = 4.0  # how long after a trial every job may take to end
HEARTBEAT = dt.timedelta(seconds=0.2)
STORE_ERRORS = (dcache.StoreError,)
SUBMIT_ERRORS = (dcache.StoreError, batch.SubmitError)

REPORT: dict[str, Counter[str]] = {}


# -- coverage of the store's surface ------------------------------------------------------


def public_methods(cls: type) -> list[str]:
    """Public callables and properties defined on ``cls`` (not inherited from object)."""
    names = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or hasattr(object, name):
            continue
        if isinstance(inspect.getattr_static(cls, name), property) or callable(member):
            names.append(name)
    return sorted(names)


def test_every_store_method_has_a_cut_scenario() -> None:
    """A store method added later cannot go uncovered by the cut-point trials."""
    surface = [f"DB.{n}" for n in public_methods(dcache.DB)]
    surface += [f"Writer.{n}" for n in public_methods(dcache.Writer)]
    missing = [n for n in surface if n not in STORE and n not in EXCLUDED]
    assert not missing, f"store methods with no cut scenario in _cut_scenarios.STORE: {missing}"
    stale = [n for n in [*STORE, *EXCLUDED] if n not in surface]
    assert not stale, f"cut scenarios or exclusions naming no public method: {stale}"
    runner_methods = public_methods(batch.Runner)
    assert all(n.split(".")[1] in runner_methods for n in RUNNER)


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_the_wire_proxy_cuts_where_it_says(backend: str, tmp_path: Path) -> None:
    """The tool's own word: "commit" commits and hides the reply, "before" never sends."""
    url = backend_url(backend, tmp_path)
    direct = dcache.DB.open(url)
    wipe(direct)
    protocol, host, port = upstream_of(url)
    try:
        with WireProxy(protocol, host, port) as proxy:
            db = dcache.DB.open(wire_url(url, proxy.port))
            proxy.arm()
            db.heartbeat("probe-a")
            units, fired = proxy.disarm()
            db.close()
            assert fired is None
            # The COMMIT of the heartbeat's own transaction (not a session reset's).
            wrote = next(i for i, u in enumerate(units) if "batch_owner" in u.text)
            commit = next(u for u in units[wrote:] if u.commit)
            for owner, kind, stored in (("probe-b", "commit", True), ("probe-c", "before", False)):
                db = dcache.DB.open(wire_url(url, proxy.port))  # the same pool state as above
                proxy.arm(Cut(commit.n, kind))  # type: ignore[arg-type]
                with pytest.raises(Exception):  # noqa: B017 (its type is the trials' check)
                    db.heartbeat(owner)
                _units, fired = proxy.disarm()
                db.close()
                assert fired is not None and fired.commit and fired.n == commit.n
                with direct.engine.connect() as conn:
                    found = conn.execute(select(owners.c.owner).where(owners.c.owner == owner))
                    assert (found.first() is not None) is stored, (owner, kind)
    finally:
        wipe(direct)
        direct.close()


# -- the summary line ---------------------------------------------------------------------


class _Summary:
    """Prints how many cut points were covered, per backend, after the tests."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not REPORT:
            return
        terminalreporter.write_sep("-", "cut points covered")
        for backend, c in sorted(REPORT.items()):
            kinds = ", ".join(f"{k} {c['kind:' + k]}" for k in KINDS)
            terminalreporter.write_line(
                f"{backend}: {c['cut']} cut points ({kinds}) over {c['scenarios']} "
                f"scenarios, {c['kill']} of them process kills; {c['violations']} violation(s)"
            )


@pytest.fixture(scope="module")
def summary(request: pytest.FixtureRequest) -> None:
    plugin = _Summary()
    if not request.config.pluginmanager.is_registered(plugin):
        request.config.pluginmanager.register(plugin, "cut-points-summary")


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> None:
    """Hundreds of trials each log their expected outage warnings: keep only CRITICAL."""
    for name in ("batch", "dcache", "sqlalchemy"):
        caplog.set_level(logging.CRITICAL, logger=name)


@pytest.fixture(scope="module")
def mp() -> Any:
    """A forkserver that imported the library once: a child costs a fork (each child
    imports _cut_child)."""
    return forkserver()


# -- checks -------------------------------------------------------------------------------


def _key(table: int, row: tuple[Any, ...]) -> Any:
    return row[:2] if table == 3 else row[0]  # targets: (job_id, idx)


def state_violations(s: Snapshot, allowed: list[Snapshot]) -> list[str]:
    """All or nothing: the store is as before the call, as after it, or (a method of
    several transactions) as after one of its commits."""
    if s in allowed:
        return []
    return ["all or nothing: the store is as neither before, after, nor between the call's commits"]


def commits(cut: Cut, unit: Unit) -> bool:
    """Whether the cut statement is a COMMIT that was carried out."""
    return unit.commit and cut.kind in ("after", "commit")


def store_violations(db: dcache.DB) -> list[str]:
    """Counters equal the stored targets; a terminal job has ended."""
    bad = []
    with db.engine.connect() as conn:
        rows = conn.execute(select(jobs)).all()
        tgts = conn.execute(select(targets.c.job_id, targets.c.status)).all()
    stored: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for job_id, status in tgts:
        if status != "pending":
            stored[job_id] += 1
        if status == "failed":
            failed[job_id] += 1
    for j in rows:
        if j.targets_done != stored[j.id] or j.targets_failed != failed[j.id]:
            bad.append(
                f"targets_done: job {j.id} says {j.targets_done} done/{j.targets_failed} "
                f"failed, {stored[j.id]}/{failed[j.id]} are stored"
            )
        if j.status in ("done", "failed", "partial") and j.finished_at is None:
            bad.append(f"finished_at: job {j.id} is {j.status} and has not ended")
    return bad


def live_without_owner(db: dcache.DB) -> list[str]:
    """Live jobs whose owner has no row or declared itself dead by now (after recovery)."""
    now = dcache.utcnow()
    with db.engine.connect() as conn:
        rows = conn.execute(
            select(jobs.c.id, jobs.c.owner, owners.c.stale_at)
            .select_from(jobs.outerjoin(owners, owners.c.owner == jobs.c.owner))
            .where(jobs.c.status.in_(dcache.LIVE))
        ).all()
    return [
        f"no job live without a drain or a live owner: job {r.id} of owner {r.owner!r}"
        for r in rows
        if r.stale_at is None or r.stale_at < now
    ]


def wait_all_ended(db: dcache.DB, timeout: float = FINISH) -> list[str]:
    """Wait until no job is live and every stopped job has ended; what is left, if not."""
    deadline = time.monotonic() + timeout
    while True:
        with db.engine.connect() as conn:
            left = conn.execute(
                select(jobs.c.id, jobs.c.status).where(
                    (jobs.c.status.in_(dcache.LIVE)) | (jobs.c.finished_at.is_(None))
                )
            ).all()
        if not left or time.monotonic() > deadline:
            return [
                f"no job live without a drain: job {r.id} still {r.status}, not ended "
                f"{timeout:.0f} s after the trial"
                for r in left
            ]
        time.sleep(0.05)  # polling another process's progress; nothing to wait on


def runner_store_violations(db: dcache.DB, calls: list[tuple[str, str]]) -> list[str]:
    """Nothing fetched twice; every stored result exactly what fetch returned."""
    bad = [
        f"nothing fetched twice: job {job} fetched {url} {n} times"
        for (job, url), n in Counter(calls).items()
        if n > 1
    ]
    with db.engine.connect() as conn:
        rows = conn.execute(select(targets)).all()
    fetched = set(calls)
    for r in rows:
        if r.status != "done":
            continue
        want = batch.Result(content_for(r.url), {"url": r.url})
        got = batch.Result.from_json(json.loads(r.result))
        if got != want:
            bad.append(f"result intact: job {r.job_id} target {r.idx} reads {got!r}")
        if (r.job_id, r.url) not in fetched:
            bad.append(f"result intact: job {r.job_id} target {r.idx} stored, never fetched")
    return bad + store_violations(db)


def error_violation(where: str, exc: BaseException | None, allowed: tuple[type, ...]) -> list[str]:
    if exc is None or isinstance(exc, allowed):
        return []
    return [
        f"error type: {where} raised {type(exc).__module__}.{type(exc).__qualname__}: "
        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"
    ]


def outcome_violations(name: str, out: dict[str, Any], db: dcache.DB) -> list[str]:
    """Per-method postconditions of the runner scenarios (the runner still alive)."""
    bad: list[str] = []
    bad += error_violation("Runner.submit", out.get("submit_error"), SUBMIT_ERRORS)
    bad += error_violation("Runner.cancel", out.get("cancel_error"), STORE_ERRORS)
    bad += error_violation("Runner.submit (retry)", out.get("retry_error"), SUBMIT_ERRORS)
    for key in ("wait_error", "retry_wait_error"):
        exc = out.get(key)
        if isinstance(exc, TimeoutError):
            bad.append(f"job finishes: {exc} ({'the retry' if 'retry' in key else 'the submit'})")
        else:
            bad += error_violation("Runner.wait", exc, STORE_ERRORS)
    if "submit_error" in out:
        if "retry_error" in out:
            bad.append(f"retry of the same submit failed: {out['retry_error']!r}")
        elif "retry_waited" in out and (
            out["retry_waited"] is None or out["retry_waited"].finished_at is None
        ):
            bad.append(f"retry of the same submit got job {out.get('retry_job')}, not finished")
    if name == "Runner.cancel" and "job" in out:
        job = db.get_job(out["job"])
        if job is None:
            bad.append("cancel: the job vanished")
        elif out.get("cancelled") is True and job.status != "cancelled":
            bad.append(f"cancel returned True; the job is {job.status}")
        elif "cancel_error" in out and job.status not in ("cancelled", "done"):
            bad.append(f"cancel raised: the job is {job.status} (neither cancelled nor run out)")
        elif job.status == "cancelled" and job.targets_done < 1:
            bad.append("cancel: the target in flight was not stored")
    return bad


# -- trials -------------------------------------------------------------------------------


def sample(units: list[Unit], limit: int) -> list[Unit]:
    """At most ``limit`` statements, evenly spread, always every COMMIT, first and last."""
    if len(units) <= limit:
        return units
    keep = {0, len(units) - 1} | {i for i, u in enumerate(units) if u.commit}
    rest = [i for i in range(len(units)) if i not in keep]
    room = max(0, limit - len(keep))
    if room and rest:
        step = len(rest) / room
        keep |= {rest[int(k * step)] for k in range(room)}
    return [units[i] for i in sorted(keep)]


def cuts_of(units: list[Unit], limit: int) -> list[tuple[Cut, Unit]]:
    """Every cut of the sampled statements; those after a COMMIT ran come first, so the
    states between the commits of a multi-transaction method are known before the rest."""
    out = []
    for u in sample(units, limit):
        for kind in KINDS:
            if kind != "commit" or u.commit:
                out.append((Cut(u.n, kind), u))  # type: ignore[arg-type]
    return sorted(out, key=lambda c: not commits(*c))


class Trials:
    """Runs every scenario's trials on one backend and collects the violations."""

    def __init__(self, backend: str, url: str, tmp: Path, mp: Any) -> None:
        self.backend = backend
        self.url = url
        self.tmp = tmp
        self.mp = mp
        self.now = dcache.utcnow()
        self.violations: list[str] = []
        self.count: Counter[str] = Counter()
        self.direct = dcache.DB.open(url)
        if backend in SERVER_URLS:
            wipe(self.direct)
        prepare(self.direct, self.now)
        self.s0 = snapshot(self.direct)
        self.proxy: WireProxy | None = None
        if backend in SERVER_URLS:
            protocol, host, port = upstream_of(url)
            self.proxy = WireProxy(protocol, host, port).start()
            self.cut_url = wire_url(url, self.proxy.port)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.direct.close()

    def record(self, where: str, found: list[str]) -> None:
        for v in found:
            self.violations.append(f"{self.backend} {where}: {v}")

    def covered(self, cut: Cut, fired: bool, kill: bool = False) -> None:
        if fired:
            self.count["cut"] += 1
            self.count["kind:" + cut.kind] += 1
            if kill:
                self.count["kill"] += 1

    def check_state(
        self, s: Snapshot, allowed: list[Snapshot], atomic: bool, committed: bool
    ) -> list[str]:
        """All or nothing; a state after a commit of a multi-transaction call is allowed."""
        bad = store_violations(self.direct)
        if not atomic and committed and not bad and s not in allowed:
            allowed.append(s)
        return state_violations(s, allowed) + bad

    def recover(self) -> None:
        """A new runner watches the owners for a staleness window, reaps, and stops.

        Owners are judged on the judge's own monotonic clock (issue 10, fault 3): the
        window is passed on an injected one instead of waited out in real time.
        """

        def never(_t: batch.Target) -> batch.Result:
            raise AssertionError("the recovery runner drains nothing")

        elapsed = [0.0]
        runner = batch.Runner(
            self.direct, never, batch.Config(heartbeat=HEARTBEAT), monotonic=lambda: elapsed[0]
        )
        try:
            elapsed[0] += 3600.0
            runner.check_owners()
        finally:
            runner.close(timeout=5)

    # -- store scenarios, in this process through the proxy --------------------------------

    def store_in_process(self, name: str) -> None:
        assert self.proxy is not None
        scenario = STORE[name]
        proxy = self.proxy

        def attempt(cut: Cut | None) -> tuple[Any, BaseException | None, list[Unit], Unit | None]:
            restore(self.direct, self.s0)
            db = dcache.DB.open(self.cut_url)
            ctx = Ctx(now=self.now, open_db=lambda: dcache.DB.open(self.cut_url))
            value: Any = None
            error: BaseException | None = None
            proxy.arm(cut)
            try:
                value = scenario.fn(db, ctx)
            except Exception as exc:
                error = exc
            finally:
                units, fired = proxy.disarm()
                db.close()
                proxy.reset_all()
            return value, error, units, fired

        value1, error1, units, _ = attempt(None)
        assert error1 is None, f"{name} fails uncut on {self.backend}: {error1!r}"
        s1 = snapshot(self.direct)
        allowed = [self.s0, s1]
        self.count["scenarios"] += 1
        for cut, unit in cuts_of(units, MAX_CUTS[self.backend]):
            value, error, _units, fired = attempt(cut)
            where = f"{name} #{cut.n} {cut.kind} [{unit.text}]"
            self.covered(cut, fired is not None)
            if fired is None:
                self.record(where, ["the cut point was not reached (the statements changed)"])
                continue
            s = snapshot(self.direct)
            bad = error_violation(name, error, STORE_ERRORS)
            bad += self.check_state(s, allowed, scenario.atomic, commits(cut, unit))
            if error is None:
                if value != value1:
                    bad.append(f"returned {value!r} after the cut, {value1!r} uncut")
                if s != s1:
                    bad.append("returned normally, but its effect is not in the store")
            self.recover()
            bad += live_without_owner(self.direct)
            self.record(where, bad)

    # -- runner scenarios, in this process through the proxy -------------------------------

    def runner_in_process(self, name: str) -> None:
        assert self.proxy is not None
        proxy = self.proxy

        def attempt(cut: Cut | None) -> tuple[dict[str, Any], list[Unit], Unit | None, list[str]]:
            wipe(self.direct)
            db = SplitDB.open(self.cut_url)
            db._side = self.direct
            fetch = Fetch()
            runner = batch.Runner(db, fetch, batch.Config(heartbeat=HEARTBEAT))
            seen: list[Unit] = []
            fired: list[Unit] = []

            def disarm() -> None:
                units, hit = proxy.disarm()
                seen.extend(units)
                if hit is not None:
                    fired.append(hit)

            env = Env(runner, fetch, uuid.uuid4().hex[:12], lambda: proxy.arm(cut), disarm, WAIT)
            try:
                out = RUNNER[name](env)
                # The runner is alive and beating: every job must come to an end.
                bad = wait_all_ended(self.direct)
                bad += outcome_violations(name, out, self.direct)
                bad += runner_store_violations(self.direct, fetch.calls)
            finally:
                runner.close(timeout=2)
                db.close()
                fetch.close()
                proxy.reset_all()
            return out, seen, fired[0] if fired else None, bad

        out, units, _, bad = attempt(None)
        assert not bad and not any(k.endswith("error") for k in out), (name, out, bad)
        self.count["scenarios"] += 1
        for cut, unit in cuts_of(units, MAX_CUTS[self.backend]):
            _out, _units, fired, bad = attempt(cut)
            where = f"{name} #{cut.n} {cut.kind} [{unit.text}]"
            self.covered(cut, fired is not None)
            if fired is None:
                bad = ["the cut point was not reached (the statements changed)", *bad]
            self.record(where, bad)

    # -- child processes killed at the cut --------------------------------------------------

    def child(self, name: str, cut: Cut | None, tag: str) -> tuple[int, dict[str, Any]]:
        out = self.tmp / f"out-{tag}.json"
        spec = {
            "scenario": name,
            "url": self.url,
            "cut": [cut.n, cut.kind] if cut else None,
            "now": self.now.isoformat(),
            "out": str(out),
            "fetch_log": str(self.tmp / f"fetch-{tag}.log"),
            "tag": tag,
            "wait": WAIT,
        }
        proc = self.mp.Process(target=_cut_child.run, args=(spec,))
        proc.start()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
            return -1, {}
        data = json.loads(out.read_text("utf-8")) if out.exists() else {}
        return proc.exitcode, data

    def store_killed(self, name: str) -> None:
        scenario = STORE[name]
        restore(self.direct, self.s0)
        code, data = self.child(name, None, f"{name}-uncut")
        assert code == 0 and "error" not in data["result"], (name, code, data)
        s1 = snapshot(self.direct)
        allowed = [self.s0, s1]
        units = [Unit(n, 0, text, commit) for n, text, commit in data["units"]]
        self.count["scenarios"] += 1
        for cut, unit in cuts_of(units, MAX_CUTS[self.backend]):
            if cut.kind == "commit":
                continue  # a kill after COMMIT ran is the "after" cut of that statement
            restore(self.direct, self.s0)
            code, data = self.child(name, cut, f"{name}-{cut.n}-{cut.kind}")
            kind = "commit" if unit.commit and cut.kind == "after" else cut.kind
            where = f"{name} #{cut.n} {kind} [{unit.text}] (process killed)"
            self.covered(Cut(cut.n, kind), code == EXIT_CODE, kill=True)  # type: ignore[arg-type]
            if code != EXIT_CODE:
                self.record(where, [f"the child was not killed at the cut (exit {code}): {data}"])
                continue
            s = snapshot(self.direct)
            bad = self.check_state(s, allowed, scenario.atomic, commits(cut, unit))
            self.recover()
            bad += live_without_owner(self.direct)
            self.record(where, bad)

    def runner_killed(self, name: str, limit: int) -> None:
        wipe(self.direct)
        tag = f"{name}-uncut-{uuid.uuid4().hex[:8]}"
        code, data = self.child(name, None, tag)
        assert code == 0, (name, code, data)
        assert not any(k.endswith("error") for k in data["result"]), data
        units = [Unit(n, 0, text, commit) for n, text, commit in data["units"]]
        self.count["scenarios"] += 1
        cuts = cuts_of(units, limit)
        if self.backend != "sqlite":
            # The servers: a few points, every kind (recovery waits for a stale owner).
            cuts = [c for c in cuts if c[0].kind != "commit"]
            cuts = [c for i, c in enumerate(cuts) if i % max(1, len(cuts) // KILL_RUNNER_CUTS) == 0]
        for i, (cut, unit) in enumerate(cuts):
            if cut.kind == "commit":
                continue  # in a killed process "after COMMIT" is the commit cut
            wipe(self.direct)
            tag = f"{name}-{cut.n}-{cut.kind}-{uuid.uuid4().hex[:8]}"
            code, data = self.child(name, cut, tag)
            kind = "commit" if unit.commit and cut.kind == "after" else cut.kind
            where = f"{name} #{cut.n} {kind} [{unit.text}] (process killed)"
            self.covered(Cut(cut.n, kind), code == EXIT_CODE, kill=True)  # type: ignore[arg-type]
            if code != EXIT_CODE:
                self.record(where, [f"the child was not killed at the cut (exit {code}): {data}"])
                continue
            if self.backend == "sqlite" or i % 2:
                self.direct.mark_in_flight_failed("restart")  # the single-process restart
                bad = wait_all_ended(self.direct, 0)
            else:
                # Several processes: a new runner's heartbeat reaps the dead owner's jobs.
                with batch.Runner(
                    self.direct, Fetch(), batch.Config(heartbeat=HEARTBEAT)
                ) as recovery:
                    bad = wait_all_ended(self.direct, FINISH)
                    assert recovery is not None
            calls = read_fetch_log(str(self.tmp / f"fetch-{tag}.log"))
            bad += runner_store_violations(self.direct, calls)
            self.record(where, bad)


@contextlib.contextmanager
def trials(backend: str, tmp_path: Path, mp: Any) -> Iterator[Trials]:
    t = Trials(backend, backend_url(backend, tmp_path), tmp_path, mp)
    try:
        yield t
    finally:
        t.close()


def finish(t: Trials) -> None:
    t.count["violations"] = len(t.violations)
    REPORT[t.backend] = t.count
    assert t.count["cut"] > 0
    assert not t.violations, f"{len(t.violations)} violation(s):\n" + "\n".join(t.violations)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_a_cut_at_any_statement_keeps_every_promise_on_servers(
    backend: str, tmp_path: Path, mp: Any, summary: None, quiet: None
) -> None:
    """Every store method, cut before, after or at the COMMIT of each statement, keeps its word."""
    with trials(backend, tmp_path, mp) as t:
        for name in STORE:
            t.store_in_process(name)
        for name in RUNNER:
            t.runner_in_process(name)
        for name in KILL_ON_SERVERS:
            if name in STORE:
                t.store_killed(name)
            else:
                t.runner_killed(name, MAX_CUTS[backend])
        finish(t)


@pytest.mark.slow
def test_a_kill_at_any_statement_keeps_every_promise_on_sqlite(
    tmp_path: Path, mp: Any, summary: None, quiet: None
) -> None:
    """Every store method on SQLite, its process killed before or after each statement."""
    with trials("sqlite", tmp_path, mp) as t:
        for name in STORE:
            t.store_killed(name)
        for name in RUNNER:
            t.runner_killed(name, MAX_CUTS["sqlite"])
        finish(t)
