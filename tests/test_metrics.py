"""Prometheus metrics on the event stream, the store's scrape-time gauges, gunicorn -w 2."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _fetchers import WAIT, FakeFetch, wait_for
from flask import Flask, Request
from flask.testing import FlaskClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import batch
import dcache
from batch import events
from batch._metrics import OTHER_CLASS, RunnerMetrics, metrics

CONFIG = batch.Config(heartbeat=dt.timedelta(seconds=30), jobs_per_caller=1, jobs_total=8)
TESTS = Path(__file__).resolve().parent

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(client: FlaskClient) -> Samples:
    resp = client.get("/metrics")
    assert resp.status_code == 200, resp.status_code
    assert resp.content_type.startswith("text/plain")
    return parse(resp.get_data(as_text=True))


@pytest.fixture
def fake() -> Iterator[FakeFetch]:
    f = FakeFetch()
    yield f
    f.release_all()


def app_for(runner: batch.Runner, **options: object) -> FlaskClient:
    app = Flask(__name__)
    app.register_blueprint(metrics(runner, registry=CollectorRegistry(), **options))  # type: ignore[arg-type]
    return app.test_client()


def boom(target: batch.Target) -> batch.Result:
    raise batch.FetchError("gone", hint="check the URL")


def test_a_jobs_life_is_counted_by_outcome_and_status(db: dcache.DB, fake: FakeFetch) -> None:
    """Submissions, refusals, targets, finished jobs and timings: what alerts are written on."""
    fake.behave("https://e.com/b", boom)
    fake.block("https://e.com/slow")
    with batch.Runner(db, fake, CONFIG) as runner:
        client = app_for(runner)
        targets = [{"url": "https://e.com/a"}, {"url": "https://e.com/b"}]
        job_id, _ = runner.submit("alice", "gold", targets)
        assert runner.wait(job_id, timeout=WAIT) is not None
        assert runner.submit("alice", "gold", targets) == (job_id, True)
        slow, _ = runner.submit("alice", "gold", [{"url": "https://e.com/slow"}])
        with pytest.raises(batch.CallerBusyError):
            runner.submit("alice", "gold", [{"url": "https://e.com/c"}])
        with pytest.raises(batch.InvalidTargetsError):
            runner.submit("bob", "free", [])
        fake.wait_entered("https://e.com/slow")
        assert runner.cancel(slow)
        fake.release("https://e.com/slow")
        assert runner.wait(slow, timeout=WAIT) is not None

        def settled() -> bool:
            s = scrape(client)
            return (
                value(s, "batch_jobs_finished_total", status="cancelled", caller_class="gold") == 1
            )

        wait_for(settled, "the metrics to see the cancelled job's end")
        s = scrape(client)
    assert value(s, "batch_submissions_total", outcome="created", caller_class="gold") == 2
    assert value(s, "batch_submissions_total", outcome="reused", caller_class="gold") == 1
    assert value(s, "batch_submissions_total", outcome="caller_busy", caller_class="gold") == 1
    assert value(s, "batch_submissions_total", outcome="invalid", caller_class="free") == 1
    assert value(s, "batch_targets_total", status="done", caller_class="gold") == 2
    assert value(s, "batch_targets_total", status="failed", caller_class="gold") == 1
    assert value(s, "batch_jobs_finished_total", status="partial", caller_class="gold") == 1
    assert value(s, "batch_jobs_cancelled_total") == 1
    assert value(s, "batch_fetch_duration_seconds_count") == 3
    assert value(s, "batch_store_write_duration_seconds_count") == 3
    assert value(s, "batch_store_write_duration_seconds_sum") > 0
    assert value(s, "batch_job_duration_seconds_count", status="partial") == 1
    assert value(s, "batch_result_bytes_total") > len("content of https://e.com/a") * 2
    assert value(s, "batch_process_live_jobs") == 0
    assert value(s, "batch_store_up") == 1


def test_labels_never_carry_callers_urls_or_ids(db: dcache.DB, fake: FakeFetch) -> None:
    """Series stay bounded however many callers and jobs come: only classes and statuses."""
    with batch.Runner(db, fake, CONFIG) as runner:
        client = app_for(runner)
        ids = []
        for i in range(3):
            job_id, _ = runner.submit(f"caller-{i}", "gold", [{"url": f"https://e.com/p{i}"}])
            ids.append(job_id)
        for job_id in ids:
            assert runner.wait(job_id, timeout=WAIT) is not None
        wait_for(
            lambda: (
                value(
                    scrape(client), "batch_jobs_finished_total", status="done", caller_class="gold"
                )
                == 3
            ),
            "three finished jobs",
        )
        text = client.get("/metrics").get_data(as_text=True)
    assert "caller-" not in text and "e.com" not in text
    assert not any(job_id in text for job_id in ids)
    names = set(re.findall(r'([a-z_]+)="', text))
    assert names <= {"outcome", "caller_class", "status", "operation", "kind", "le"} | {
        "implementation",
        "major",
        "minor",
        "patchlevel",
        "version",
        "generation",
    }


def test_store_gauges_count_the_whole_database(
    db: dcache.DB, backend: str, tmp_path: Path, fake: FakeFetch
) -> None:
    """Live jobs and callers at their cap come from the store: other processes' jobs count."""
    # A peer's store on the same database (memory: the same store, as nothing else sees it).
    other_db = db if backend == "memory" else dcache.DB(db.engine)
    fake.block("https://e.com/1", "https://e.com/2", "https://e.com/3")
    with batch.Runner(db, fake, CONFIG) as runner, batch.Runner(other_db, fake, CONFIG) as peer:
        client = app_for(runner)
        runner.submit("alice", "gold", [{"url": "https://e.com/1"}])
        peer.submit("bob", "gold", [{"url": "https://e.com/2"}])
        peer.submit("carol", "free", [{"url": "https://e.com/3"}])
        for url in ("https://e.com/1", "https://e.com/2", "https://e.com/3"):
            fake.wait_entered(url)
        s = scrape(client)
        assert value(s, "batch_live_jobs") == 3
        assert value(s, "batch_live_jobs_limit") == 8
        assert value(s, "batch_live_callers") == 3
        assert value(s, "batch_callers_at_cap") == 3
        assert value(s, "batch_caller_live_jobs_limit") == 1
        wait_for(
            lambda: value(scrape(client), "batch_process_live_jobs") == 1, "this process's one"
        )
        fake.release_all()
    s = parse(app_for_closed(db))
    assert value(s, "batch_live_jobs") == 0


