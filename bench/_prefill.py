"""Growth databases: a store already holding N targets, filled fast and kept between runs.

The prefill writes straight SQL in big transactions (``executemany`` on SQLite and MySQL,
``COPY`` on PostgreSQL), bypassing the store: 10^6 targets take seconds, not the hour the
per-target path would. Its jobs are terminal (``done``) with leases far in the future, so
they stay visible, count in every index and are never purged; each belongs to one of 1000
callers named ``prefill-*``. A marker row in ``dcache_meta`` records the size, so a later
run reuses the data; measurements first delete whatever is not prefill.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._env import (
    PREFILL_CALLER,
    Backend,
    cache_dir,
    dbapi_connect,
    remove_sqlite,
    sqlite_path,
    utcnow,
    with_pg_schema,
)
from bench._floors import (
    JOB_COLS,
    SQL_JOB_INSERT,
    SQL_TARGET_INSERT,
    TARGET_COLS,
    connect_sqlite,
    job_values,
    naive_utc,
    sqlite_ts,
    target_values,
)

MARKER = "bench_prefill"
_CALLERS = 1000
_PER_JOB = 32
_RESULT = '{"content": "' + "p" * 80 + '", "meta": {}}'  # small: growth is about rows


def growth_url(be: Backend, server_url: str, n: int, workdir: str) -> str:
    """Where the growth store of ``n`` targets lives on this backend."""
    if be.kind == "sqlite":
        return f"sqlite:///{cache_dir(workdir) / f'growth-{n}.sqlite3'}"
    if be.kind == "postgresql":
        return with_pg_schema(server_url, f"bench_growth_{n}")
    raise ValueError(f"growth runs on SQLite and PostgreSQL, not {be.name}")


def ensure(be: Backend, url: str, n: int) -> str:
    """Make the store at ``url`` hold exactly the prefill of ``n`` targets; say what was done.

    A prefill made for another size or another schema is dropped and made anew.
    """
    import dcache

    want = _marker_value(n)
    if _marker(be, url) == want:
        clean(be, url)
        return f"reused the prefill of {n} targets"
    if be.kind == "sqlite":
        Path(sqlite_path(url)).parent.mkdir(parents=True, exist_ok=True)
        remove_sqlite(url)
    else:
        _recreate_pg_schema(url)
    dcache.DB.open(url).close()  # the schema
    _fill(be, url, n, want)
    return f"prefilled {n} targets"


def _marker_value(n: int) -> str:
    shape = hashlib.sha256(f"{JOB_COLS}|{TARGET_COLS}".encode()).hexdigest()[:12]
    return f"{n}/{shape}"


def _recreate_pg_schema(url: str) -> None:
    from sqlalchemy.engine import make_url

    opts = str(make_url(url).query.get("options", ""))
    schema = opts.split("search_path=", 1)[1]
    conn = dbapi_connect("postgresql", url)
    try:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.commit()
    finally:
        conn.close()


def _connect(be: Backend, url: str) -> Any:
    if be.kind == "sqlite":
        return connect_sqlite(sqlite_path(url), "NORMAL")
    return dbapi_connect(be.kind, url)


def _marker(be: Backend, url: str) -> str | None:
    """The prefill marker stored at ``url``, or None (no store, no marker)."""
    if be.kind == "sqlite" and not Path(sqlite_path(url)).exists():
        return None
    try:
        conn = _connect(be, url)
    except Exception:
        return None
    try:
        cur = conn.cursor()
        q = "SELECT value FROM dcache_meta WHERE key = ?"
        cur.execute(q if be.kind == "sqlite" else q.replace("?", "%s"), (MARKER,))
        row = cur.fetchone()
        return str(row[0]) if row else None
    except Exception:
        return None
    finally:
        conn.close()


def clean(be: Backend, url: str) -> None:
    """Delete every job (and its targets) that is not part of the prefill."""
    conn = _connect(be, url)
    p = "?" if be.kind == "sqlite" else "%s"
    try:
        cur = conn.cursor()
        if be.kind == "sqlite":
            cur.execute("BEGIN IMMEDIATE")
        like = PREFILL_CALLER + "%"
        cur.execute(
            "DELETE FROM batch_target WHERE job_id IN "
            f"(SELECT id FROM batch_job WHERE caller NOT LIKE {p})",
            (like,),
        )
        cur.execute(f"DELETE FROM batch_job WHERE caller NOT LIKE {p}", (like,))
        cur.execute("DELETE FROM batch_owner")
        cur.execute(
            f"DELETE FROM batch_lock WHERE name <> 'global' AND name NOT LIKE {p}",
            ("caller:" + like,),
        )
        if be.kind == "sqlite":
            cur.execute("COMMIT")
        else:
            conn.commit()
        if be.kind == "postgresql":
            # The rows just deleted stay as dead tuples until a vacuum, and autovacuum may
            # be off (as on the CI machines): run after run they would pile up in both
            # sizes' tables and the comparison would measure the bloat, not the size.
            conn.autocommit = True
            conn.execute("VACUUM batch_job")
            conn.execute("VACUUM batch_target")
    finally:
        conn.close()


def _rows(n: int, ts: Any) -> tuple[list[tuple[Any, ...]], Iterator[tuple[Any, ...]]]:
    now = utcnow()
    created = ts(now - dt.timedelta(days=1))
    expires = ts(now + dt.timedelta(days=3650))
    sizes = [min(_PER_JOB, n - j) for j in range(0, n, _PER_JOB)]
    ids = [f"prefill{j:025d}" for j in range(len(sizes))]
    jobs = [
        tuple(
            job_values(
                id=ids[j],
                caller=f"{PREFILL_CALLER}{j % _CALLERS}",
                caller_class="prefill",
                idem_key=hashlib.sha256(str(j).encode()).hexdigest(),
                status="done",
                targets_total=k,
                targets_done=k,
                created_at=created,
                updated_at=created,
                expires_at=expires,
                finished_at=created,
            ).values()
        )
        for j, k in enumerate(sizes)
    ]

    def targets() -> Iterator[tuple[Any, ...]]:
        for j, k in enumerate(sizes):
            for i in range(k):
                yield tuple(
                    target_values(
                        job_id=ids[j],
                        idx=i,
                        url=f"https://example.com/p/{j}/{i}",
                        options="{}",
                        status="done",
                        result=_RESULT,
                        updated_at=created,
                    ).values()
                )

    return jobs, targets()


def _fill(be: Backend, url: str, n: int, marker: str) -> None:
    ts: Any = sqlite_ts if be.kind == "sqlite" else naive_utc
    conn = _connect(be, url)
    try:
        cur = conn.cursor()
        if be.kind == "sqlite":
            cur.execute("PRAGMA synchronous = OFF")  # a prefill, not a measurement
            cur.execute("BEGIN IMMEDIATE")
        cur.execute("DELETE FROM batch_target")
        cur.execute("DELETE FROM batch_job")
        p = "?" if be.kind == "sqlite" else "%s"
        cur.execute(f"DELETE FROM dcache_meta WHERE key = {p}", (MARKER,))
        jobs, targets = _rows(n, ts)
        if be.kind == "postgresql":
            with cur.copy(f"COPY batch_job ({JOB_COLS}) FROM STDIN") as cp:
                for row in jobs:
                    cp.write_row(row)
            with cur.copy(f"COPY batch_target ({TARGET_COLS}) FROM STDIN") as cp:
                for t in targets:
                    cp.write_row(t)
        else:
            q_job = SQL_JOB_INSERT if be.kind == "sqlite" else SQL_JOB_INSERT.replace("?", "%s")
            q_t = SQL_TARGET_INSERT if be.kind == "sqlite" else SQL_TARGET_INSERT.replace("?", "%s")
            for chunk in _chunks(iter(jobs), 10_000):
                cur.executemany(q_job, chunk)
            for chunk in _chunks((t for t in targets), 50_000):
                cur.executemany(q_t, chunk)
        cur.execute(f"INSERT INTO dcache_meta (key, value) VALUES ({p}, {p})", (MARKER, marker))
        if be.kind == "sqlite":
            cur.execute("COMMIT")
            cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        else:
            conn.commit()
        if be.kind == "postgresql":
            conn.autocommit = True
            conn.execute("VACUUM ANALYZE batch_job")
            conn.execute("VACUUM ANALYZE batch_target")
        # No ANALYZE on SQLite: stores in the field have no statistics either.
    finally:
        conn.close()


def _chunks(it: Iterator[Any], size: int) -> Iterator[list[Any]]:
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk
