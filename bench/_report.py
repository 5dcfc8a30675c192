"""Collect rows over repeats, set each beside its floor, and print the table."""

from __future__ import annotations

import re
import statistics
from typing import Any

# What the drain-throughput case measures beside its rates, each against its single drain.
DRAIN_COSTS = {
    "concurrent-cpu": "this process's CPU a target (user + system)",
    "concurrent-switches": "this process's context switches a target",
    "concurrent-server-cpu": "the local server's CPU a target (all its processes)",
}

# Row groups in table order, with the variants of each in order.
ORDER = [
    "drain",
    "submit-p50",
    "submit-p99",
    "status",
    "concurrent",
    *DRAIN_COSTS,
    "cancel-p50",
    "cancel-p99",
    "spaced-p50",
    "spaced-pings",
    "growth-drain",
    "growth-submit-p50",
    "growth-submit-p99",
    "memory",
    "memory-rss",
    "fetch",
    "http",
    "http-rss",
]
VARIANTS = [
    "raw",
    "core",
    "store",
    "writer",
    "runner",
    "huey-nofsync",
    "huey-shipped",
    "huey-redis",
    "payload",
    "single",
    "idle",
    "fifo",
    "lifo",
    "http.client",
    "fetcher",
    "floor",
    "get",
    "304",
    "brief",
    "one-result",
    "content",
]
BACKEND_ORDER = ["sqlite", "sqlite-full", "postgresql", "mariadb", "redis", "loopback"]

LABELS = {
    "raw": "raw driver, same SQL (floor)",
    "core": "naive SQLAlchemy Core",
    "store": "dcache.DB.write_target per call",
    "writer": "dcache.DB.writer() (held connection)",
    "runner": "batch.Runner (submit, drain, wait, status)",
    "huey-nofsync": "Huey SqliteHuey fsync=False (sync OFF)",
    "huey-shipped": "Huey SqliteHuey as shipped (sync FULL)",
    "huey-redis": "Huey RedisHuey (memory only, not durable)",
    "payload": "payload (floor)",
    "single": "1 drain at a time (floor)",
}
HIGHER_IS_BETTER = {"targets/s", "req/s"}


def floor_of(row: str, backend: str, small_label: str) -> tuple[str, str] | None:
    """The (row, backend) a row is divided by, or None for a floor or a count."""
    group, _, variant = row.partition("/")
    if group == "drain":
        if variant == "raw":
            return None
        if variant == "huey-nofsync":
            return "drain/raw", "sqlite"
        if variant == "huey-shipped":
            return "drain/raw", "sqlite-full"
        if variant == "huey-redis":
            return "drain/raw", "sqlite"  # no floor of its own: set beside SQLite's
        return "drain/raw", backend
    if group in ("submit-p50", "submit-p99", "status"):
        return None if variant == "raw" else (f"{group}/raw", backend)
    if group == "concurrent":
        if variant in ("single", "raw-single", "lock-errors"):
            return None
        if variant.startswith("raw-"):
            return "concurrent/raw-single", backend
        return "concurrent/single", backend
    if group in DRAIN_COSTS:
        return None if variant == "single" else (f"{group}/single", backend)
    if group in ("cancel-p50", "cancel-p99"):
        return None if variant == "idle" else (f"{group}/idle", backend)
    if group in ("spaced-p50", "spaced-pings"):
        return None if variant == "fifo" else (f"{group}/fifo", backend)
    if group.startswith("growth-"):
        return None if variant == small_label else (f"{group}/{small_label}", backend)
    if group in ("memory", "memory-rss"):
        return None if variant == "payload" else ("memory/payload", backend)
    if group == "fetch":
        return None if variant == "http.client" else ("fetch/http.client", backend)
    if group == "http":
        return {
            "get": ("http/floor", backend),
            "304": ("http/get", backend),
            "brief": ("http/get", backend),
        }.get(variant)
    if group == "http-rss":
        if variant == "get":
            return "http-rss/payload", backend
        if variant == "content":
            return "http-rss/one-result", backend
    return None