def app_for_closed(db: dcache.DB) -> str:
    """A scrape through a fresh runner (the others are closed)."""
    with batch.Runner(db, lambda t: batch.Result(""), CONFIG) as runner:
        return app_for(runner).get("/metrics").get_data(as_text=True)


def test_caller_classes_beyond_the_bound_share_one_label() -> None:
    """An app that puts something unbounded in caller_class cannot grow the series forever."""
    reg = CollectorRegistry()
    m = RunnerMetrics(reg, max_caller_classes=2)
    now = dcache.utcnow()
    for cls in ("a", "b", "c", "d", "a"):
        m(events.JobSubmitted(now, "id-" + cls, "someone", cls, 1, False))
    m(events.StoreFailed(now, "write_target", True, "gone"))
    m(events.StoreFailed(now, "submit", False, "refused"))
    m(events.JobsReaped(now, 3, ("o1",)))
    m(events.JobFinished(now, "id-a", "a", "done", "", 1.5))
    m(events.JobFinished(now, "never-seen", "a", "done", "", 1.5))
    # A fast drain's end can reach the stream before its submission: it is no live job.
    m(events.JobFinished(now, "fast", "a", "done", "", 0.01))
    m(events.JobSubmitted(now, "fast", "someone", "a", 1, False))
    from prometheus_client import generate_latest

    s = parse(generate_latest(reg).decode())
    assert value(s, "batch_submissions_total", outcome="created", caller_class="a") == 3
    assert value(s, "batch_submissions_total", outcome="created", caller_class="b") == 1
    assert value(s, "batch_submissions_total", outcome="created", caller_class=OTHER_CLASS) == 2
    assert value(s, "batch_store_errors_total", operation="write_target", kind="transient") == 1
    assert value(s, "batch_store_errors_total", operation="submit", kind="permanent") == 1
    assert value(s, "batch_orphaned_jobs_reaped_total") == 3
    assert value(s, "batch_process_live_jobs") == 3  # b, c, d; a finished; never-seen ignored


