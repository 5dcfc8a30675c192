"""batch.testing (issue 15): the kit apps test with, used as an app's test suite would."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

import batch
import dcache
from batch.testing import Clock, ImmediateRunner, ScriptedFetch

pytest_plugins = ["pytester"]

A, B, C = (f"https://example.org/{n}" for n in "abc")


def test_immediate_submit_returns_with_the_job_finished_and_every_rule_kept(
    batch_immediate_runner: ImmediateRunner, batch_fetch: ScriptedFetch
) -> None:
    """The job is terminal when submit returns; order, idempotency and results hold."""
    batch_fetch.result(A, "alpha", {"n": 1})
    batch_fetch.error(B, "gone", hint="check the URL")
    job_id, reused = batch_immediate_runner.submit("alice", "free", [{"url": A}, {"url": B}])
    assert not reused
    found = batch_immediate_runner.status(job_id)
    assert found is not None
    job, targets = found
    assert (job.status, job.targets_done, job.finished_at is not None) == ("partial", 2, True)
    assert [(t.status, t.error, t.hint) for t in targets] == [
        ("done", "", ""),
        ("failed", "gone", "check the URL"),
    ]
    assert targets[0].result == batch.Result("alpha", {"n": 1})
    assert batch_fetch.calls == [A, B]
    # Idempotency: the same submission is the same job, not fetched again.
    assert batch_immediate_runner.submit("alice", "free", [{"url": A}, {"url": B}]) == (
        job_id,
        True,
    )
    assert batch_fetch.calls == [A, B]
    assert batch_immediate_runner.wait(job_id, timeout=1) == job


def test_immediate_mode_still_enforces_the_caps(batch_db: dcache.DB) -> None:
    """A caller at its cap is refused in tests exactly as in production."""
    fetch = ScriptedFetch()
    gate = fetch.gate(A)
    config = batch.Config(jobs_per_caller=1, targets_per_job=2)
    with ImmediateRunner(batch_db, fetch, config) as runner:
        with pytest.raises(batch.TooManyTargetsError):
            runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
        holder = threading.Thread(target=runner.submit, args=("alice", "free", [{"url": A}]))
        holder.start()  # its submit drains inline, held at the gate: the job stays live
        gate.wait_entered()
        with pytest.raises(batch.CallerBusyError):
            runner.submit("alice", "free", [{"url": B}])
        gate.open()
        holder.join(10)
        assert not holder.is_alive()


def test_a_flask_view_under_test_returns_with_the_job_already_terminal(
    batch_immediate_runner: ImmediateRunner, batch_fetch: ScriptedFetch
) -> None:
    """What an app's own view tests want: POST, then GET shows the end, no polling."""
    flask = pytest.importorskip("flask")
    import batch.flask as batch_flask

    app = flask.Flask("under-test")
    batch_flask.init_app(app, batch_immediate_runner, lambda request: ("alice", "free"))
    batch_fetch.result(A, "page")
    client = app.test_client()
    posted = client.post("/jobs", json={"targets": [{"url": A}]})
    assert posted.status_code == 202, posted.get_json()
    job_id = posted.get_json()["job"]["id"]
    got = client.get(f"/jobs/{job_id}").get_json()
    assert got["job"]["status"] == "done"
    assert got["targets"][0]["result"]["content"] == "page"


def test_the_clock_moves_leases_and_heartbeat_judgements_without_sleeping(
    batch_db: dcache.DB, batch_fetch: ScriptedFetch, batch_clock: Clock
) -> None:
    """Advance past the TTL: the job lapses; a wall-clock step alone changes no judgement."""
    config = batch.Config(ttl=dt.timedelta(hours=1))
    with batch.Runner(
        batch_db, batch_fetch, config, clock=batch_clock, monotonic=batch_clock.monotonic
    ) as runner:
        job_id, _ = runner.submit("alice", "free", [{"url": A}])
        assert runner.wait(job_id, timeout=10) is not None
        before = batch_clock.monotonic()
        batch_clock.step(-3600)  # a wall-clock step: monotonic time does not move
        assert batch_clock.monotonic() == before
        batch_clock.step(3600)
        batch_clock.advance(minutes=59)
        assert runner.lookup(job_id) == "found"
        batch_clock.advance(minutes=2)
        assert batch_clock.monotonic() == before + 61 * 60
        assert runner.status(job_id) is None
        assert runner.lookup(job_id) == "expired"
    with pytest.raises(ValueError):
        batch_clock.advance(-1)


def test_the_clock_moves_the_maintenance_threads_purges_too(
    batch_db: dcache.DB, batch_fetch: ScriptedFetch, batch_clock: Clock
) -> None:
    """Purges are due by the injected monotonic clock: advancing it past the purge
    interval deletes a lapsed job within a few real beats (it waited ten real minutes)."""
    config = batch.Config(
        ttl=dt.timedelta(hours=1),
        heartbeat=dt.timedelta(seconds=0.02),
        purge_interval=dt.timedelta(minutes=10),
    )
    with batch.Runner(
        batch_db, batch_fetch, config, clock=batch_clock, monotonic=batch_clock.monotonic
    ) as runner:
        job_id, _ = runner.submit("alice", "free", [{"url": A}])
        assert runner.wait(job_id, timeout=10) is not None
        done_at = batch_clock()
        batch_clock.advance(hours=2)
        deadline = time.monotonic() + 10
        while batch_db.get_job(job_id, now=done_at) is not None:  # still stored
            assert time.monotonic() < deadline, "the lapsed job was never purged"
            threading.Event().wait(0.02)
        assert runner.lookup(job_id) == "expired"