SUBMIT_LABELS = {
    "raw": "raw driver, same SQL (floor)",
    "core": "naive SQLAlchemy Core",
    "store": "dcache.DB.submit",
}
STATUS_LABELS = {
    "raw": "raw driver, same SQL (floor)",
    "core": "naive SQLAlchemy Core",
    "store": "dcache.DB.get_job_with_targets",
    "runner": "batch.Runner.status (values decoded)",
}


def describe(row: str) -> str:
    group, _, variant = row.partition("/")
    if group == "drain":
        return f"drain, per target: {LABELS.get(variant, variant)}"
    if group.startswith("submit"):
        return f"submit of 32 targets, {group[7:]}: {SUBMIT_LABELS.get(variant, variant)}"
    if group == "status":
        return f"status of 32 targets: {STATUS_LABELS.get(variant, variant)}"
    if group == "connections":
        return {
            "peak": "256 live jobs, pool 4+0: peak connections (server's count)",
            "not-done": "256 live jobs, pool 4+0: jobs not done",
            "problems": "256 live jobs, pool 4+0: warnings/errors logged",
            "throughput": "256 live jobs, pool 4+0: targets/s",
        }.get(variant, row)
    if group == "concurrent":
        if variant == "lock-errors":
            return "concurrent drains: 'database is locked' seen"
        if variant == "single":
            return "drain throughput: 1 drain at a time (floor)"
        if variant == "raw-single":
            return "drain throughput: raw driver, same SQL, 1 connection at a time (floor)"
        if variant.startswith("raw-"):
            n = variant.split("-")[1]
            return f"drain throughput: raw driver, same SQL, {n} connections at once (ceiling)"
        return f"drain throughput: {variant.replace('-', ' ')} at once (batch.Runner)"
    if group in DRAIN_COSTS:
        what = DRAIN_COSTS[group]
        if variant == "single":
            return f"drain throughput, {what}: 1 drain at a time (floor)"
        return f"drain throughput, {what}: {variant.replace('-', ' ')} at once"
    if group.startswith("cancel-"):
        if variant == "idle":
            return f"DB.cancel, {group[7:]}: nothing else writing (floor)"
        return f"DB.cancel, {group[7:]}: while {variant.replace('-', ' ')} write"
    if group.startswith("spaced-"):
        what = "p50" if group == "spaced-p50" else "pre-pings a read"
        pool = {
            "fifo": "longest-idle connection first (SQLAlchemy's default; floor)",
            "lifo": "connection given back last first (the store's pool)",
        }.get(variant, variant)
        return f"DB.poll_job every 100 ms, 6 connections idle, {what}: {pool}"
    if group == "growth-drain":
        return f"growth: drain per target (DB.writer), {variant} targets stored"
    if group.startswith("growth-submit"):
        return f"growth: DB.submit {group[14:]}, {variant} targets stored"
    if group == "memory":
        if variant == "payload":
            return "status of 32 x 1 MiB: payload (floor)"
        return f"status of 32 x 1 MiB: tracemalloc peak, {STATUS_LABELS.get(variant, variant)}"
    if group == "fetch":
        if variant == "http.client":
            return "fetch of a 1 KiB page on 127.0.0.1: http.client, read whole (floor)"
        return "fetch of a 1 KiB page on 127.0.0.1: batch.fetchers.Fetcher(allow=...)"
    if group == "http":
        return {
            "floor": "GET of an 8 x 1 KiB job, gunicorn -w 2: plain Flask view, 1 SQL, jsonify",
            "get": "GET /jobs/<id> of the same job (pass-through), req/s",
            "304": "GET /jobs/<id> with If-None-Match (304), req/s",
            "brief": "GET /jobs/<id>?results=false of a 32 x 1 MiB job (sizes only), req/s",
        }.get(variant, row)
    if group == "http-rss":
        return {
            "payload": "GET of 32 x 1 MiB: payload",
            "one-result": "/content of one 1 MiB result: its size",
            "get": "GET /jobs/<id> of 32 x 1 MiB: worker's peak RSS growth",
            "content": "the 32 results one by one via /content: peak RSS growth",
        }.get(variant, row)
    if group == "memory-rss":
        return f"status of 32 x 1 MiB: RSS peak growth, {STATUS_LABELS.get(variant, variant)}"
    return row