def test_a_refused_class_never_becomes_a_label_nor_takes_a_slot() -> None:
    """A submission refused as invalid carries its class as sent: a lone surrogate in a
    label made every later scrape a 500 (in multiprocess mode, every process's), and
    classes no runner accepts used up the bounded slots, so a real one counted as other."""
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    m = RunnerMetrics(reg, max_caller_classes=2)
    now = dcache.utcnow()
    for bad in ("tier\ud800", "x" * 300, "nul\x00", 7, ""):
        m(events.SubmissionRefused(now, "someone", bad, "invalid"))  # type: ignore[arg-type]
    m(events.JobSubmitted(now, "id-g", "someone", "gold", 1, False))
    m(events.SubmissionRefused(now, "someone", "gold", "invalid"))
    text = generate_latest(reg).decode()  # did not raise
    s = parse(text)
    assert value(s, "batch_submissions_total", outcome="created", caller_class="gold") == 1
    assert value(s, "batch_submissions_total", outcome="invalid", caller_class="gold") == 1
    assert value(s, "batch_submissions_total", outcome="invalid", caller_class=OTHER_CLASS) == 5
    assert "xxxx" not in text


def test_metrics_can_be_guarded(db: dcache.DB, fake: FakeFetch) -> None:
    """An app that keeps /metrics private passes authorize; a refused scrape is a 403."""
    with batch.Runner(db, fake, CONFIG) as runner:
        client = app_for(runner, authorize=lambda req: req.headers.get("X-Key") == "k")
        assert client.get("/metrics").status_code == 403
        assert client.get("/metrics", headers={"X-Key": "k"}).status_code == 200
        om = client.get(
            "/metrics", headers={"X-Key": "k", "Accept": "application/openmetrics-text"}
        )
        assert om.content_type.startswith("application/openmetrics-text")


# -- several gunicorn workers ------------------------------------------------------------


def _get(url: str, **headers: str) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=WAIT) as resp:
        return resp.status, resp.headers["X-Worker-Pid"], resp.read()


def _post(url: str, body: object) -> tuple[str, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=WAIT) as resp:
        return json.load(resp)["job"]["id"], resp.headers["X-Worker-Pid"]