def test_scripted_fetch_delays_raises_and_gates(batch_runner: batch.Runner) -> None:
    """Each scripted behaviour shows in the stored outcome, in order."""
    fetch = batch_runner.fetch
    assert isinstance(fetch, ScriptedFetch)
    fetch.delay(A, 0.05)
    fetch.raises(B, RuntimeError("app bug"))
    gate = fetch.gate(C)
    job_id, _ = batch_runner.submit("alice", "free", [{"url": u} for u in (A, B, C)])
    gate.wait_entered()
    found = batch_runner.status(job_id)
    assert found is not None
    assert [t.status for t in found[1]] == ["done", "failed", "running"]
    assert found[1][1].error == "RuntimeError: app bug"
    gate.open()
    job = batch_runner.wait(job_id, timeout=10)
    assert job is not None and job.status == "partial"
    assert fetch.count() == 3 and fetch.peak == 1


def test_gating_a_url_again_after_its_gate_opened_holds_the_next_fetch(
    batch_runner: batch.Runner,
) -> None:
    """``gate(url)`` once more, after the first gate was opened, gives a new closed gate:
    the next fetch of the URL is held again (it was waved through by the open one, so a
    test asserted on a job it believed held). Asked twice before opening, it is one gate."""
    fetch = batch_runner.fetch
    assert isinstance(fetch, ScriptedFetch)
    first = fetch.gate(A)
    assert fetch.gate(A) is first
    job_id, _ = batch_runner.submit("alice", "free", [{"url": A}])
    first.wait_entered()
    first.open()
    assert batch_runner.wait(job_id, timeout=10) is not None
    second = fetch.gate(A)
    assert second is not first and not second.opened.is_set()
    job_id, _ = batch_runner.submit("bob", "free", [{"url": A}])
    second.wait_entered()
    found = batch_runner.status(job_id)
    assert found is not None and found[0].status == "running"
    second.open()
    job = batch_runner.wait(job_id, timeout=10)
    assert job is not None and job.status == "done"


def test_the_plugin_is_active_in_an_apps_test_suite(pytester: pytest.Pytester) -> None:
    """Installed with the package, the fixtures are there without any conftest."""
    pytester.makepyfile(
        """
        def test_app(batch_immediate_runner, batch_fetch):
            batch_fetch.result("https://e.org/x", "hello")
            job_id, _ = batch_immediate_runner.submit("u", "c", [{"url": "https://e.org/x"}])
            job, targets = batch_immediate_runner.status(job_id)
            assert job.status == "done"
            assert targets[0].result.content == "hello"
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    # Named by its module too (-p, or pytest_plugins in a conftest), it is the same
    # plugin: registered under another name, pytest aborted every test of the session.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "batch.testing")
    result.assert_outcomes(passed=1)
    pytester.makeconftest('pytest_plugins = ["batch.testing"]')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:batch.testing")
    assert result.ret != 0  # turned off by that name: the fixtures are gone


def test_a_gate_left_closed_is_opened_before_the_runner_waits_for_its_drain(
    pytester: pytest.Pytester,
) -> None:
    """A test that ends with a fetch held at a gate tears down at once, with no crash log."""
    pytester.makepyfile(
        """
        import logging
        import time

        import pytest

        @pytest.fixture
        def criticals():
            # Set up before the runner fixtures, so torn down after them: sees their close.
            records = []
            handler = logging.Handler(logging.CRITICAL)
            handler.emit = records.append
            logging.getLogger("batch").addHandler(handler)
            yield records
            logging.getLogger("batch").removeHandler(handler)
            assert [r.getMessage() for r in records] == []

        @pytest.fixture
        def timed():
            started = time.monotonic()
            yield
            took = time.monotonic() - started
            assert took < 5, f"teardown waited {took:.1f} s for a gate"

        @pytest.mark.parametrize("kind", ["batch_runner", "batch_immediate_runner"])
        def test_left_held(criticals, timed, kind, request, batch_fetch):
            runner = request.getfixturevalue(kind)
            gate = batch_fetch.gate("https://e.org/slow")
            if kind == "batch_runner":
                runner.submit("u", "c", [{"url": "https://e.org/slow"}])
            else:  # its submit drains inline: hold it on a thread of the test's own
                import threading
                threading.Thread(
                    target=runner.submit, args=("u", "c", [{"url": "https://e.org/slow"}]),
                    daemon=True,
                ).start()
            gate.wait_entered()
        """
    )
    started = time.monotonic()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    took = time.monotonic() - started
    result.assert_outcomes(passed=2)
    assert took < 10, f"two tests took {took:.1f} s: a teardown waited for its gate"
