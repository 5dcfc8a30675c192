"""The benchmark suite still runs: every measurement once at toy sizes, and the CLI end to end.

Not a benchmark: nothing here is timed or compared. It keeps ``bench/`` from rotting when
the store's schema or API moves (the floors write the store's tables by hand).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REQUIRE_SERVERS, SERVER_URLS, database_beside
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dcache  # noqa: E402
from bench import _cases, _floors, _prefill, _report  # noqa: E402
from bench._env import (  # noqa: E402
    BACKENDS,
    Params,
    Spec,
    new_id,
    payload_json,
    reachable,
    server_urls,
    stale_tables,
    wipe,
)

TINY = Params(
    jobs=1,
    targets=4,
    samples=3,
    mem_targets=2,
    mem_result_bytes=2048,
    concurrent=2,
    concurrent_targets=4,
    live_jobs=24,
    live_targets=2,
    live_fetch_ms=20,
)


def _bench_url(backend: str) -> str:
    """The bench's own database beside the test database (``test`` -> ``test_bench``).

    Created here if missing, as ``python -m bench`` expects a database of its own (it
    empties the store's tables); ``BENCH_POSTGRES_URL``/``BENCH_MYSQL_URL`` still win.
    """
    configured = server_urls()[backend]
    if backend == "postgresql" and "BENCH_POSTGRES_URL" in os.environ:
        return configured
    if backend == "mariadb" and "BENCH_MYSQL_URL" in os.environ:
        return configured
    try:
        return database_beside(SERVER_URLS[backend], "_bench")
    except Exception as exc:
        if REQUIRE_SERVERS:
            pytest.fail(f"cannot create the bench database on {backend}: {exc}")
        pytest.skip(f"{backend} does not answer: {exc}")


def _spec(tmp_path: Path, case: str, backend: str = "sqlite", **extra: object) -> Spec:
    be = BACKENDS[backend]
    if be.server:
        url = _bench_url(backend)
        why = reachable(be.kind, url)
        if why is not None:
            pytest.fail(f"{backend} at {url} does not answer: {why}")
    else:
        url = f"sqlite:///{tmp_path / (case.replace('/', '-') + '.sqlite3')}"
    return Spec(case, backend, url, TINY, str(tmp_path), dict(extra))


CASES = [
    "drain/raw",
    "drain/core",
    "drain/store",
    "drain/runner",
    "submit/raw",
    "submit/core",
    "submit/store",
    "status/raw",
    "status/core",
    "status/store",
    "status/runner",
    "memory/runner",
    "concurrent/runner",
    "concurrent/raw",
]
if _floors.has_writer():
    CASES.append("drain/writer")


@pytest.mark.parametrize("case", CASES)
def test_each_measurement_runs_at_toy_size(case: str, tmp_path: Path) -> None:
    """Every case the suite schedules produces positive numbers with the current store."""
    rows = _cases.run(_spec(tmp_path, case))
    assert rows
    for r in rows:
        assert r["backend"] == "sqlite"
        assert r["value"] >= 0
        if r["unit"] != "errors" and not r["row"].startswith("memory-rss/"):
            assert r["value"] > 0, r  # (RSS need not grow for a toy read)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_growth_prefill_and_measurement(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefilled store is made, reused, cleaned of the measurement's jobs (and, on
    PostgreSQL, vacuumed of them), and measured."""
    monkeypatch.setenv("BENCH_CACHE_DIR", str(tmp_path / "cache"))
    be = BACKENDS[backend]
    server = _bench_url(backend) if be.server else ""
    url = _prefill.growth_url(be, server, 100, str(tmp_path))
    made = _prefill.ensure(be, url, 100)
    assert made.startswith("prefilled" if not be.server else ("prefilled", "reused"))
    rows = _cases.run(Spec("growth/100", backend, url, TINY, str(tmp_path), {"prefill": 100}))
    assert {r["row"] for r in rows} == {
        "growth-drain/10^2",
        "growth-submit-p50/10^2",
        "growth-submit-p99/10^2",
    }
    assert _prefill.ensure(be, url, 100).startswith("reused")
    db = dcache.DB.open(url)
    try:
        assert db.live_batch_jobs_total() == 0
        assert len(db.list_jobs(limit=1000)) == 100 // 32 + 1  # the prefill only
    finally:
        db.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"])
def test_many_live_jobs_on_a_small_pool_keep_connections_constant(
    backend: str, tmp_path: Path
) -> None:
    """The connections rows at toy size, on every backend: all done, nothing logged, and
    the connections counted where they end stay within the pool's 4 plus 2."""
    rows = {
        r["row"]: r["value"] for r in _cases.run(_spec(tmp_path, "connections/runner", backend))
    }
    assert rows["connections/not-done"] == 0
    assert rows["connections/problems"] == 0
    assert 1 <= rows["connections/peak"] <= 6, rows
    assert rows["connections/throughput"] > 0


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_drains_run_on_the_servers_too(backend: str, tmp_path: Path) -> None:
    """Each way of draining gives its rate, and this process's CPU and context switches
    a target over it (a drain thread starts and ends for every job: some switches)."""
    spec = _spec(tmp_path, "concurrent/runner", backend)
    rows = {r["row"]: r for r in _cases.run(spec)}
    groups = ["concurrent-cpu", "concurrent-switches"]
    if backend == "postgresql":
        # A server on this machine (as CI's is): its processes' CPU is read too.
        engine = create_engine(spec.url)
        try:
            local = _cases._local_postgres(engine)
        finally:
            engine.dispose()
        assert local or not REQUIRE_SERVERS, "CI's PostgreSQL runs on this machine"
        groups += ["concurrent-server-cpu"] if local else []
    assert set(rows) == {
        "concurrent/single",
        "concurrent/2-drains",
        "concurrent/lock-errors",
        *(f"{g}/{way}" for g in groups for way in ("single", "2-drains")),
    }
    for way in ("single", "2-drains"):
        assert rows[f"concurrent/{way}"]["value"] > 0
        assert rows[f"concurrent-switches/{way}"]["unit"] == "per target"
        assert rows[f"concurrent-switches/{way}"]["value"] > 0
        for g in set(groups) - {"concurrent-switches"}:
            assert rows[f"{g}/{way}"]["unit"] == "µs/target"
            assert rows[f"{g}/{way}"]["value"] > 0


def test_a_local_servers_cpu_is_read_from_its_processes() -> None:
    """The server's CPU is the sum over PostgreSQL's processes alive at both readings;
    one that ended meanwhile is left out, not counted as a negative."""
    assert _cases._spent({1: 100, 2: 50, 3: 7}, {1: 160, 2: 50, 4: 999}) == 60
    readings = _cases._postgres_cpu_ns()
    if not readings and not REQUIRE_SERVERS:
        pytest.skip("no PostgreSQL server runs on this machine")
    assert readings, "CI's PostgreSQL runs on this machine: its processes are read"
    assert all(ns >= 0 for ns in readings.values())


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_raw_drivers_ceiling_runs_beside_the_drains(backend: str, tmp_path: Path) -> None:
    """The raw floor's writers, one connection at a time and all at once, each storing
    every target of its jobs done (the case counts them), set beside the single one."""
    rows = _cases.run(_spec(tmp_path, "concurrent/raw", backend))
    assert {r["row"] for r in rows} == {"concurrent/raw-single", "concurrent/raw-2-connections"}
    assert all(r["value"] > 0 and r["unit"] == "targets/s" for r in rows)


def test_the_raw_ceiling_is_reported_against_its_own_floor_before_the_drains() -> None:
    """In the table the raw driver's pair comes first, its N connections divided by its
    one, then the runner's pair divided by the runner's single drain; the issue's
    target is still the runner's N drains against its single drain."""
    rows = [
        {"row": name, "backend": "postgresql", "value": value, "unit": "targets/s"}
        for name, value in [
            ("concurrent/lock-errors", 0),
            ("concurrent/8-drains", 3000.0),
            ("concurrent/single", 1500.0),
            ("concurrent/raw-8-connections", 3600.0),
            ("concurrent/raw-single", 2000.0),
        ]
    ]
    table = _report.aggregate(rows, "10^3")
    assert [r["row"] for r in table] == [
        "concurrent/raw-single",
        "concurrent/raw-8-connections",
        "concurrent/single",
        "concurrent/8-drains",
        "concurrent/lock-errors",
    ]
    ratios = {r["row"]: r["ratio"] for r in table}
    assert ratios["concurrent/raw-single"] is None
    assert ratios["concurrent/raw-8-connections"] == pytest.approx(1.8)
    assert ratios["concurrent/8-drains"] == pytest.approx(2.0)
    assert "8 connections at once (ceiling)" in table[1]["what"]
    targets = {t["target"]: t for t in _report.targets(table, "10^3", "10^6")}
    assert targets["8-drains aggregate / single drain, postgresql"]["value"] == pytest.approx(2.0)


def test_the_drains_cpu_and_switches_follow_their_rates_against_the_single_drain() -> None:
    """The CPU (this process's, the server's) and context-switch rows come after the
    rates, each divided by its own single drain's, and no target is judged from them."""
    rows = [
        {"row": name, "backend": "postgresql", "value": value, "unit": unit}
        for name, value, unit in [
            ("concurrent-server-cpu/8-drains", 150.0, "µs/target"),
            ("concurrent-server-cpu/single", 200.0, "µs/target"),
            ("concurrent-switches/8-drains", 3.5, "per target"),
            ("concurrent-cpu/8-drains", 120.0, "µs/target"),
            ("concurrent/8-drains", 9000.0, "targets/s"),
            ("concurrent-switches/single", 0.5, "per target"),
            ("concurrent-cpu/single", 100.0, "µs/target"),
            ("concurrent/single", 10000.0, "targets/s"),
        ]
    ]
    table = _report.aggregate(rows, "10^3")
    assert [r["row"] for r in table] == [
        "concurrent/single",
        "concurrent/8-drains",
        "concurrent-cpu/single",
        "concurrent-cpu/8-drains",
        "concurrent-switches/single",
        "concurrent-switches/8-drains",
        "concurrent-server-cpu/single",
        "concurrent-server-cpu/8-drains",
    ]
    by_row = {r["row"]: r for r in table}
    assert by_row["concurrent-server-cpu/8-drains"]["ratio"] == pytest.approx(0.75)
    assert by_row["concurrent-cpu/single"]["ratio"] is None
    assert by_row["concurrent-cpu/8-drains"]["ratio"] == pytest.approx(1.2)
    assert by_row["concurrent-switches/8-drains"]["ratio"] == pytest.approx(7.0)
    assert by_row["concurrent-cpu/8-drains"]["what"] == (
        "drain throughput, this process's CPU a target (user + system): 8 drains at once"
    )
    assert "| 0.50 | 0.50\u20130.50 | per target | floor |" in _report.table(table)
    targets = [t["target"] for t in _report.targets(table, "10^3", "10^6")]
    assert targets == ["8-drains aggregate / single drain, postgresql"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_cancel_is_timed_alone_and_beside_writing_drains(backend: str, tmp_path: Path) -> None:
    rows = {r["row"]: r["value"] for r in _cases.run(_spec(tmp_path, "cancel/store", backend))}
    assert set(rows) == {
        "cancel-p50/idle",
        "cancel-p99/idle",
        "cancel-p50/2-drains",
        "cancel-p99/2-drains",
    }
    assert all(v > 0 for v in rows.values()), rows


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_spaced_polls_find_a_recently_used_connection_only_in_the_stores_order(
    backend: str, tmp_path: Path
) -> None:
    """With six connections idle and a read every 100 ms, the longest-idle connection
    (the floor's order) was idle past the pre-ping's window: pinged before every read but
    the first few; the store's order reuses the one just given back, never pinged."""
    rows = {}
    for variant in ("fifo", "lifo"):
        rows.update(
            {r["row"]: r for r in _cases.run(_spec(tmp_path, f"spaced/{variant}", backend))}
        )
    assert set(rows) == {
        "spaced-p50/fifo",
        "spaced-pings/fifo",
        "spaced-p50/lifo",
        "spaced-pings/lifo",
    }
    assert rows["spaced-pings/lifo"]["value"] == 0
    assert rows["spaced-pings/fifo"]["value"] > 0.3  # the first reads came within the window
    assert rows["spaced-p50/fifo"]["value"] > 0 and rows["spaced-p50/lifo"]["value"] > 0
    assert _report.floor_of("spaced-p50/lifo", backend, "10^3") == ("spaced-p50/fifo", backend)
    assert _report.floor_of("spaced-pings/fifo", backend, "10^3") is None
    assert _report.describe("spaced-pings/lifo") == (
        "DB.poll_job every 100 ms, 6 connections idle, pre-pings a read: "
        "connection given back last first (the store's pool)"
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"])
def test_wipe_empties_every_table_and_postgresql_gets_its_space_back(
    backend: str, tmp_path: Path
) -> None:
    """Each measurement starts from empty tables; on PostgreSQL the last run's rows leave
    no dead tuples behind (autovacuum may be off), so runs do not bloat the tables."""
    spec = _spec(tmp_path, "drain/store", backend)
    wipe(spec.url)
    long_ago = dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc)
    with dcache.DB.open(spec.url) as db:
        # Rows in every table: a failed job with its announcement queued (the outbox), and
        # a job that lapsed long ago, purged (a tombstone).
        for when in (None, long_ago):
            made = db.submit(
                job_id=new_id(),
                caller="smoke-" + new_id(),
                caller_class="smoke",
                idem_key="k" * 64,
                targets=[dcache.NewTarget(f"https://example.com/{i}") for i in range(3)],
                ttl=dt.timedelta(minutes=5),
                jobs_per_caller=1,
                jobs_total=100,
                now=when,
                notify_url="https://example.com/hook",
            )
            assert made.kind == "created" and made.job is not None
            assert db.fail_job(made.job.id, "x", now=when)
        assert db.purge_expired(now=long_ago + dt.timedelta(days=1)) == 1
    with dcache.DB.open(spec.url) as db, db.engine.connect() as conn:
        for table in ("batch_outbox", "batch_tombstone"):
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() >= 1, table
    wipe(spec.url)
    with dcache.DB.open(spec.url) as db, db.engine.connect() as conn:
        for table in (
            "batch_target",
            "batch_job",
            "batch_owner",
            "batch_outbox",
            "batch_tombstone",
        ):
            assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 0, table
        locks = conn.execute(text("SELECT name FROM batch_lock")).scalars().all()
        assert locks == ["global"]
        if backend == "postgresql":
            size = text("SELECT pg_relation_size('batch_target') + pg_relation_size('batch_job')")
            assert conn.execute(size).scalar() == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"])
@pytest.mark.parametrize("variant", ["raw", "core"])
def test_floors_leave_what_the_store_leaves(variant: str, backend: str, tmp_path: Path) -> None:
    """The hand-written floors do the store's writes: the store reads their job back done.

    On a server it shares the bench's database with whoever runs ``python -m bench``, so
    it neither empties nor drops tables there: its ids and caller are its own.
    """
    spec = _spec(tmp_path, "drain/" + variant, backend)
    if spec.be.server:
        dcache.DB.open(spec.url).close()  # the schema, if missing
        if stale_tables(spec.url):
            pytest.skip(f"stale tables at {spec.url}: `python -m bench` rebuilds them")
    else:
        wipe(spec.url)
    job, other, caller = new_id(), new_id(), "smoke-" + new_id()
    impl = _floors.make(variant, spec.be, spec.url)
    payload = payload_json(100)
    try:
        items = impl.prepare([f"https://example.com/{i}" for i in range(3)])
        assert impl.submit(job, caller, "k" * 64, items) == "created"
        assert impl.submit(other, caller, "k" * 64, items) == "reused"
        running = [impl.write_target(job, i, "done", payload) for i in range(3)]
        assert running == [True, True, False]
        assert impl.write_target(job, 0, "done", payload) is False  # compare-and-set
        assert len(impl.status(job)) == 3
    finally:
        impl.close()
    db = dcache.DB.open(spec.url)
    try:
        found = db.get_job_with_targets(job)
        assert found is not None
        row, targets = found
        assert (row.status, row.targets_done, row.targets_failed) == ("done", 3, 0)
        assert row.finished_at is not None and row.expires_at > row.updated_at
        assert [(t.status, t.result) for t in targets] == [("done", payload)] * 3
        assert db.get_job(other) is None
    finally:
        with db.engine.begin() as conn:
            conn.execute(text("DELETE FROM batch_target WHERE job_id = :j"), {"j": job})
            conn.execute(text("DELETE FROM batch_job WHERE id = :j"), {"j": job})
            conn.execute(text("DELETE FROM batch_lock WHERE name = :n"), {"n": "caller:" + caller})
        db.close()


@pytest.mark.skipif(importlib.util.find_spec("huey") is None, reason="huey is not installed")
def test_huey_comparison_runs(tmp_path: Path) -> None:
    """The optional Huey row still matches Huey's API."""
    rows = _cases.run(_spec(tmp_path, "drain/huey-nofsync"))
    assert rows[0]["value"] > 0


@pytest.mark.parametrize("loader", ["wrk", "python"])
def test_http_rows_run_under_gunicorn(loader: str, tmp_path: Path) -> None:
    """The HTTP rows (issue 12) start the app under gunicorn and load it (wrk, or Python)."""
    from bench import _http

    spec = _spec(tmp_path, "http/all", seconds=1, rounds=1, loader=loader)
    rows = _http.http(spec, "all")
    got = {r["row"]: r for r in rows}
    assert set(got) == {
        "http/floor",
        "http/get",
        "http/304",
        "http/brief",
        "http-rss/payload",
        "http-rss/one-result",
        "http-rss/get",
        "http-rss/content",
    }
    for name in ("http/floor", "http/get", "http/304", "http/brief"):
        assert got[name]["unit"] == "req/s" and got[name]["value"] > 0
    assert got["http-rss/payload"]["value"] == TINY.mem_targets * TINY.mem_result_bytes / 2**20
    assert got["http-rss/get"]["value"] >= 0 and got["http-rss/content"]["value"] >= 0


def test_cli_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    """``python -m bench`` runs a fresh process per measurement and repeat, and reports."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--backends",
            "sqlite",
            "--only",
            r"^drain/raw ",
            "--repeats",
            "1",
            "--jobs",
            "1",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| row | backend | median |" in proc.stdout
    doc = json.loads(out.read_text())
    rows = {(r["row"], r["backend"]): r for r in doc["rows"]}
    assert len(rows[("drain/raw", "sqlite")]["values"]) == 1
    assert rows[("drain/raw", "sqlite")]["median"] > 0


def test_lock_errors_are_judged_by_the_worst_repeat_of_any_backend() -> None:
    """The count's target takes the largest count seen, and only its own line: it once
    overwrote whichever target came last when SQLite's count was missing."""
    rows = [
        {"row": "concurrent/lock-errors", "backend": "sqlite", "value": v, "unit": "errors"}
        for v in (0, 0, 2)
    ] + [
        {"row": "concurrent/lock-errors", "backend": "postgresql", "value": 0, "unit": "errors"},
        {"row": "concurrent/single", "backend": "postgresql", "value": 10.0, "unit": "targets/s"},
        {"row": "concurrent/8-drains", "backend": "postgresql", "value": 30.0, "unit": "targets/s"},
    ]
    targets = {t["target"]: t for t in _report.targets(_report.aggregate(rows, "10^3"), "", "")}
    locked = targets["'database is locked' errors in concurrent drains (max over repeats)"]
    assert (locked["value"], locked["met"]) == (2, False)
    assert targets["8-drains aggregate / single drain, postgresql"]["value"] == 3.0
