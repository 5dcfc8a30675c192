"""The measurements. Each runs in its own fresh process and returns its rows.

A row is ``{"row": name, "backend": label, "value": number, "unit": unit}``; the parent
collects them over repeats and sets each beside its floor (see ``_report``). Setup and a
warm-up (one job, or a few calls) are never timed; the timed region is wall time.
"""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from bench import _floors, _http, _prefill
from bench._env import (
    TTL,
    Spec,
    Stopwatch,
    content,
    new_id,
    payload_json,
    percentile,
    remove_sqlite,
    target_urls,
    wipe,
)

Row = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent  # where ``python -m bench.worker`` works


def _row(name: str, backend: str, value: float, unit: str) -> Row:
    return {"row": name, "backend": backend, "value": value, "unit": unit}


def _fresh(spec: Spec) -> None:
    """An empty store at the spec's URL (a new SQLite file, or emptied server tables)."""
    wipe(spec.url)


def _count_done(url: str, job_ids: list[str]) -> int:
    from sqlalchemy import create_engine, func, select

    from dcache._schema import targets

    eng = create_engine(url)
    try:
        with eng.connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(targets)
                    .where(
                        targets.c.job_id.in_(job_ids),
                        targets.c.status == "done",
                        targets.c.result.is_not(None),
                    )
                ).scalar_one()
            )
    finally:
        eng.dispose()


# -- per-target serial drain ----------------------------------------------------------


def drain(spec: Spec, variant: str) -> list[Row]:
    """J jobs of T targets: submit, write each target in its own transaction, read back.

    The same workload for every variant; cost per target = timed wall time / (J * T).
    """
    p = spec.params
    if variant == "runner":
        per_target = _drain_runner(spec)
    elif variant.startswith("huey"):
        per_target = _drain_huey(spec, variant)
    else:
        _fresh(spec)
        per_target = _drain_impl(spec, _floors.make(variant, spec.be, spec.url), p.jobs)
    return [_row(f"drain/{variant}", spec.backend, per_target, "µs/target")]


def _drain_impl(spec: Spec, impl: Any, n_jobs: int, tag: str = "d") -> float:
    p = spec.params
    payload = payload_json(p.result_bytes)
    plan = [
        (new_id(), new_id() + new_id(), impl.prepare(target_urls(f"{tag}{j}", p.targets)))
        for j in range(n_jobs + 1)
    ]

    def one(job_id: str, idem: str, items: Any) -> None:
        kind = impl.submit(job_id, "bench", idem, items)
        if kind != "created":
            raise RuntimeError(f"submit said {kind!r}")
        for i in range(len(items)):
            impl.write_target(job_id, i, "done", payload)

    try:
        one(*plan[0])  # warm-up: connections, statement caches, prepared statements
        impl.status(plan[0][0])
        gc.collect()
        sw = Stopwatch()
        with sw:
            for job in plan[1:]:
                one(*job)
            for job_id, _, _ in plan[1:]:
                if not impl.status(job_id):
                    raise RuntimeError("status read found nothing")
    finally:
        impl.close()
    ids = [j[0] for j in plan[1:]]
    done = _count_done(spec.url, ids)
    if done != n_jobs * p.targets:
        raise RuntimeError(f"{done} of {n_jobs * p.targets} targets stored done")
    return sw.ns / 1e3 / (n_jobs * p.targets)


def _runner(spec: Spec, fetch: Callable[[Any], Any], **config: Any) -> tuple[Any, Any]:
    import batch
    import dcache

    db = dcache.DB.open(spec.url, synchronous=spec.be.synchronous)
    return db, batch.Runner(db, fetch, batch.Config(**config))


def _drain_runner(spec: Spec) -> float:
    import batch

    p = spec.params
    _fresh(spec)
    body = content(p.result_bytes)

    def fetch(_t: Any) -> batch.Result:
        return batch.Result(body)

    db, runner = _runner(spec, fetch)
    plan = [[{"url": u} for u in target_urls(f"r{j}", p.targets)] for j in range(p.jobs + 1)]
    ids: list[str] = []
    try:
        jid, _ = runner.submit("bench", "bench", plan[0])  # warm-up
        runner.wait(jid, timeout=120)
        runner.status(jid)
        gc.collect()
        sw = Stopwatch()
        with sw:
            for targets in plan[1:]:
                jid, _ = runner.submit("bench", "bench", targets)
                runner.wait(jid, timeout=p.timeout)
                ids.append(jid)
            for jid in ids:
                found = runner.status(jid)
                if found is None or found[0].status != "done":
                    raise RuntimeError(f"job {jid} did not end done: {found and found[0]}")
    finally:
        runner.close(timeout=30)
        db.close()
    return sw.ns / 1e3 / (p.jobs * p.targets)