@pytest.mark.slow
@pytest.mark.parametrize("shared_url", ["sqlite", "postgresql"], indirect=True)
def test_counts_add_up_across_gunicorn_workers(shared_url: str, tmp_path: Path) -> None:
    """Under gunicorn -w 2 any worker's scrape reports every worker's work, before and after
    a worker dies (child_exit drops its live gauge, its counters stay)."""
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
        "OPS_TEST_DB": shared_url,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]),
    }
    log = tmp_path / "gunicorn.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-w",
                "2",
                "-b",
                "127.0.0.1:0",
                "-c",
                str(TESTS / "_gunicorn_metrics.conf.py"),
                "--graceful-timeout",
                "5",
                "_metrics_app:app",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    try:

        def listening() -> bool:
            return "Listening at: http://127.0.0.1:" in log.read_text()

        wait_for(listening, "gunicorn to listen", timeout=30)
        port = re.search(r"Listening at: http://127\.0\.0\.1:(\d+)", log.read_text()).group(1)  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: log.read_text().count("Booting worker") >= 2, "two workers", timeout=30)

        submit_pids: set[str] = set()
        ids: list[str] = []
        while len(ids) < 10 or (len(submit_pids) < 2 and len(ids) < 200):
            n = len(ids)
            url = f"https://e.com/fail{n}" if n % 5 == 0 else f"https://e.com/{n}"
            job_id, pid = _post(base + "/jobs", {"targets": [{"url": url}]})
            ids.append(job_id)
            submit_pids.add(pid)
        assert len(submit_pids) == 2, "both workers took submissions"
        n = len(ids)
        failed = len(range(0, n, 5))

        def all_counted() -> bool:
            _, _, body = _get(base + "/metrics")
            s = parse(body.decode())
            return (
                value(s, "batch_jobs_finished_total", status="failed", caller_class="gold")
                + value(s, "batch_jobs_finished_total", status="done", caller_class="gold")
                == n
            )

        wait_for(all_counted, "every worker's finished jobs in one scrape", timeout=30)

        def check(samples: Samples) -> None:
            assert (
                value(samples, "batch_submissions_total", outcome="created", caller_class="gold")
                == n
            )
            assert (
                value(samples, "batch_targets_total", status="done", caller_class="gold")
                == n - failed
            )
            assert (
                value(samples, "batch_targets_total", status="failed", caller_class="gold")
                == failed
            )
            assert (
                value(samples, "batch_jobs_finished_total", status="done", caller_class="gold")
                == n - failed
            )
            assert value(samples, "batch_fetch_duration_seconds_count") == n
            assert value(samples, "batch_process_live_jobs") == 0
            assert value(samples, "batch_live_jobs") == 0
            assert value(samples, "batch_store_up") == 1

        scrape_pids: set[str] = set()
        # Scrapes four at a time: one after another, the worker already awake in accept()
        # may answer them all; at once, a busy worker leaves the next one to the other.
        with ThreadPoolExecutor(4) as pool:
            for _ in range(50):
                for status, pid, body in pool.map(lambda _: _get(base + "/metrics"), range(4)):
                    assert status == 200
                    check(parse(body.decode()))
                    scrape_pids.add(pid)
                if len(scrape_pids) == 2:
                    break
        assert len(scrape_pids) == 2, "both workers answered scrapes"

        victim = int(sorted(scrape_pids)[0])
        assert (prom_dir / f"gauge_livesum_{victim}.db").exists()
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: not (prom_dir / f"gauge_livesum_{victim}.db").exists(),
            "child_exit to mark the killed worker dead",
            timeout=30,
        )
        wait_for(lambda: log.read_text().count("Booting worker") >= 3, "a new worker", timeout=30)
        for _ in range(10):
            _, _, body = _get(base + "/metrics")
            check(parse(body.decode()))  # the dead worker's counters still count
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_mounting_metrics_twice_counts_each_event_once(fake: FakeFetch) -> None:
    """An app factory run twice (or two apps in one process) subscribes the runner once per
    registry: every event is counted once, not once per mount."""
    reg = CollectorRegistry()
    store = dcache.DB.memory()
    try:
        with batch.Runner(store, fake, CONFIG) as runner:
            clients = []
            for _ in range(2):
                app = Flask(__name__)
                app.register_blueprint(metrics(runner, registry=reg))
                clients.append(app.test_client())
            other = CollectorRegistry()  # a second registry has its own subscription
            other_app = Flask(__name__)
            other_app.register_blueprint(metrics(runner, registry=other))
            job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
            assert runner.wait(job_id, timeout=WAIT) is not None

            def finished(client: FlaskClient) -> float:
                s = scrape(client)
                return value(s, "batch_jobs_finished_total", status="done", caller_class="gold")

            for client in (*clients, other_app.test_client()):
                wait_for(lambda: finished(client) >= 1, "the finished job in the scrape")
                s = scrape(client)
                assert (
                    value(s, "batch_submissions_total", outcome="created", caller_class="gold") == 1
                )
                assert value(s, "batch_targets_total", status="done", caller_class="gold") == 1
                assert (
                    value(s, "batch_jobs_finished_total", status="done", caller_class="gold") == 1
                )
    finally:
        store.close()