def _concurrent_rank(variant: str) -> int:
    """The raw driver's pair (floor, then ceiling), then the runner's, then the count."""
    if variant == "raw-single":
        return 0
    if variant.startswith("raw-"):
        return 1
    if variant == "single":
        return 2
    return 3 if variant.endswith("-drains") else 4


def _sort_key(key: tuple[str, str]) -> tuple[int, int, int, str]:
    row, backend = key
    group, _, variant = row.partition("/")
    g = ORDER.index(group) if group in ORDER else len(ORDER)
    if group.startswith("growth"):
        v = int(variant.replace("10^", "1e").split("e")[-1]) if "^" in variant else 0
    elif group == "concurrent":
        v = _concurrent_rank(variant)
    else:
        v = VARIANTS.index(variant) if variant in VARIANTS else len(VARIANTS)
    b = BACKEND_ORDER.index(backend) if backend in BACKEND_ORDER else len(BACKEND_ORDER)
    return g, b, v, variant


def aggregate(results: list[dict[str, Any]], small_label: str) -> list[dict[str, Any]]:
    """Median, min and max of every (row, backend) over the repeats, with its ratio."""
    values: dict[tuple[str, str], list[float]] = {}
    units: dict[tuple[str, str], str] = {}
    for r in results:
        key = (r["row"], r["backend"])
        # A payload row comes from every memory measurement; count it once per repeat.
        values.setdefault(key, []).append(float(r["value"]))
        units[key] = r["unit"]
    out = []
    for key in sorted(values, key=_sort_key):
        vals = values[key]
        med = statistics.median(vals)
        fl = floor_of(key[0], key[1], small_label)
        ratio = None
        if fl is not None and fl in values:
            fmed = statistics.median(values[fl])
            ratio = med / fmed if fmed else None
        out.append(
            {
                "row": key[0],
                "backend": key[1],
                "what": describe(key[0]),
                "unit": units[key],
                "values": vals,
                "median": med,
                "min": min(vals),
                "max": max(vals),
                "floor": None if fl is None else {"row": fl[0], "backend": fl[1]},
                "ratio": ratio,
            }
        )
    return out