def _drain_huey(spec: Spec, variant: str) -> float:
    """Huey's SqliteHuey as a comparison: enqueue T tasks, execute each, read results back.

    Executed in-process (``dequeue`` + ``execute``: what a consumer does, minus its
    polling), so this is Huey's own storage cost, the most favourable case for it.
    """
    from huey import RedisHuey, SqliteHuey

    p = spec.params
    if variant == "huey-redis":
        huey: Any = RedisHuey("dcache-bench", url=spec.url)
        huey.storage.flush_all()
    else:
        path = spec.url.split("sqlite:///", 1)[1]
        # fsync=False: synchronous=OFF (not durable); None: as shipped (SQLite's FULL).
        fsync = False if variant == "huey-nofsync" else None
        huey = SqliteHuey("bench", filename=path, fsync=fsync)
    body = content(p.result_bytes)

    @huey.task()
    def fetch(url: str) -> str:
        return body

    def one(urls: list[str]) -> list[Any]:
        handles = [fetch(u) for u in urls]
        for _ in urls:
            huey.execute(huey.dequeue())
        return handles

    plan = [target_urls(f"h{j}", p.targets) for j in range(p.jobs + 1)]
    for h in one(plan[0]):
        h.get(preserve=True)
    gc.collect()
    sw = Stopwatch()
    with sw:
        handles = [one(urls) for urls in plan[1:]]
        got = [h.get(preserve=True) for hs in handles for h in hs]
    if got != [body] * (p.jobs * p.targets):
        raise RuntimeError("huey lost results")
    if variant == "huey-redis":
        huey.storage.flush_all()
    else:
        huey.storage.close()
    return sw.ns / 1e3 / (p.jobs * p.targets)


# -- submit and status ----------------------------------------------------------------


def submit(spec: Spec, variant: str) -> list[Row]:
    """p50/p99 of one 32-target submit (lock rows, idempotency read, cap counts, inserts)."""
    _fresh(spec)
    impl = _floors.make(variant, spec.be, spec.url)
    try:
        samples = _submit_samples(spec, impl)
    finally:
        impl.close()
    return [
        _row(f"submit-p50/{variant}", spec.backend, percentile(samples, 50), "µs"),
        _row(f"submit-p99/{variant}", spec.backend, percentile(samples, 99), "µs"),
    ]


def _submit_samples(spec: Spec, impl: Any, tag: str = "s") -> list[float]:
    p = spec.params
    n_warm = 5
    plan = [
        (new_id(), new_id() + new_id(), impl.prepare(target_urls(f"{tag}{k}", p.targets)))
        for k in range(p.samples + n_warm)
    ]
    samples: list[float] = []
    gc.collect()
    for k, (job_id, idem, items) in enumerate(plan):
        t0 = time.perf_counter_ns()
        kind = impl.submit(job_id, "bench", idem, items)
        t1 = time.perf_counter_ns()
        if kind != "created":
            raise RuntimeError(f"submit said {kind!r}")
        impl.end_job(job_id)  # untimed: keeps the caps out of the way
        if k >= n_warm:
            samples.append((t1 - t0) / 1e3)
    return samples


def _stored_job(spec: Spec, n_targets: int, result: str, via: str = "store") -> str:
    """A finished job with ``n_targets`` results stored (untimed)."""
    impl = _floors.make(via, spec.be, spec.url)
    try:
        job_id = new_id()
        items = impl.prepare(target_urls("st", n_targets))
        if impl.submit(job_id, "bench", new_id(), items) != "created":
            raise RuntimeError("setup submit failed")
        for i in range(n_targets):
            impl.write_target(job_id, i, "done", result)
    finally:
        impl.close()
    return job_id


def status(spec: Spec, variant: str) -> list[Row]:
    """Median of one status read of a finished 32-target job with 1 KiB results."""
    p = spec.params
    _fresh(spec)
    job_id = _stored_job(spec, p.targets, payload_json(p.result_bytes))
    read, close = _reader(spec, variant)
    try:
        for _ in range(5):
            read(job_id)
        gc.collect()
        samples = []
        for _ in range(p.samples):
            t0 = time.perf_counter_ns()
            got = read(job_id)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if not got:
                raise RuntimeError("status read found nothing")
    finally:
        close()
    return [_row(f"status/{variant}", spec.backend, percentile(samples, 50), "µs")]


