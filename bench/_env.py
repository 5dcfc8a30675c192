"""Backends, URLs, parameters and the small helpers every measurement shares."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import attrs

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test_bench"
# The local MariaDB has no TLS (see docs/deployment.md): without ssl_disabled PyMySQL builds a
# TLS context, loading the CA certificates, for every connection.
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/test_bench?charset=utf8mb4&ssl_disabled=true"

TTL = dt.timedelta(hours=24)
TTL_S = TTL.total_seconds()
LIVE_SQL = "('queued', 'running')"  # dcache.LIVE, inlined by the hand-written floors
PREFILL_CALLER = "prefill-"  # callers of the jobs a growth prefill stores


@attrs.frozen
class Backend:
    """One database configuration a row runs on."""

    name: str  # the label in the table
    kind: str  # "sqlite", "postgresql" or "mysql"
    synchronous: str = "NORMAL"  # SQLite only

    @property
    def server(self) -> bool:
        return self.kind != "sqlite"


BACKENDS: dict[str, Backend] = {
    "sqlite": Backend("sqlite", "sqlite", "NORMAL"),
    "sqlite-full": Backend("sqlite-full", "sqlite", "FULL"),
    "postgresql": Backend("postgresql", "postgresql"),
    "mariadb": Backend("mariadb", "mysql"),
}
SQL_BACKENDS = list(BACKENDS)
# Only for the optional Huey-on-Redis comparison row.
BACKENDS["redis"] = Backend("redis", "redis")
# Only for the fetch rows: no database, a page served on 127.0.0.1 by a child process.
BACKENDS["loopback"] = Backend("loopback", "http")
REDIS_URL = "redis://127.0.0.1:6379/15"


@attrs.define
class Params:
    """Workload sizes; one object travels to every measurement process as JSON."""

    jobs: int = 20  # J: jobs per drain measurement (each of `targets` targets)
    targets: int = 32
    result_bytes: int = 1024  # content size of each drained target's Result
    samples: int = 300  # timed calls per submit/status measurement
    prefill: int = 1_000_000  # targets stored before the large growth measurement
    prefill_small: int = 1_000
    mem_targets: int = 32
    mem_result_bytes: int = 1 << 20
    concurrent: int = 8  # jobs draining at once (concurrent rows)
    concurrent_targets: int = 32  # targets of each of those jobs (the per-job cap)
    live_jobs: int = 256  # jobs live at once in one process (connections rows)
    live_targets: int = 8  # targets of each of those jobs
    live_fetch_ms: float = 50.0  # each of their fetches sleeps this long
    timeout: float = 900.0  # seconds one measurement process may take

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Params:
        return cls(**obj)


@attrs.define
class Spec:
    """What one measurement process runs: a case on a backend with its parameters."""

    case: str
    backend: str
    url: str  # SQLAlchemy URL (a fresh SQLite file, or a server database)
    params: Params
    workdir: str
    extra: dict[str, Any] = attrs.Factory(dict)

    @property
    def be(self) -> Backend:
        return BACKENDS[self.backend]

    def to_json(self) -> str:
        d = attrs.asdict(self)
        d["params"] = self.params.to_json()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Spec:
        d = json.loads(text)
        d["params"] = Params.from_json(d["params"])
        return cls(**d)


def server_urls(postgres: str | None = None, mysql: str | None = None) -> dict[str, str]:
    """Server URLs: flags first, then ``BENCH_POSTGRES_URL``/``BENCH_MYSQL_URL``, then defaults."""
    return {
        "postgresql": postgres or os.environ.get("BENCH_POSTGRES_URL") or POSTGRES_URL,
        "mariadb": mysql or os.environ.get("BENCH_MYSQL_URL") or MYSQL_URL,
    }


def redis_url(url: str | None = None) -> str:
    """The Redis URL of the Huey comparison row (``BENCH_REDIS_URL``; database 15)."""
    return url or os.environ.get("BENCH_REDIS_URL") or REDIS_URL


def redis_reachable(url: str) -> str | None:
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def with_pg_schema(url: str, schema: str) -> str:
    """The same PostgreSQL URL with ``search_path`` set to ``schema`` (which must exist)."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return u.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )


