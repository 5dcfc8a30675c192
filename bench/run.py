"""``python -m bench``: plan the measurements, run them interleaved, print the table.

Every measurement runs in a fresh process (``python -m bench.worker``); each repeat runs
all of them once, in a new random order, so a noisy machine hits every row alike. Rows
are medians over the repeats, with min-max, and each is divided by its floor.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from bench import _report
from bench._env import (
    BACKENDS,
    SQL_BACKENDS,
    Params,
    Spec,
    reachable,
    redis_reachable,
    redis_url,
    server_urls,
)
from bench.worker import MARK

DRAIN = ["raw", "core", "store", "writer", "runner"]
SUBMIT = ["raw", "core", "store"]
STATUS = ["raw", "core", "store", "runner"]
MEMORY = ["raw", "store", "runner"]
FETCH = ["http.client", "fetcher"]
SPACED = ["fifo", "lifo"]
GROWTH_BACKENDS = ["sqlite", "postgresql"]
HTTP_BACKENDS = ["sqlite", "postgresql"]  # the HTTP rows (issue 12): gunicorn + wrk


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark the batch runner and its store against their floors.",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a fast pass (about a minute on an idle 2-core machine): one repeat, J=4, "
        "30 samples, 12 measurements per process, memory of the runner only, growth at 10^5",
    )
    ap.add_argument("--repeats", type=int, help="runs of every measurement (default 5; quick 1)")
    ap.add_argument(
        "--only",
        metavar="PATTERN",
        help="regex on 'case backend', e.g. 'drain/(raw|runner) sqlite$' or 'postgresql'",
    )
    ap.add_argument(
        "--json", metavar="PATH", help="write every value, the table and the targets as JSON"
    )
    ap.add_argument(
        "--backends",
        default=",".join(SQL_BACKENDS),
        help=f"comma-separated subset of {','.join(SQL_BACKENDS)} (servers that do not "
        "answer are skipped)",
    )
    ap.add_argument(
        "--redis-url",
        help="Redis for the optional Huey-on-Redis row (default $BENCH_REDIS_URL or "
        "redis://127.0.0.1:6379/15; left out when it does not answer)",
    )
    ap.add_argument(
        "--postgres-url",
        help="default $BENCH_POSTGRES_URL or "
        "postgresql+psycopg://postgres@127.0.0.1:5432/test_bench",
    )
    ap.add_argument(
        "--mysql-url",
        help="default $BENCH_MYSQL_URL or "
        "mysql+pymysql://root@127.0.0.1:3306/test_bench?charset=utf8mb4",
    )
    ap.add_argument(
        "--prefill",
        type=int,
        help="targets stored before the large growth "
        "measurement (default 10^6; quick 10^5; 0 leaves growth out)",
    )
    ap.add_argument("--jobs", type=int, help="J, jobs per drain measurement (default 20)")
    ap.add_argument("--samples", type=int, help="calls per submit/status measurement")
    ap.add_argument("--mem-mib", type=float, help="MiB per result in the memory rows (1)")
    ap.add_argument("--no-huey", action="store_true", help="leave out the Huey rows")
    ap.add_argument("--workdir", help="where the SQLite files go (default: a new temp dir)")
    ap.add_argument(
        "--pack",
        type=int,
        help="measurements per process (default 1: each its own; quick: 8, to save the "
        "imports; memory rows always alone)",
    )
    ap.add_argument("--seed", type=int, help="seed of the shuffled order")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    ap.add_argument("-v", "--verbose", action="store_true", help="show each measurement")
    return ap.parse_args(argv)


def params_for(args: argparse.Namespace) -> Params:
    p = Params(timeout=args.timeout)
    if args.quick:
        p.jobs, p.samples, p.prefill = 4, 30, 100_000
    if args.jobs is not None:
        p.jobs = args.jobs
    if args.samples is not None:
        p.samples = args.samples
    if args.prefill is not None:
        p.prefill = args.prefill
    if args.mem_mib is not None:
        p.mem_result_bytes = int(args.mem_mib * (1 << 20))
    return p


def plan(
    args: argparse.Namespace, p: Params, urls: dict[str, str], notes: list[str]
) -> list[tuple[str, str]]:
    """Every (case, backend) to measure, filtered by the flags and what answers."""
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in wanted:
        if b not in SQL_BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; choose from {', '.join(SQL_BACKENDS)}")
    up = []
    for b in wanted:
        be = BACKENDS[b]
        if be.server:
            why = reachable(be.kind, urls[b])
            if why is not None:
                shown = make_url(urls[b]).render_as_string(hide_password=True)
                notes.append(f"{b} skipped: {shown} does not answer ({why})")
                continue
        up.append(b)
    from bench._floors import has_writer

    drain = [v for v in DRAIN if v != "writer" or has_writer()]
    if "writer" not in drain:
        notes.append("drain/writer left out: this dcache has no DB.writer()")
    cases: list[tuple[str, str]] = []
    for b in up:
        cases += [(f"drain/{v}", b) for v in drain]
    huey = not args.no_huey and importlib.util.find_spec("huey") is not None
    if not args.no_huey and not huey:
        notes.append("Huey rows left out: `pip install huey` to compare with SqliteHuey")
    if huey:
        if "sqlite" in up:
            cases.append(("drain/huey-nofsync", "sqlite"))
        if "sqlite-full" in up:
            cases.append(("drain/huey-shipped", "sqlite-full"))
        why = redis_reachable(urls["redis"])
        if why is None:
            cases.append(("drain/huey-redis", "redis"))
        else:
            notes.append(f"Huey-on-Redis row left out: {urls['redis']}: {why}")
    for b in up:
        if b == "sqlite-full":
            continue  # submit, status and memory do not depend on synchronous
        cases += [(f"submit/{v}", b) for v in SUBMIT]
        cases += [(f"status/{v}", b) for v in STATUS]
        # Quick: only the runner's read, the one issue 6 judges (each costs seconds).
        cases += [(f"memory/{v}", b) for v in (["runner"] if args.quick else MEMORY)]
    cases += [
        (f"concurrent/{v}", b)
        for b in ("sqlite", "postgresql")
        if b in up
        for v in ("raw", "runner")
    ]
    cases += [("cancel/store", b) for b in ("sqlite", "postgresql") if b in up]
    cases += [(f"spaced/{v}", b) for b in ("postgresql", "mariadb") if b in up for v in SPACED]
    cases += [("connections/runner", b) for b in ("sqlite", "postgresql", "mariadb") if b in up]
    cases += [(f"fetch/{v}", "loopback") for v in FETCH]
    cases += [("http/all", b) for b in HTTP_BACKENDS if b in up]
    if p.prefill > 0:
        for b in GROWTH_BACKENDS:
            if b in up:
                cases += [(f"growth/{n}", b) for n in (p.prefill_small, p.prefill)]
    elif p.prefill == 0:
        notes.append("growth rows left out (--prefill 0)")
    chosen = set(_report.select(args.only, [f"{c} {b}" for c, b in cases]))
    return [(c, b) for c, b in cases if f"{c} {b}" in chosen]


def spec_for(
    case: str, backend: str, p: Params, urls: dict[str, str], workdir: str, n: int
) -> Spec:
    be = BACKENDS[backend]
    extra: dict[str, Any] = {}
    if case.startswith(("growth/", "prepare/")):
        from bench._prefill import growth_url

        size = int(case.split("/", 1)[1])
        extra["prefill"] = size
        url = growth_url(be, urls.get(backend, ""), size, workdir)
    elif be.server:
        url = urls[backend]  # a server database, or Redis for the Huey row
        if case.startswith("http/"):
            extra["quick"] = p.jobs <= 4
    else:
        slug = case.replace("/", "-")
        url = f"sqlite:///{Path(workdir) / f'{n:04d}-{slug}-{backend}.sqlite3'}"
        extra["fresh_file"] = True
        if case.startswith("http/"):
            extra["quick"] = p.jobs <= 4
    return Spec(case=case, backend=backend, url=url, params=p, workdir=workdir, extra=extra)


def run_many(specs: list[Spec]) -> list[tuple[list[dict[str, Any]], str | None, float]]:
    """Run measurements in one fresh process: (rows, error, seconds) for each."""
    t0 = time.monotonic()
    timeout = sum(s.params.timeout for s in specs)
    payload = json.dumps([json.loads(s.to_json()) for s in specs])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.worker"],
            input=payload,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
    except subprocess.TimeoutExpired:
        err = f"timed out after {timeout:.0f} s"
        return [([], err, time.monotonic() - t0) for _ in specs]
    got: dict[int, tuple[list[dict[str, Any]], str | None, float]] = {}
    for ln in proc.stdout.splitlines():
        if ln.startswith(MARK):
            out = json.loads(ln[len(MARK) :])
            err = str(out["error"]) if "error" in out else None
            got[int(out["index"])] = (list(out.get("rows", [])), err, float(out["seconds"]))
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    return [got.get(i, ([], f"exit {proc.returncode}: {tail}", 0.0)) for i in range(len(specs))]


def run_one(spec: Spec) -> tuple[list[dict[str, Any]], str | None, float]:
    """Run one measurement in a fresh process: (rows, error, seconds)."""
    return run_many([spec])[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = params_for(args)
    repeats = args.repeats or (1 if args.quick else 5)
    pack = args.pack or (12 if args.quick else 1)
    urls = server_urls(args.postgres_url, args.mysql_url)
    urls["redis"] = redis_url(args.redis_url)
    urls["loopback"] = "http://127.0.0.1"  # the fetch rows' page server (started per row)
    notes: list[str] = []
    cases = plan(args, p, urls, notes)
    if not cases:
        print("nothing to run (check --only and --backends)", file=sys.stderr)
        return 2
    own_workdir = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="dcache-bench-") if own_workdir else args.workdir
    Path(workdir).mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    started = time.monotonic()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        growth = sorted({(c, b) for c, b in cases if c.startswith("growth/")})
        for c, b in growth:  # untimed: make (or reuse) each growth store first
            spec = spec_for(c.replace("growth/", "prepare/"), b, p, urls, workdir, 0)
            rows, err, took = run_one(spec)
            if err:
                notes.append(f"{c} {b}: prefill failed: {err}")
                cases = [(c2, b2) for c2, b2 in cases if (c2, b2) != (c, b)]
            else:
                log(f"prepare {c} {b}: {rows[0]['note']}")
        n = 0
        for rep in range(repeats):
            # Peak memory is deterministic: measured in the first repeat only.
            order = [cb for cb in cases if rep == 0 or not cb[0].startswith("memory/")]
            # (The HTTP rows run every repeat: their memory rows are cheap beside the load.)
            rng.shuffle(order)
            # Fresh process per measurement; --pack N shares one among up to N of them
            # (never a memory row: its RSS baseline needs a process of its own).
            groups: list[list[tuple[str, str]]] = []
            for cb in order:
                alone = cb[0].startswith(("memory/", "http/"))
                if (
                    groups
                    and not alone
                    and len(groups[-1]) < pack
                    and not groups[-1][0][0].startswith(("memory/", "http/"))
                ):
                    groups[-1].append(cb)
                else:
                    groups.append([cb])
            done = 0
            for group in groups:
                specs = []
                for c, b in group:
                    n += 1
                    specs.append(spec_for(c, b, p, urls, workdir, n))
                for (c, b), (rows, err, took) in zip(group, run_many(specs), strict=True):
                    done += 1
                    status = "error: " + err if err else f"{took:.1f} s"
                    if args.verbose or err:
                        log(f"[{rep + 1}/{repeats} {done}/{len(order)}] {c} {b}: {status}")
                    if err:
                        errors.append({"case": c, "backend": b, "repeat": rep, "error": err})
                    for r in rows:
                        r["repeat"] = rep
                    results.extend(rows)
            log(f"repeat {rep + 1}/{repeats} done at {time.monotonic() - started:.0f} s")
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    from bench._cases import growth_label

    small, large = growth_label(p.prefill_small), growth_label(p.prefill)
    rows = _report.aggregate(results, small)
    goals = _report.targets(rows, small, large)
    text = _report.table(rows)
    print(text)
    if goals:
        print()
        print(_report.targets_table(goals))
    for note in notes:
        print(f"\nnote: {note}")
    for e in errors:
        print(f"\nerror: {e['case']} {e['backend']} (repeat {e['repeat'] + 1}): {e['error']}")
    print(
        f"\n{repeats} repeat(s), {len(cases)} measurements each, "
        f"{time.monotonic() - started:.0f} s; J={p.jobs} jobs x {p.targets} targets, "
        f"{p.result_bytes} B results; {p.samples} samples per submit/status; "
        f"growth {small} vs {large}; {os.cpu_count()} CPUs, load {_load()}."
    )
    if args.json:
        doc = {
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_after": _load(),
            },
            "argv": sys.argv[1:] if argv is None else argv,
            "repeats": repeats,
            "params": p.to_json(),
            "rows": rows,
            "targets": goals,
            "notes": notes,
            "errors": errors,
            "raw": results,
            "table": text,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return 1 if errors else 0


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"