def _reader(spec: Spec, variant: str) -> tuple[Callable[[str], Any], Callable[[], None]]:
    if variant == "runner":
        db, runner = _runner(spec, lambda _t: None)

        def close() -> None:
            runner.close(timeout=10)
            db.close()

        return runner.status, close
    impl = _floors.make(variant, spec.be, spec.url)
    return impl.status, impl.close


# -- concurrency ----------------------------------------------------------------------


def _local_postgres(engine: Any) -> bool:
    """Whether a PostgreSQL engine's server runs on this machine, its processes' CPU
    readable here (a backend's own pid among those :func:`_postgres_cpu_ns` reads)."""
    from sqlalchemy import text

    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        return int(pid) in _postgres_cpu_ns()


def _postgres_cpu_ns() -> dict[int, int]:
    """Every PostgreSQL process's CPU time so far, in ns (``/proc/<pid>/schedstat``):
    the backends and the server's own workers (WAL writer, checkpointer and the rest)."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if Path(entry.path, "comm").read_text().strip() != "postgres":
                continue
            out[int(entry.name)] = int(Path(entry.path, "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
    return out


def _spent(before: dict[int, int], after: dict[int, int]) -> int:
    """The CPU the processes alive at both readings spent between them, in ns (the pooled
    connections' backends live through a measurement)."""
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


def concurrent(spec: Spec, variant: str) -> list[Row]:
    """N jobs draining at once vs the same N jobs drained one after another.

    Aggregate targets/s of each, interleaved twice; every "database is locked" the
    engine saw is counted (the runner would retry it silently).
    """
    if variant == "raw":
        return _concurrent_raw(spec)
    from sqlalchemy import event

    import batch

    p = spec.params
    _fresh(spec)
    body = content(p.result_bytes)

    def fetch(_t: Any) -> batch.Result:
        return batch.Result(body)

    n = p.concurrent
    db, runner = _runner(spec, fetch, jobs_total=max(8, n), jobs_per_caller=1)
    locked = [0]

    def on_error(ctx: Any) -> None:
        if "locked" in str(ctx.original_exception).lower():
            locked[0] += 1

    event.listen(db.engine, "handle_error", on_error)
    seq = iter(range(1_000_000))

    def targets() -> list[dict[str, str]]:
        return [{"url": u} for u in target_urls(f"c{next(seq)}", p.concurrent_targets)]

    # This process's CPU (user + system, every thread) and context switches (voluntary and
    # involuntary) over each way of draining: what the drains' hand-offs cost the process.
    # On SQLite that is all of the database's work too; on a server, only the client's.
    cpu = {"serial": 0.0, "together": 0.0}
    switches = {"serial": 0, "together": 0}
    # A PostgreSQL server on this machine: its processes' CPU too, so that the two sides'
    # CPU a target tell what two cores can give (a server elsewhere: left out).
    server = spec.be.kind == "postgresql" and _local_postgres(db.engine)
    server_ns = {"serial": 0, "together": 0}

    def measured(way: str, body: Callable[[], None]) -> float:
        s0 = _postgres_cpu_ns() if server else {}
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter_ns()
        body()
        elapsed = (time.perf_counter_ns() - t0) / 1e9
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if server:
            server_ns[way] += _spent(s0, _postgres_cpu_ns())
        cpu[way] += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        switches[way] += (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw)
        return elapsed

    def serial() -> None:
        for _ in range(n):
            jid, _ = runner.submit("solo", "bench", targets())
            runner.wait(jid, timeout=p.timeout)

    def together() -> None:
        ids = [runner.submit(f"caller{k}", "bench", targets())[0] for k in range(n)]
        for jid in ids:
            runner.wait(jid, timeout=p.timeout)

    try:
        jid, _ = runner.submit("solo", "bench", targets())  # warm-up
        runner.wait(jid, timeout=120)
        t_serial = t_together = 0.0
        for _ in range(2):
            t_serial += measured("serial", serial)
            t_together += measured("together", together)
        jobs = runner.jobs(limit=10_000)
        bad = [j for j in jobs if j.status != "done"]
        if bad:
            raise RuntimeError(f"{len(bad)} job(s) did not end done: {bad[0]}")
    finally:
        runner.close(timeout=30)
        db.close()
    total = 2 * n * p.concurrent_targets
    b, us = spec.backend, "µs/target"
    rows = [
        _row("concurrent/single", b, total / t_serial, "targets/s"),
        _row(f"concurrent/{n}-drains", b, total / t_together, "targets/s"),
        _row("concurrent/lock-errors", b, locked[0], "errors"),
    ]
    for way, name in (("serial", "single"), ("together", f"{n}-drains")):
        rows.append(_row(f"concurrent-cpu/{name}", b, cpu[way] / total * 1e6, us))
        rows.append(_row(f"concurrent-switches/{name}", b, switches[way] / total, "per target"))
        if server:
            rows.append(_row(f"concurrent-server-cpu/{name}", b, server_ns[way] / total / 1e3, us))
    return rows


def _concurrent_raw(spec: Spec) -> list[Row]:
    """The ceiling of the drain-throughput rows: the raw floor's statements (submit, then
    each target its own committed transaction) for the same N jobs of 32, one thread
    after another on one connection, then N threads at once, each on a connection of
    its own; interleaved twice, as the runner's. What the database and this machine give
    N writers that share nothing in the client: the runner's N drains, which share one
    writer connection and its commits, are set beside it in docs/performance.md.
    """
    p = spec.params
    _fresh(spec)
    payload = payload_json(p.result_bytes)
    n = p.concurrent
    stores = [_floors.make("raw", spec.be, spec.url) for _ in range(n)]
    seq = iter(range(1_000_000))
    ids: list[str] = []

    def one_job(store: Any, caller: str) -> None:
        job_id = new_id()
        items = store.prepare(target_urls(f"w{next(seq)}", p.concurrent_targets))
        kind = store.submit(job_id, caller, new_id(), items)
        if kind != "created":
            raise RuntimeError(f"submit said {kind!r}")
        for i in range(len(items)):
            store.write_target(job_id, i, "done", payload)
        ids.append(job_id)

    def serial() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            one_job(stores[0], "solo")
        return (time.perf_counter_ns() - t0) / 1e9

    def together() -> float:
        start = threading.Barrier(n + 1)
        failures: list[BaseException] = []

        def drain(k: int) -> None:
            try:
                start.wait()
                one_job(stores[k], f"caller{k}")
            except BaseException as exc:  # re-raised below
                failures.append(exc)

        threads = [threading.Thread(target=drain, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter_ns()
        for t in threads:
            t.join()
        elapsed = (time.perf_counter_ns() - t0) / 1e9
        if failures:
            raise RuntimeError(f"a raw writer failed: {failures[0]!r}") from failures[0]
        return elapsed

    try:
        for k, store in enumerate(stores):  # warm-up: connections, prepared statements
            one_job(store, f"caller{k}")
        ids.clear()
        gc.collect()
        t_serial = t_together = 0.0
        for _ in range(2):
            t_serial += serial()
            t_together += together()
    finally:
        for store in stores:
            store.close()
    total = 2 * n * p.concurrent_targets
    done = _count_done(spec.url, ids)
    if done != total * 2:
        raise RuntimeError(f"{done} of {total * 2} targets stored done")
    return [
        _row("concurrent/raw-single", spec.backend, total / t_serial, "targets/s"),
        _row(f"concurrent/raw-{n}-connections", spec.backend, total / t_together, "targets/s"),
    ]


# -- a cancel while drains write ----------------------------------------------------


def cancel(spec: Spec, variant: str) -> list[Row]:
    """A store's cancel of a live job (``DB.cancel``), one every 2 ms: with nothing else
    writing (the floor), then while eight drains write without a pause.

    A web app's cancel (or any other write of the store) meets the drains' batches: on
    SQLite, where one connection writes at a time, it waits for them to end.
    """
    import dcache

    p = spec.params
    _fresh(spec)
    db = dcache.DB.open(spec.url, synchronous=spec.be.synchronous)
    payload = payload_json(p.result_bytes)
    seq = iter(range(1_000_000))

    def new_job(caller: str) -> str:
        job_id = new_id()
        kind = db.submit(
            job_id=job_id,
            caller=caller,
            caller_class="bench",
            idem_key=new_id() + new_id(),
            targets=[
                dcache.NewTarget(u, "{}")
                for u in target_urls(f"x{next(seq)}", p.concurrent_targets)
            ],
            ttl=TTL,
            jobs_per_caller=1_000_000,
            jobs_total=1_000_000,
        ).kind
        if kind != "created":
            raise RuntimeError(f"submit said {kind!r}")
        return job_id

    def cancels(victims: list[str]) -> list[float]:
        samples = []
        for job_id in victims:
            t0 = time.perf_counter_ns()
            if not db.cancel(job_id):
                raise RuntimeError(f"job {job_id} was not cancelled")
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            time.sleep(0.002)
        return samples

    stop = threading.Event()
    failures: list[BaseException] = []

    def drain(n: int) -> None:
        try:
            with db.writer() as writer:
                while not stop.is_set():
                    job_id = new_job(f"d{n}")
                    for idx in range(p.concurrent_targets):
                        writer.write_target(job_id, idx, status="done", result=payload, ttl=TTL)
        except BaseException as exc:  # re-raised below
            failures.append(exc)

    drains = [threading.Thread(target=drain, args=(n,)) for n in range(p.concurrent)]
    try:
        warm = 3  # warm-up: connections, statement caches
        victims = [new_job("victim") for _ in range(warm + 2 * p.samples)]
        cancels(victims[:warm])
        idle = cancels(victims[warm : warm + p.samples])
        for t in drains:
            t.start()
        time.sleep(0.2)  # the drains are under way
        busy = cancels(victims[warm + p.samples :])
    finally:
        stop.set()
        for t in drains:
            if t.ident is not None:  # started
                t.join(60)
        db.close()
    if failures:
        raise RuntimeError(f"a drain failed: {failures[0]!r}") from failures[0]
    busy_name = f"{p.concurrent}-drains"
    return [
        _row("cancel-p50/idle", spec.backend, percentile(idle, 50), "µs"),
        _row("cancel-p99/idle", spec.backend, percentile(idle, 99), "µs"),
        _row(f"cancel-p50/{busy_name}", spec.backend, percentile(busy, 50), "µs"),
        _row(f"cancel-p99/{busy_name}", spec.backend, percentile(busy, 99), "µs"),
    ]


# -- reads spaced out -------------------------------------------------------------------

SPACED_GAP = 0.1  # seconds between two reads
SPACED_IDLE = 6  # connections idle in the pool, as six request threads leave them


def spaced(spec: Spec, variant: str) -> list[Row]:
    """A keyed read (``DB.poll_job``, a conditional poll's) every 100 ms with six
    connections idle in the pool, as in a web app between bursts of requests.

    ``lifo``: the store as opened, whose pool hands out the connection given back last;
    ``fifo`` (the floor): the same store with ``pool_use_lifo=False``, SQLAlchemy's default
    order, which takes the longest-idle connection (idle 0.6 s here). The rows: the
    read's p50, and the pool's pre-pings a read (a server's connection is pinged before
    use unless it was used in the last half second).
    """
    import dcache
    from dcache._engine import RecentPing

    p = spec.params
    reads = max(10, min(p.samples, 40))
    options = {"pool_use_lifo": False} if variant == "fifo" else {}
    _fresh(spec)
    job_id = _stored_job(spec, 1, payload_json(p.result_bytes))
    db = dcache.DB.open(spec.url, **options)
    try:
        held = [db.engine.raw_connection() for _ in range(SPACED_IDLE)]
        for conn in held:
            conn.close()
        recent = db.engine.dialect.do_ping
        if not isinstance(recent, RecentPing):
            raise RuntimeError(f"the pool's pre-ping is not the store's: {recent!r}")
        real = recent.ping
        pings = 0

        def counted(dbapi_conn: Any) -> bool:
            nonlocal pings
            pings += 1
            return bool(real(dbapi_conn))

        recent.ping = counted
        samples = []
        for _ in range(reads):
            time.sleep(SPACED_GAP)
            t0 = time.perf_counter_ns()
            if db.poll_job(job_id) is None:
                raise RuntimeError(f"job {job_id} not found")
            samples.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        db.close()
    return [
        _row(f"spaced-p50/{variant}", spec.backend, percentile(samples, 50), "µs"),
        _row(f"spaced-pings/{variant}", spec.backend, pings / reads, "per read"),
    ]


# -- connections ----------------------------------------------------------------------


def _connection_counter(spec: Spec) -> Callable[[], int]:
    """How many connections the store has open right now, counted where they end.

    Servers: the sessions on the bench database, from the server's own view (the
    counter's own session left out). SQLite: this process's open descriptors of the
    database file (one per connection).
    """
    import os

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    if not spec.be.server:
        path = os.path.realpath(make_url(spec.url).database or "")

        def count_fds() -> int:
            n = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    n += os.path.realpath(f"/proc/self/fd/{fd}") == path
                except OSError:
                    continue
            return n

        return count_fds
    engine = create_engine(spec.url, pool_size=1, max_overflow=0)
    if spec.be.kind == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    else:
        sql = (
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
            "WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
        )
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def count_sessions() -> int:
        return int(conn.execute(text(sql)).scalar_one())

    return count_sessions


def connections(spec: Spec, variant: str) -> list[Row]:
    """Many live jobs in one process on a small pool: connections stay a small constant.

    ``live_jobs`` jobs of ``live_targets`` targets, each fetch sleeping ``live_fetch_ms``,
    all submitted at once to one runner whose store has ``pool_size=4, max_overflow=0``.
    Drains hold no connection (the store's group writer writes for them), so every job
    must end ``done`` with no checkout timeout, nothing reaped, and the connections the
    server sees must stay at the pool's 4 plus the heartbeat's and the writer's one each.
    """
    import logging

    import batch
    import dcache

    p = spec.params
    _fresh(spec)
    pause = p.live_fetch_ms / 1000

    def fetch(_t: Any) -> batch.Result:
        time.sleep(pause)
        return batch.Result("ok")

    problems: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            problems.append(record.getMessage())

    handler = Count(logging.WARNING)
    for name in ("batch", "dcache"):
        logging.getLogger(name).addHandler(handler)
    db = dcache.DB.open(
        spec.url, synchronous=spec.be.synchronous, pool_size=4, max_overflow=0, pool_timeout=5
    )
    cfg = batch.Config(jobs_total=p.live_jobs, jobs_per_caller=p.live_jobs)
    runner = batch.Runner(db, fetch, cfg)
    count = _connection_counter(spec)
    peak = [count()]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], count())
            stop.wait(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.perf_counter_ns()
        ids = [
            runner.submit(
                f"c{j % 16}", "bench", [{"url": u} for u in target_urls(f"l{j}", p.live_targets)]
            )[0]
            for j in range(p.live_jobs)
        ]
        finals = [runner.wait(jid, timeout=p.timeout) for jid in ids]
        elapsed = (time.perf_counter_ns() - t0) / 1e9
    finally:
        stop.set()
        watcher.join(5)
        runner.close(timeout=30)
        db.close()
        for name in ("batch", "dcache"):
            logging.getLogger(name).removeHandler(handler)
    not_done = sum(1 for f in finals if f is None or f.status != "done")
    total = p.live_jobs * p.live_targets
    return [
        _row("connections/peak", spec.backend, peak[0], "connections"),
        _row("connections/not-done", spec.backend, not_done, "jobs"),
        _row("connections/problems", spec.backend, len(problems), "warnings"),
        _row("connections/throughput", spec.backend, total / elapsed, "targets/s"),
    ]


# -- growth ---------------------------------------------------------------------------


def growth_label(n: int) -> str:
    exp = len(str(n)) - 1
    return f"10^{exp}" if n == 10**exp else str(n)


def growth(spec: Spec, variant: str) -> list[Row]:
    """Per-target drain and submit cost of our store with ``n`` targets already stored."""
    n = int(spec.extra["prefill"])
    _prefill.clean(spec.be, spec.url)
    # The runner's write path: a held-connection writer where the store has one.
    impl = _floors.make("writer" if _floors.has_writer() else "store", spec.be, spec.url)
    per_target = _drain_impl(spec, impl, spec.params.jobs, tag="g")
    impl = _floors.make("store", spec.be, spec.url)
    try:
        samples = _submit_samples(spec, impl, tag="gs")
    finally:
        impl.close()
    _prefill.clean(spec.be, spec.url)
    label = growth_label(n)
    return [
        _row(f"growth-drain/{label}", spec.backend, per_target, "µs/target"),
        _row(f"growth-submit-p50/{label}", spec.backend, percentile(samples, 50), "µs"),
        _row(f"growth-submit-p99/{label}", spec.backend, percentile(samples, 99), "µs"),
    ]


def prepare_growth(spec: Spec, variant: str) -> list[Row]:
    """Not a measurement: make sure the growth store holds its prefill."""
    n = int(spec.extra["prefill"])
    t0 = time.monotonic()
    what = _prefill.ensure(spec.be, spec.url, n)
    return [{"note": f"{spec.backend}: {what} in {time.monotonic() - t0:.1f} s"}]


# -- memory ---------------------------------------------------------------------------


def memory(spec: Spec, variant: str) -> list[Row]:
    """Peak memory of one status read of M targets with 1 MiB results each.

    ``memory/<variant>``: tracemalloc's peak of Python allocations during the read.
    ``memory-rss/<variant>``: growth of the process's peak RSS over the RSS just before
    the read; it also sees the drivers' C buffers (libpq, for one) that tracemalloc misses.
    The job is stored by a helper process so this one starts small.
    """
    p = spec.params
    _fresh(spec)
    child = attrs.evolve(spec, case="memory-setup", extra={})
    out = subprocess.run(
        [sys.executable, "-m", "bench.worker"],
        input=child.to_json(),
        capture_output=True,
        text=True,
        timeout=p.timeout,
        check=True,
        cwd=str(ROOT),
    )
    job_id = out.stdout.strip().splitlines()[-1]
    read, close = _reader(spec, variant)
    try:
        gc.collect()
        rss0 = _rss_now()
        tracemalloc.start()
        got = read(job_id)
        _cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if not got:
            raise RuntimeError("status read found nothing")
        del got
    finally:
        close()
    mib = 1 << 20
    payload = p.mem_targets * p.mem_result_bytes / mib
    return [
        _row("memory/payload", spec.backend, payload, "MiB"),
        _row(f"memory/{variant}", spec.backend, peak / mib, "MiB"),
        _row(f"memory-rss/{variant}", spec.backend, max(0, rss_peak - rss0) / mib, "MiB"),
    ]


def memory_setup(spec: Spec) -> str:
    p = spec.params
    # Through the raw floor: the same rows (the smoke test checks it), written faster.
    return _stored_job(spec, p.mem_targets, payload_json(p.mem_result_bytes), via="raw")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the fetch path ---------------------------------------------------------------------

_PAGE_SERVER = """
import http.server, sys
BODY = b"x" * 1024
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(BODY)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
s.daemon_threads = True
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def fetch(spec: Spec, variant: str) -> list[Row]:
    """Median of one GET of a 1 KiB page from a server process on 127.0.0.1.

    ``http.client`` (the floor): a connection, the request, the whole body read and
    decoded, the connection closed. ``fetcher``: the library's ``Fetcher`` with the
    loopback address allowed: the same, plus the address guard, the deadline and the cap.
    """
    import http.client

    import batch
    from batch.fetchers import Fetcher

    server = subprocess.Popen(
        [sys.executable, "-c", _PAGE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/page"
        if variant == "http.client":

            def one() -> int:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    conn.request("GET", "/page", headers={"Connection": "close"})
                    resp = conn.getresponse()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                    return len(resp.read().decode("utf-8"))
                finally:
                    conn.close()

        else:
            fetcher = Fetcher(allow=["127.0.0.1"])
            target = batch.Target(url)

            def one() -> int:
                return len(fetcher(target).content)

        for _ in range(20):
            one()
        gc.collect()
        samples = []
        for _ in range(spec.params.samples):
            t0 = time.perf_counter_ns()
            got = one()
            samples.append((time.perf_counter_ns() - t0) / 1e3)
            if got != 1024:
                raise RuntimeError(f"fetched {got} characters, not 1024")
    finally:
        server.kill()
        server.wait(10)
    return [_row(f"fetch/{variant}", spec.backend, percentile(samples, 50), "µs")]


CASES: dict[str, Callable[[Spec, str], list[Row]]] = {
    "http": _http.http,
    "fetch": fetch,
    "drain": drain,
    "submit": submit,
    "status": status,
    "concurrent": concurrent,
    "cancel": cancel,
    "spaced": spaced,
    "connections": connections,
    "growth": growth,
    "prepare": prepare_growth,
    "memory": memory,
}


def run(spec: Spec) -> list[Row]:
    """Run one measurement named ``group/variant`` (e.g. ``drain/raw``)."""
    group, _, variant = spec.case.partition("/")
    try:
        return CASES[group](spec, variant)
    finally:
        if spec.be.kind == "sqlite" and spec.extra.get("fresh_file"):
            remove_sqlite(spec.url)