def _num(x: float, unit: str) -> str:
    if unit in ("errors",):
        return f"{x:.0f}"
    if unit == "MiB":
        return f"{x:.1f}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One markdown table: row, backend, median, min-max, unit, ratio to its floor."""
    lines = [
        "| row | backend | median | min\u2013max | unit | ratio to floor |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        u = r["unit"]
        if r["ratio"] is not None:
            fl = r["floor"]
            where = "" if fl["backend"] == r["backend"] else f" ({fl['backend']})"
            ratio = f"{r['ratio']:.2f}x{where}"
        elif r["floor"] is None and r["unit"] != "errors":
            ratio = "floor"
        else:
            ratio = ""
        unit = u + (" (higher is better)" if u in HIGHER_IS_BETTER else "")
        lines.append(
            f"| {r['what']} | {r['backend']} | {_num(r['median'], u)} "
            f"| {_num(r['min'], u)}\u2013{_num(r['max'], u)} | {unit} | {ratio} |"
        )
    return "\n".join(lines)


def _med(rows: list[dict[str, Any]], row: str, backend: str) -> float | None:
    for r in rows:
        if r["row"] == row and r["backend"] == backend:
            return float(r["median"])
    return None


def targets(rows: list[dict[str, Any]], small_label: str, large_label: str) -> list[dict[str, Any]]:
    """The targets of issue 6, each with its measured ratio (from medians) and verdict."""
    out: list[dict[str, Any]] = []

    def check(
        what: str,
        num: tuple[str, str],
        den: tuple[str, str] | None,
        limit: float,
        *,
        at_least: bool = False,
    ) -> None:
        a = _med(rows, *num)
        b = 1.0 if den is None else _med(rows, *den)
        if a is None or b is None or b == 0:
            return
        value = a / b
        met = value >= limit if at_least else value <= limit
        out.append(
            {
                "target": what,
                "value": value,
                "limit": f"{'≥' if at_least else '≤'} {limit:g}",
                "met": met,
            }
        )

    for be, limit in (("sqlite", 1.5), ("postgresql", 1.1)):  # issue 11
        check(
            f"per target, runner / raw floor, {be}", ("drain/runner", be), ("drain/raw", be), limit
        )
    for be, limit in (("sqlite", 1.3), ("postgresql", 1.2)):  # issue 6
        for v in ("writer",):
            check(
                f"per target, {v} / raw floor, {be}", (f"drain/{v}", be), ("drain/raw", be), limit
            )
    check(
        "per target, runner / Huey no fsync, sqlite",
        ("drain/runner", "sqlite"),
        ("drain/huey-nofsync", "sqlite"),
        1.0,
    )
    check(
        "per target at FULL, runner / Huey as shipped",
        ("drain/runner", "sqlite-full"),
        ("drain/huey-shipped", "sqlite-full"),
        0.5,
    )
    for be in BACKEND_ORDER:
        if be == "sqlite-full":
            continue
        check(
            f"submit p50, store / naive Core, {be}",
            ("submit-p50/store", be),
            ("submit-p50/core", be),
            1.0,
        )
        check(f"status, store / naive Core, {be}", ("status/store", be), ("status/core", be), 1.0)
    for be in BACKEND_ORDER:
        for g in ("growth-drain", "growth-submit-p50"):
            check(
                f"{g[7:]} at {large_label} / at {small_label}, {be}",
                (f"{g}/{large_label}", be),
                (f"{g}/{small_label}", be),
                1.1,
            )
    for r in rows:
        if r["row"].startswith("concurrent/") and r["row"].endswith("-drains"):
            check(
                f"{r['row'][11:]} aggregate / single drain, {r['backend']}",
                (r["row"], r["backend"]),
                ("concurrent/single", r["backend"]),
                4.0 if r["backend"] == "postgresql" else 1.3,
                at_least=True,
            )
    for be in BACKEND_ORDER:
        check(f"256 live jobs: peak connections, {be}", ("connections/peak", be), None, 6)
        check(f"256 live jobs: jobs not done, {be}", ("connections/not-done", be), None, 0)
        check(f"256 live jobs: warnings/errors, {be}", ("connections/problems", be), None, 0)
    locked = [float(r["max"]) for r in rows if r["row"] == "concurrent/lock-errors"]
    if locked:  # the worst repeat of any backend, not a median
        out.append(
            {
                "target": "'database is locked' errors in concurrent drains (max over repeats)",
                "value": max(locked),
                "limit": "≤ 0",
                "met": max(locked) == 0,
            }
        )
    for be in BACKEND_ORDER:
        check(
            f"status 32 x 1 MiB peak memory / payload, runner, {be}",
            ("memory/runner", be),
            ("memory/payload", be),
            3.0,
        )
    for be in BACKEND_ORDER:
        check(
            f"HTTP GET 8 x 1 KiB / floor view, {be}",
            ("http/get", be),
            ("http/floor", be),
            0.9,
            at_least=True,
        )
        check(
            f"HTTP If-None-Match 304 / full GET, {be}",
            ("http/304", be),
            ("http/get", be),
            1.5,
            at_least=True,
        )
        check(
            f"HTTP GET 32 x 1 MiB worker RSS growth / payload, {be}",
            ("http-rss/get", be),
            ("http-rss/payload", be),
            1.5,
        )
        check(
            f"HTTP /content one by one, RSS growth / 1 MiB, {be}",
            ("http-rss/content", be),
            ("http-rss/one-result", be),
            2.0,
        )
    return out


def targets_table(items: list[dict[str, Any]]) -> str:
    lines = ["| target (issues 6, 11, 12) | measured | limit | met |", "|---|---:|---|---|"]
    for t in items:
        lines.append(
            f"| {t['target']} | {t['value']:.2f} | {t['limit']} | {'yes' if t['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def select(pattern: str | None, names: list[str]) -> list[str]:
    if not pattern:
        return names
    rx = re.compile(pattern)
    return [n for n in names if rx.search(n)]