def test_attach_subscribes_once_per_runner_until_detached(fake: FakeFetch) -> None:
    """attach() is idempotent per runner; after its unsubscribe, attaching again counts again."""
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    m = RunnerMetrics(reg)
    store = dcache.DB.memory()

    def created() -> float:
        s = parse(generate_latest(reg).decode())
        return value(s, "batch_submissions_total", outcome="created", caller_class="gold")

    try:
        with batch.Runner(store, fake, CONFIG) as runner:
            detach = m.attach(runner)
            assert m.attach(runner) == detach  # the same subscription's
            first, _ = runner.submit("alice", "gold", [{"url": "https://e.com/1"}])
            assert runner.wait(first, timeout=WAIT) is not None
            wait_for(lambda: created() >= 1, "the first submission counted")
            detach()
            detach()  # twice: harmless
            again = m.attach(runner)
            assert again != detach
            second, _ = runner.submit("alice", "gold", [{"url": "https://e.com/2"}])
            assert runner.wait(second, timeout=WAIT) is not None
            wait_for(lambda: created() >= 2, "the second submission counted")
            third, _ = runner.submit("alice", "gold", [{"url": "https://e.com/3"}])
            assert runner.wait(third, timeout=WAIT) is not None
            wait_for(lambda: created() >= 3, "the third submission counted")
            assert created() == 3
    finally:
        store.close()


@pytest.mark.parametrize(
    ("answer", "status"),
    [(True, 200), (False, 403), (None, 403), (1, 403), ("yes", 403), ("denied: no", 403)],
)
def test_metrics_and_dashboard_let_in_exactly_the_same_answers(
    fake: FakeFetch, answer: object, status: int
) -> None:
    """One authorize for both: only True gets in anywhere (a truthy 'denied: ...' is no yes)."""
    from batch._dashboard import dashboard

    store = dcache.DB.memory()
    try:
        with batch.Runner(store, fake, CONFIG) as runner:
            app = Flask(__name__)

            def hook(request: Request) -> bool:
                return answer  # type: ignore[return-value]  # an app's hook may answer anything

            app.register_blueprint(metrics(runner, registry=CollectorRegistry(), authorize=hook))
            app.register_blueprint(dashboard(runner, hook))
            client = app.test_client()
            assert client.get("/metrics").status_code == status
            assert client.get("/batch/").status_code == status
    finally:
        store.close()


def test_metrics_authorize_may_answer_with_its_own_http_error(fake: FakeFetch) -> None:
    """HTTP Basic auth on /metrics: a 401 raised by authorize is the answer, header and all."""
    from werkzeug.datastructures import WWWAuthenticate
    from werkzeug.exceptions import Unauthorized

    def basic(request: Request) -> bool:
        if request.authorization and request.authorization.password == "pw":
            return True
        raise Unauthorized(www_authenticate=WWWAuthenticate("basic", {"realm": "metrics"}))

    store = dcache.DB.memory()
    try:
        with batch.Runner(store, fake, CONFIG) as runner:
            client = app_for(runner, authorize=basic)
            resp = client.get("/metrics")
            assert resp.status_code == 401
            assert resp.headers["WWW-Authenticate"] == "Basic realm=metrics"
            assert client.get("/metrics", auth=("prom", "pw")).status_code == 200
    finally:
        store.close()


def test_the_process_wide_instruments_keep_no_closed_runner_alive() -> None:
    """The once-per-runner bookkeeping is weak: a closed runner (and its store) can go."""
    import gc
    import weakref

    from batch._metrics import instruments

    reg = CollectorRegistry()
    store = dcache.DB.memory()
    runner = batch.Runner(store, lambda t: batch.Result("x"), CONFIG)
    Flask(__name__).register_blueprint(metrics(runner, registry=reg))
    job_id, _ = runner.submit("alice", "gold", [{"url": "https://e.com/a"}])
    assert runner.wait(job_id, timeout=WAIT) is not None
    runner.close(timeout=WAIT)
    store.close()
    gone = weakref.ref(runner)
    del runner
    gc.collect()
    assert gone() is None
    assert len(instruments(reg)._attached) == 0