def dbapi_connect(kind: str, url: str) -> Any:
    """A raw DBAPI connection for a SQLAlchemy URL (servers only), autocommit off."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    q = dict(u.query)
    if kind == "postgresql":
        import psycopg

        kw: dict[str, Any] = {
            "host": u.host or "127.0.0.1",
            "port": u.port or 5432,
            "user": u.username,
            "dbname": u.database,
            "connect_timeout": 5,
        }
        if u.password:
            kw["password"] = u.password
        if "options" in q:
            kw["options"] = q["options"]
        return psycopg.connect(autocommit=False, **kw)
    import pymysql

    conn = pymysql.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        database=u.database,
        charset=str(q.get("charset", "utf8mb4")),
        autocommit=False,
        connect_timeout=5,
        # As the store's connections from the same URL (the dialect passes it through).
        ssl_disabled=str(q.get("ssl_disabled", "")).lower() in ("true", "1"),
    )
    with conn.cursor() as cur:
        # The store runs at READ COMMITTED on MySQL; so does its floor.
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    conn.commit()
    return conn


def reachable(kind: str, url: str) -> str | None:
    """``None`` if the server answers, else why not (one line)."""
    try:
        conn = dbapi_connect(kind, url)
        conn.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None


def sqlite_path(url: str) -> str:
    return url.split("sqlite:///", 1)[1]


def remove_sqlite(url: str) -> None:
    path = sqlite_path(url)
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(OSError):
            os.remove(path + suffix)


def stale_tables(url: str) -> list[str]:
    """The store's tables at ``url`` whose columns differ from the library's schema."""
    from sqlalchemy import create_engine, inspect

    from dcache._schema import metadata

    eng = create_engine(url)
    try:
        insp = inspect(eng)
        return [
            t.name
            for t in metadata.sorted_tables
            if insp.has_table(t.name)
            and {c["name"] for c in insp.get_columns(t.name)} != {c.name for c in t.c}
        ]
    finally:
        eng.dispose()


# The tables wipe() empties, each before the tables it references.
_EMPTIED = ("batch_target", "batch_outbox", "batch_tombstone", "batch_job", "batch_owner")


def wipe(url: str) -> None:
    """An empty store at ``url``: the schema created (or rebuilt if stale), every table empty.

    The library's schema moves while it is being optimised; tables left by an older
    version in a bench database are dropped and made anew rather than half-used.
    """
    from sqlalchemy import create_engine, text

    import dcache
    from dcache._schema import metadata

    if stale_tables(url):
        eng = create_engine(url)
        try:
            metadata.drop_all(eng)
        finally:
            eng.dispose()
    db = dcache.DB.open(url)
    try:
        with db.engine.begin() as conn:
            if db.dialect == "postgresql":
                # DELETE would leave every row of the last run behind as a dead tuple until
                # a vacuum (autovacuum may be off, as on the CI machines): run after run the
                # tables bloat and the plans go wrong (a parallel scan for a keyed read of 32
                # rows: 30 ms). TRUNCATE gives the space back at once.
                conn.execute(text("TRUNCATE " + ", ".join(_EMPTIED)))
            else:
                for table in _EMPTIED:
                    conn.execute(text(f"DELETE FROM {table}"))
            conn.execute(text("DELETE FROM batch_lock WHERE name <> 'global'"))
    finally:
        db.close()


def new_id() -> str:
    return secrets.token_hex(16)


def payload_json(content_bytes: int) -> str:
    """The stored text of a ``Result`` whose content is ``content_bytes`` ASCII bytes.

    Exactly what the runner stores (``json.dumps(Result.to_json())``), so the floors
    write the same bytes.
    """
    return json.dumps({"content": content(content_bytes), "meta": {}}, ensure_ascii=False)


def content(n: int) -> str:
    unit = "0123456789abcdef" * 4 + "\n"
    return (unit * (n // len(unit) + 1))[:n]


def target_urls(tag: str, n: int) -> list[str]:
    return [f"https://example.com/{tag}/{i}" for i in range(n)]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


class Stopwatch:
    """Wall time of the timed region only, in nanoseconds."""

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ns += time.perf_counter_ns() - self._t0


def cache_dir(workdir: str) -> Path:
    """Where growth prefills persist between runs (``BENCH_CACHE_DIR`` overrides)."""
    root = os.environ.get("BENCH_CACHE_DIR")
    p = Path(root) if root else Path(workdir).parent / "dcache-bench-cache"
    p.mkdir(parents=True, exist_ok=True)
    return p
