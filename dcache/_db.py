"""The store: every public method is one short transaction (``purge_expired`` a few)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    Row,
    and_,
    bindparam,
    create_engine,
    delete,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.pool import NullPool, Pool, QueuePool
from sqlalchemy.schema import CreateColumn

from ._admin import AdminQueries
from ._engine import WRITE_OPTION, prepare_engine
from ._errors import ResultTooLargeError, SchemaVersionError, StoreError, wrap_errors
from ._prepared import Prepared
from ._reads import WebReads
from ._rows import (
    JobRow,
    Lookup,
    NewTarget,
    OwnerRow,
    SubmitOutcome,
    TargetRow,
    WriteOutcome,
)
from ._schema import (
    GLOBAL_LOCK,
    LIVE,
    NOPAD_COLLATIONS,
    SCHEMA_VERSION,
    UTCDateTime,
    jobs,
    locks,
    meta,
    metadata,
    owners,
    result_bytes,
    targets,
    tombstones,
)
from ._writer import GroupWriter

__all__ = ["DB", "Writer", "utcnow"]

log = logging.getLogger("dcache")

DEFAULT_URL = "sqlite:///dcache.sqlite3"
TOMBSTONE_TTL = dt.timedelta(days=7)  # how long a purged job's id still answers "expired"
_WRITE = WRITE_OPTION
_SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
_US = dt.timedelta(microseconds=1)


def utcnow() -> dt.datetime:
    """The library's default clock: aware UTC wall time."""
    return dt.datetime.now(dt.timezone.utc)


def _findable(*keys: object) -> bool:
    """Whether keys could name a stored row: strings every backend can compare.

    A NUL (PostgreSQL refuses it) or a lone surrogate (not UTF-8) can be in no key the
    store wrote, so lookups answer "not found" without asking the database.
    """
    for key in keys:
        if not isinstance(key, str) or "\x00" in key:
            return False
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _now(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return utcnow()
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"naive datetime {now!r}: pass an aware UTC datetime")
    return now.astimezone(dt.timezone.utc)


def _check_io_timeout(io_timeout: float | None) -> float | None:
    if io_timeout is None:
        return None
    if isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float)):
        raise ValueError(f"io_timeout must be a number of seconds or None, not {io_timeout!r}")
    if not 0 < io_timeout < 86400:
        raise ValueError(f"io_timeout must be more than 0 and less than a day, not {io_timeout!r}")
    return float(io_timeout)


# What one target row may hold, in bytes, for all its text values together (the room);
# DB.max_result_bytes is what is left of it for a result once _VALUES_ROOM is kept for the
# job id, error and hint of a done target. PostgreSQL: a text value and a protocol
# message are each capped at 1 GiB; 1 MiB is kept for the rest. SQLite: SQLITE_LIMIT_LENGTH
# caps a value and a row (1e9 bytes by default); 1 MiB kept again. MySQL: the statement
# must fit in the server's max_allowed_packet after PyMySQL escaped the values into it
# client-side, which at worst doubles each byte (\\ \" \' \n \r \0 \Z);
# _SQL_ROOM bytes are kept for the SQL text, the time and the packet header.
_PG_ROW_ROOM = (1 << 30) - (1 << 20)
_SQLITE_ROW_SLACK = 1 << 20
_SQL_ROOM = 2048
_VALUES_ROOM = 2048
_MYSQL_ESCAPED = "\\\x00\n\r\x1a\"'"


def _escaped_size(text: str) -> int:
    """Bytes of ``text`` once PyMySQL has escaped it into a statement."""
    return len(text.encode("utf-8")) + sum(text.count(c) for c in _MYSQL_ESCAPED)


class _LockRowRace(Exception):
    """Another transaction created the same caller lock row first; retry the submit."""


def _aux_engine(engine: Engine) -> Engine | None:
    """Another engine on a pool of its own (the heartbeat's, the group writer's).

    A heartbeat sharing the pool with everything else could wait at checkout behind a
    full pool, miss its beats and get its own live jobs reaped by peers. The new pool has
    the same creator, settings and pool-level hooks (``Pool.recreate``) and opens
    connections only when used: one, for its one user. The engine shares the parent's
    dialect, options and engine events (``echo``, tracing, our SQLite ``BEGIN`` hook), as
    ``Engine.execution_options`` engines do. ``None`` for pools that cannot be duplicated
    safely (a ``StaticPool`` or ``SingletonThreadPool`` would open a second, empty
    in-memory database): those share the one connection anyway.
    """
    if not isinstance(engine.pool, (QueuePool, NullPool)):
        return None
    return _PoolOfItsOwn(engine, engine.pool.recreate())


class _PoolOfItsOwn(OptionEngine):
    """An engine like ``engine.execution_options()`` but on a pool of its own."""

    def __init__(self, proxied: Engine, pool: Pool) -> None:
        self.__dict__["_own_pool"] = pool
        super().__init__(proxied, {})

    @property
    def pool(self) -> Pool:
        return self.__dict__["_own_pool"]  # type: ignore[no-any-return]

    @pool.setter
    def pool(self, pool: Pool) -> None:
        self.__dict__["_own_pool"] = pool

    def dispose(self, close: bool = True) -> None:
        """Close this pool's connections only (never the parent engine's)."""
        self.pool.dispose()


def _job_from(values: Sequence[Any]) -> JobRow:
    """A job row from its columns' values in table order (see ``_JOB_COLS``)."""
    m = dict(zip(_JOB_NAMES, values, strict=True))
    ttl = dt.timedelta(microseconds=m.pop("ttl_us"))
    if m["status"] in LIVE:
        # A live job's lease is its last write + ttl; the per-target write does not store
        # it (the expiry index is left alone on the hot path, see dcache._writer).
        m["expires_at"] = m["updated_at"] + ttl
    return JobRow(ttl=ttl, **m)


def _job_row(row: Row[Any]) -> JobRow:
    return _job_from(tuple(row))


_JOB_COLS = [c for c in jobs.c]
_JOB_NAMES = [c.name for c in _JOB_COLS]
_TARGET_COLS = [
    targets.c.idx,
    targets.c.url,
    targets.c.options,
    targets.c.status,
    targets.c.result,
    targets.c.error,
    targets.c.hint,
    targets.c.updated_at,
]


# "Live" with the statuses inlined: an expanding IN parameter is re-rendered per execute.
_LIVE_IN = jobs.c.status.in_([literal_column(f"'{s}'") for s in LIVE])


# Jobs a drain may still be working on: live, or cancelled with the drain not yet ended.
_UNFINISHED = or_(_LIVE_IN, and_(jobs.c.status == "cancelled", jobs.c.finished_at.is_(None)))


def _visible(now: Any) -> Any:
    """A job is visible while its lease holds, and always while it is live."""
    return or_(jobs.c.expires_at > now, _LIVE_IN)


# The submit transaction's statements, built once (construction costs more than SQLite's
# own work for these reads).
_Q_LOCK = select(locks.c.name).where(locks.c.name == bindparam("n")).with_for_update()
_Q_IDEM = (
    select(*_JOB_COLS)
    .where(
        jobs.c.caller == bindparam("c"),
        jobs.c.idem_key == bindparam("k"),
        _visible(bindparam("now", type_=UTCDateTime)),
    )
    .order_by(jobs.c.created_at.desc())
    .limit(1)
)
_Q_LIVE_ALL = select(func.count()).select_from(jobs).where(_LIVE_IN)
_Q_STATUS = (
    select(*_JOB_COLS, *_TARGET_COLS)
    .select_from(jobs.outerjoin(targets, targets.c.job_id == jobs.c.id))
    .where(jobs.c.id == bindparam("job_id"), _visible(bindparam("now", type_=UTCDateTime)))
    .order_by(targets.c.idx)
)
# The same without the results, but with their sizes (TargetRow.result_bytes).
_Q_STATUS_BRIEF = _Q_STATUS.with_only_columns(
    *_JOB_COLS,
    *(null().label("result") if c is targets.c.result else c for c in _TARGET_COLS),
    result_bytes(targets.c.result).label("result_bytes"),
)
_Q_LIVE_CALLER = _Q_LIVE_ALL.where(jobs.c.caller == bindparam("c"))


class DB(AdminQueries, WebReads):
    """The durable store for batch jobs, on SQLite, PostgreSQL or MySQL/MariaDB.

    Build it with :meth:`open` (the store owns and disposes the engine), :meth:`memory`
    (in-memory SQLite for tests), or ``DB(engine)`` (the caller owns the engine). The
    schema is created on construction if missing; doing so from several processes at
    once is safe.

    Every public method is one transaction and translates database failures into
    :class:`dcache.StoreError` (``StoreUnavailableError`` for transient ones).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        io_timeout: float | None = None,
        _owns_engine: bool = False,
        _keeper: sqlite3.Connection | None = None,
    ) -> None:
        """Run the store on an engine the caller made (and keeps owning).

        The store prepares the engine's connections for its own use (see
        :func:`dcache._engine.prepare_engine`): on PostgreSQL and MySQL each connection is
        set to READ COMMITTED once, when the pool opens it or first hands it out, and
        keeps that level for whoever else uses the engine.

        Args:
            engine: a SQLAlchemy engine on SQLite, PostgreSQL (psycopg) or MySQL/MariaDB
                (PyMySQL).
            io_timeout: PostgreSQL and MySQL: seconds a statement may wait for the server
                before it fails with :class:`StoreUnavailableError`; ``None`` (the default
                here, as the engine is the caller's) leaves the driver's waits unbounded.
        """
        self._owns_engine = _owns_engine
        self._keeper = _keeper
        self.io_timeout = _check_io_timeout(io_timeout)
        self.dialect: str = engine.dialect.name
        # At REPEATABLE READ (MySQL's default) a count taken after the lock wait would
        # still see the snapshot from before it, and the caps would overshoot: every
        # server connection is READ COMMITTED (set once per connection, see _engine).
        prepare_engine(engine, io_timeout=self.io_timeout)
        self._engine = engine
        self._wengine = self._engine.execution_options(**{_WRITE: True})
        # Two more pools of the same connections, each opening one when first used: the
        # heartbeat's (never starved by anything else) and the group writer's (held
        # across batches; reads and submits never wait behind drains for it).
        self._aux_raw = [
            e for e in (_aux_engine(self._engine), _aux_engine(self._engine)) if e is not None
        ]
        ctl, writer = self._aux_raw if len(self._aux_raw) == 2 else (engine, engine)
        self._wctl = self._writing(ctl)
        self._wwriter = self._writing(writer)
        self._group = GroupWriter(self)
        types = [c.type for c in (*_JOB_COLS, *_TARGET_COLS)]
        self._status_read = Prepared(_Q_STATUS, engine.dialect, types)
        self._status_brief = Prepared(_Q_STATUS_BRIEF, engine.dialect, [*types, Integer()])
        self._closed = False
        self._result_room = 0
        self._escapes = False
        try:
            self._create_schema()
            self._read_limits()
        except BaseException:
            self._dispose()
            raise

    # -- construction -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str = DEFAULT_URL,
        *,
        synchronous: str = "NORMAL",
        busy_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        io_timeout: float | None = 10.0,
        **engine_options: Any,
    ) -> DB:
        """Open (and create if needed) the store at a SQLAlchemy URL.

        Args:
            url: e.g. ``sqlite:///batch.sqlite3``, ``postgresql+psycopg://host/db``,
                ``mysql+pymysql://user@host/db``. ``sqlite://`` and ``sqlite:///:memory:``
                open one in-memory database shared by every connection, as :meth:`memory`.
            synchronous: SQLite only: ``NORMAL`` (the default; durable across process
                crashes, WAL) or ``FULL`` (also durable across power loss).
            busy_timeout: SQLite only: seconds to wait for a write lock.
            connect_timeout: PostgreSQL and MySQL: seconds to wait for a connection.
            io_timeout: PostgreSQL and MySQL: seconds a statement (or its COMMIT) may wait
                for an answer before it fails with :class:`StoreUnavailableError` and its
                connection is dropped, so a silent server or a network partition costs a
                request seconds, not a hung thread; ``None``: no limit. A lock wait counts
                too: keep it above the longest lock a store call may wait for.
            **engine_options: passed to :func:`sqlalchemy.create_engine`
                (``connect_args`` are merged with the store's).
        """
        sync = synchronous.upper()
        if sync not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {_SYNCHRONOUS}, not {synchronous!r}")
        io_timeout = _check_io_timeout(io_timeout)
        u = make_url(url)
        try:
            if u.get_backend_name() == "sqlite":
                if u.database in (None, "", ":memory:"):
                    return cls._memory(busy_timeout, engine_options)
                opts: dict[str, Any] = {
                    "poolclass": QueuePool,
                    "pool_size": 8,
                    "max_overflow": 56,
                }
                connect_args = {"check_same_thread": False, "timeout": busy_timeout}
            else:
                backend = u.get_backend_name()
                if backend in ("mysql", "mariadb") and "charset" not in u.query:
                    u = u.update_query_dict({"charset": "utf8mb4"})
                # Fail fast when the server is unreachable, and test pooled connections
                # before use so a server restart costs no request an error.
                opts = {"pool_size": 8, "max_overflow": 24, "pool_pre_ping": True}
                connect_args = {"connect_timeout": int(connect_timeout)}
            opts.update(engine_options)
            opts["connect_args"] = {**connect_args, **engine_options.get("connect_args", {})}
            engine = create_engine(u, **opts)
            # Before DB() runs: a new SQLite connection reads these at connect time.
            prepare_engine(
                engine, io_timeout=io_timeout, synchronous=sync, busy_timeout=busy_timeout
            )
        except sa_exc.SQLAlchemyError as exc:
            raise StoreError(f"cannot open {u!r}: {exc}") from exc
        return cls(engine, io_timeout=io_timeout, _owns_engine=True)

    @classmethod
    def memory(cls) -> DB:
        """An in-memory SQLite store that is safe across threads.

        A named ``memdb`` VFS database with a real connection pool: every connection of
        this store sees the same data, and concurrent transactions lock properly (a
        ``StaticPool`` or shared cache would not). It lives until :meth:`close`.
        """
        return cls._memory(30.0, {})

    @classmethod
    def _memory(cls, busy_timeout: float, engine_options: dict[str, Any]) -> DB:
        name = f"/dcache-{secrets.token_hex(8)}"
        uri = f"file:{name}?vfs=memdb"
        keeper = sqlite3.connect(uri, uri=True, check_same_thread=False)
        opts: dict[str, Any] = {"poolclass": QueuePool, "pool_size": 8, "max_overflow": 56}
        opts.update({k: v for k, v in engine_options.items() if k != "connect_args"})
        opts["creator"] = lambda: sqlite3.connect(
            uri, uri=True, check_same_thread=False, timeout=busy_timeout
        )
        try:
            engine = create_engine("sqlite://", **opts)
        except BaseException:
            keeper.close()
            raise
        prepare_engine(engine, io_timeout=None, busy_timeout=busy_timeout)
        return cls(engine, _owns_engine=True, _keeper=keeper)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine this store runs on."""
        return self._engine

    @property
    def max_result_bytes(self) -> int:
        """The largest result (UTF-8 bytes) this store holds whatever its content.

        - PostgreSQL: 1 GiB - 1 MiB - 2 KiB = 1 072 691 200 (a text value's 1 GiB cap).
        - SQLite: ``SQLITE_LIMIT_LENGTH`` - 1 MiB - 2 KiB = 998 949 376 by default.
        - MySQL/MariaDB: (``max_allowed_packet`` - 4 KiB) / 2, read from the server when
          the store was built: 8 386 560 with MariaDB's default 16 MiB (MySQL 8: 64 MiB).
          PyMySQL escapes values into the statement client-side, which doubles
          ``\\ " ' \\n \\r``, NUL and ``\\x1a`` at worst, and the whole statement must fit
          in the server's packet.

        A larger result may still fit when it escapes less; :meth:`Writer.write_target`
        refuses one that does not fit with :class:`ResultTooLargeError` before sending it.
        """
        left = max(0, self._result_room - _VALUES_ROOM)
        return left // 2 if self._escapes else left

    @wrap_errors
    def _read_limits(self) -> None:
        if self.dialect in ("mysql", "mariadb"):
            with self._engine.connect() as conn:
                packet = int(conn.execute(text("SELECT @@max_allowed_packet")).scalar_one())
            self._result_room = max(0, packet - _SQL_ROOM)
            self._escapes = True
        elif self.dialect == "sqlite":
            with self._engine.connect() as conn:
                dbapi: Any = conn.connection.driver_connection
                # Connection.getlimit is Python 3.11+; SQLITE_LIMIT_LENGTH is limit id 0.
                getlimit = getattr(dbapi, "getlimit", None)
                length = getlimit(0) if getlimit else 1_000_000_000
            self._result_room = max(0, int(length) - _SQLITE_ROW_SLACK)
        else:
            self._result_room = _PG_ROW_ROOM

    def _check_size(self, result: str | None, *others: str) -> None:
        """Refuse a result that, stored with ``others`` in one row, would not fit.

        The other values (job id, error, hint) are counted as at least _VALUES_ROOM, so
        for the worst content the edge is exactly :attr:`max_result_bytes`.
        """
        chars = len(others[0]) + len(others[1]) + len(others[2])
        if result is not None:
            chars += len(result)
        if 4 * chars + _VALUES_ROOM <= self._result_room:
            return  # a UTF-8 character is at most 4 bytes, escaped or not
        size = self._size(result) if result is not None else 0
        rest = sum(self._size(v) for v in others)
        if size + max(rest, _VALUES_ROOM) > self._result_room:
            detail = (
                f"; escaped into the statement it takes {size} bytes of the "
                f"{self._result_room - max(rest, _VALUES_ROOM)} the server's "
                "max_allowed_packet leaves it"
                if self._escapes
                else ""
            )
            raise ResultTooLargeError(
                len((result or "").encode("utf-8")), self.max_result_bytes, detail
            )

    def _size(self, value: str) -> int:
        return _escaped_size(value) if self._escapes else len(value.encode("utf-8"))

    def close(self) -> None:
        """Dispose of the engine if this store owns it. Idempotent."""
        if not self._closed:
            self._closed = True
            self._dispose()

    def _dispose(self) -> None:
        self._group.close()
        for aux in self._aux_raw:
            # Always ours, even on a caller's engine: only their own connections are closed.
            aux.dispose()
        if self._owns_engine:
            self._engine.dispose()
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    def __enter__(self) -> DB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<dcache.DB {self._engine.url.render_as_string(hide_password=True)!r}>"

    @contextlib.contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._wengine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        with self._engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def _control(self) -> Iterator[Connection]:
        """A write transaction on the control pool (heartbeat and reaping)."""
        with self._wctl.begin() as conn:
            yield conn

    # -- schema -------------------------------------------------------------------------

    @wrap_errors
    def _create_schema(self) -> None:
        if self.dialect in ("mysql", "mariadb"):
            # MySQL commits DDL implicitly, so serialise creators with a named lock.
            with self._engine.connect() as conn:
                self._get_schema_lock(conn)
                try:
                    self._choose_nopad_collation(conn)
                    metadata.create_all(conn)
                    self._migrate(conn)
                    self._check_columns(conn)
                    self._init_meta(conn)
                    conn.commit()
                finally:
                    conn.execute(select(func.release_lock("dcache_schema")))
                    conn.commit()
            return
        with self._write() as conn:
            if self.dialect == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(0x6463616368)))
            metadata.create_all(conn)
            self._migrate(conn)
            self._check_columns(conn)
            self._init_meta(conn)

    def _get_schema_lock(self, conn: Connection) -> None:
        # Wait up to a minute, in steps that each answer within io_timeout (a longer
        # GET_LOCK would be cut as a silent server).
        step = 60 if self.io_timeout is None else max(0, min(60, int(self.io_timeout) - 1))
        deadline = time.monotonic() + 60
        while True:
            if conn.execute(select(func.get_lock("dcache_schema", step))).scalar() == 1:
                return
            if time.monotonic() >= deadline:
                raise StoreError("timed out waiting for another process creating the schema")
            if step == 0:
                threading.Event().wait(0.05)

    @staticmethod
    def _choose_nopad_collation(conn: Connection) -> None:
        """Make key comparisons exact on MySQL/MariaDB: no trailing-space padding.

        The chosen collation is remembered on this engine's dialect and used by the
        ``CREATE TABLE`` compiler in ``_schema`` instead of the padding ``utf8mb4_bin``.
        """
        have = set(
            conn.execute(
                text(
                    "SELECT COLLATION_NAME FROM information_schema.COLLATIONS "
                    "WHERE COLLATION_NAME IN :names"
                ).bindparams(bindparam("names", expanding=True)),
                {"names": list(NOPAD_COLLATIONS)},
            ).scalars()
        )
        chosen = next((c for c in NOPAD_COLLATIONS if c in have), None)
        if chosen is not None:
            conn.dialect.dcache_collation = chosen  # type: ignore[attr-defined]

    @staticmethod
    def _migrate(conn: Connection) -> None:
        """Add in place what a newer schema version added to existing tables.

        ``create_all`` never alters an existing table. A column that can be added to a
        populated table (one with a server default, or nullable) is added here, and so
        is a missing index, so a version-1 database moves on without losing its jobs;
        anything else is left to :meth:`_check_columns` to refuse.
        """
        inspector = sa_inspect(conn)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in have or not (column.nullable or column.server_default):
                    continue
                ddl = CreateColumn(column).compile(dialect=conn.dialect)
                log.warning("adding column %s.%s to an older schema", table.name, column.name)
                conn.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {ddl}"))
            indexed = {i["name"] for i in inspector.get_indexes(table.name)}
            for index in table.indexes:
                if index.name not in indexed:
                    log.warning("adding index %s to an older schema", index.name)
                    index.create(conn)

    @staticmethod
    def _check_columns(conn: Connection) -> None:
        """Refuse tables that lack columns this version needs (made by an older build).

        ``create_all`` never alters an existing table, so without this check such a
        database would fail later, on some query, with an "unknown column" error.
        """
        inspector = sa_inspect(conn)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            missing = sorted(c.name for c in table.columns if c.name not in have)
            if missing:
                raise SchemaVersionError(
                    f"table {table.name} lacks column(s) {', '.join(missing)}: it was made "
                    "by an older development build of dcache; migrate it or use a new database"
                )

    @staticmethod
    def _init_meta(conn: Connection) -> None:
        found = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        if found is None:
            conn.execute(insert(meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
        elif int(found) < SCHEMA_VERSION:  # _migrate brought the tables up to date
            conn.execute(
                update(meta).where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
            )
        elif int(found) > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"database schema version {found} is newer than this dcache's "
                f"{SCHEMA_VERSION}: upgrade the library"
            )
        has_global = conn.execute(select(locks.c.name).where(locks.c.name == GLOBAL_LOCK)).first()
        if has_global is None:
            conn.execute(insert(locks).values(name=GLOBAL_LOCK))

    @wrap_errors
    def schema_version(self) -> int:
        """The schema version recorded in the database."""
        with self._read() as conn:
            v = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
        return int(v) if v is not None else 0

    # -- submit -------------------------------------------------------------------------

    @wrap_errors
    def submit(
        self,
        *,
        job_id: str,
        caller: str,
        caller_class: str,
        idem_key: str,
        targets: Sequence[NewTarget],
        ttl: dt.timedelta,
        jobs_per_caller: int,
        jobs_total: int,
        owner: str = "",
        now: dt.datetime | None = None,
        payload_key: str | None = None,
    ) -> SubmitOutcome:
        """Decide a submission atomically.

        Under the caller's lock row: a job with this ``(caller, idem_key)`` whose lease
        holds is returned as ``reused`` (no caps checked). Otherwise the caller's live
        jobs are counted against ``jobs_per_caller``; then, under the global lock row,
        all live jobs against ``jobs_total``; then the job is inserted ``running`` with
        all its targets ``pending``. Racing submits from any number of threads,
        processes or hosts create at most one job per key and never exceed a cap.
        """
        if not targets:
            raise ValueError("a job needs at least one target")
        now = _now(now)
        caller_lock = "caller:" + caller
        for _attempt in range(8):
            try:
                with self._write() as conn:
                    return self._submit_tx(
                        conn,
                        caller_lock=caller_lock,
                        job_id=job_id,
                        caller=caller,
                        caller_class=caller_class,
                        idem_key=idem_key,
                        new_targets=targets,
                        ttl=ttl,
                        jobs_per_caller=jobs_per_caller,
                        jobs_total=jobs_total,
                        owner=owner,
                        now=now,
                        payload_key=payload_key,
                    )
            except _LockRowRace:
                continue
        raise StoreError(f"could not create the lock row for caller {caller!r}")

    def _submit_tx(
        self,
        conn: Connection,
        *,
        caller_lock: str,
        job_id: str,
        caller: str,
        caller_class: str,
        idem_key: str,
        new_targets: Sequence[NewTarget],
        ttl: dt.timedelta,
        jobs_per_caller: int,
        jobs_total: int,
        owner: str,
        now: dt.datetime,
        payload_key: str | None,
    ) -> SubmitOutcome:
        if conn.execute(_Q_LOCK, {"n": caller_lock}).first() is None:
            # First submit of this caller: create its lock row. Inserting locks it for the
            # rest of this transaction; a racing creator makes one of us retry.
            try:
                conn.execute(insert(locks).values(name=caller_lock))
            except sa_exc.IntegrityError as exc:
                raise _LockRowRace from exc
        reused = self._by_idem(conn, caller, idem_key, now)
        if reused is not None:
            return SubmitOutcome("reused", reused)
        live_caller = self._count_live(conn, caller)
        if live_caller >= jobs_per_caller:
            return SubmitOutcome("caller_busy", live=live_caller)
        conn.execute(_Q_LOCK, {"n": GLOBAL_LOCK})
        live_total = self._count_live(conn, None)
        if live_total >= jobs_total:
            return SubmitOutcome("busy", live=live_total)
        job: dict[str, Any] = {
            "id": job_id,
            "caller": caller,
            "caller_class": caller_class,
            "idem_key": idem_key,
            "status": "running",
            "error": "",
            "targets_total": len(new_targets),
            "targets_done": 0,
            "targets_failed": 0,
            "owner": owner,
            "ttl_us": ttl // _US,
            "created_at": now,
            "updated_at": now,
            "expires_at": now + ttl,
            "finished_at": None,
            "payload_key": payload_key,
        }
        conn.execute(insert(jobs), [job])
        conn.execute(
            insert(targets),
            [
                {
                    "job_id": job_id,
                    "idx": i,
                    "url": t.url,
                    "options": t.options,
                    "status": "pending",
                    "result": None,
                    "error": "",
                    "hint": "",
                    "updated_at": None,
                }
                for i, t in enumerate(new_targets)
            ],
        )
        job["ttl"] = ttl
        del job["ttl_us"]
        return SubmitOutcome("created", JobRow(**job))

    @staticmethod
    def _by_idem(conn: Connection, caller: str, idem_key: str, now: dt.datetime) -> JobRow | None:
        row = conn.execute(_Q_IDEM, {"c": caller, "k": idem_key, "now": now}).first()
        return _job_row(row) if row is not None else None

    @staticmethod
    def _count_live(conn: Connection, caller: str | None) -> int:
        if caller is None:
            return int(conn.execute(_Q_LIVE_ALL).scalar_one())
        return int(conn.execute(_Q_LIVE_CALLER, {"c": caller}).scalar_one())

    # -- the seed's lookups -------------------------------------------------------------

    @wrap_errors
    def batch_job_by_idem(
        self, caller: str, idem_key: str, now: dt.datetime | None = None
    ) -> JobRow | None:
        """The job for ``(caller, idem_key)`` whose lease has not lapsed, if any."""
        if not _findable(caller, idem_key):
            return None
        now = _now(now)
        with self._read() as conn:
            return self._by_idem(conn, caller, idem_key, now)

    @wrap_errors
    def live_batch_jobs(self, caller: str) -> int:
        """How many ``queued``/``running`` jobs the caller has (by status, not lease)."""
        if not _findable(caller):
            return 0
        with self._read() as conn:
            return self._count_live(conn, caller)

    @wrap_errors
    def live_batch_jobs_total(self) -> int:
        """How many ``queued``/``running`` jobs there are in all."""
        with self._read() as conn:
            return self._count_live(conn, None)

    # -- reads --------------------------------------------------------------------------

    @wrap_errors
    def get_job(self, job_id: str, now: dt.datetime | None = None) -> JobRow | None:
        """The job, or ``None`` when unknown or its lease has lapsed."""
        if not _findable(job_id):
            return None
        now = _now(now)
        with self._read() as conn:
            row = conn.execute(select(*_JOB_COLS).where(jobs.c.id == job_id, _visible(now))).first()
        return _job_row(row) if row is not None else None

    @wrap_errors
    def get_job_with_targets(
        self, job_id: str, now: dt.datetime | None = None, *, results: bool = True
    ) -> tuple[JobRow, list[TargetRow]] | None:
        """The job and all its targets in index order, read in one statement (consistent).

        With ``results=False`` every target's ``result`` is left out (``None``) and its
        size in bytes is read instead (``TargetRow.result_bytes``): a poll of a job with
        large results reads a few hundred bytes. ``None`` when the job is unknown or its
        lease has lapsed.
        """
        if not _findable(job_id):
            return None
        now = _now(now)
        read = self._status_read if results else self._status_brief
        # Status polling is the hot read: one prepared statement, the job's columns
        # converted once (from the first row), the targets' from every row.
        with self._engine.connect() as conn:
            raw = conn.exec_driver_sql(read.sql, read.params({"job_id": job_id, "now": now}))
            rows = raw.fetchall()
        if not rows:
            return None
        t0 = len(_JOB_COLS)
        job = _job_from(read.convert(rows[0])[:t0])
        out = [TargetRow(*read.convert(r, start=t0)[t0:]) for r in rows if r[t0] is not None]
        return job, out

    @wrap_errors
    def get_target(
        self, job_id: str, idx: int, now: dt.datetime | None = None
    ) -> tuple[JobRow, TargetRow] | None:
        """The job and one of its targets (with its result), read in one statement.

        ``None`` when the job is unknown, its lease has lapsed, or it has no such target.
        """
        if not _findable(job_id) or isinstance(idx, bool) or not isinstance(idx, int):
            return None
        now = _now(now)
        q = (
            select(*_JOB_COLS, *_TARGET_COLS)
            .select_from(jobs.join(targets, targets.c.job_id == jobs.c.id))
            .where(jobs.c.id == job_id, targets.c.idx == idx, _visible(now))
        )
        with self._read() as conn:
            row = conn.execute(q).first()
        if row is None:
            return None
        t0 = len(_JOB_COLS)
        return _job_from(tuple(row)[:t0]), TargetRow(*tuple(row)[t0:])

    @wrap_errors
    def lookup(self, job_id: str, now: dt.datetime | None = None) -> Lookup:
        """Whether a job id is readable, expired (purged or not yet) or unknown.

        One indexed read of the job row and, when it is gone, of its tombstone (kept for
        ``tombstone_ttl`` after the purge, see :meth:`purge_expired`).
        """
        if not _findable(job_id):
            return Lookup("unknown")
        now = _now(now)
        with self._read() as conn:
            row = conn.execute(
                select(jobs.c.caller, jobs.c.status, jobs.c.expires_at).where(jobs.c.id == job_id)
            ).first()
            if row is not None:
                if row.status in LIVE or row.expires_at > now:
                    return Lookup("found", row.caller)
                return Lookup("expired", row.caller, row.expires_at)
            gone = conn.execute(
                select(tombstones.c.caller, tombstones.c.expired_at).where(
                    tombstones.c.id == job_id
                )
            ).first()
        if gone is None:
            return Lookup("unknown")
        return Lookup("expired", gone.caller, gone.expired_at)

    @wrap_errors
    def list_jobs(
        self,
        *,
        caller: str | None = None,
        live_only: bool = False,
        limit: int = 100,
        now: dt.datetime | None = None,
    ) -> list[JobRow]:
        """Visible jobs, newest first, optionally one caller's and/or only live ones.

        Raises:
            ValueError: ``limit`` is not a non-negative ``int``.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an int of 0 or more, not {limit!r}")
        if caller is not None and not _findable(caller):
            return []
        now = _now(now)
        q = select(*_JOB_COLS).where(_visible(now))
        if caller is not None:
            q = q.where(jobs.c.caller == caller)
        if live_only:
            q = q.where(jobs.c.status.in_(LIVE))
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id).limit(limit)
        with self._read() as conn:
            return [_job_row(r) for r in conn.execute(q)]

    # -- the drain's write --------------------------------------------------------------

    def writer(self) -> Writer:
        """A drain's writer (a context manager); it holds no connection of its own."""
        return Writer(self)

    def _write_connection(self) -> Connection:
        """A connection for the group-commit writer, which keeps it across batches."""
        return self._wwriter.connect()

    @staticmethod
    def _writing(engine: Engine) -> Engine:
        """``engine`` for write transactions (``BEGIN IMMEDIATE`` on SQLite).

        The isolation level needs nothing here: every connection of every pool is READ
        COMMITTED from its first use (pool listeners, copied by ``Pool.recreate``).
        """
        return engine.execution_options(**{_WRITE: True})

    @wrap_errors
    def write_target(
        self,
        job_id: str,
        idx: int,
        *,
        status: str,
        result: str | None = None,
        error: str = "",
        hint: str = "",
        ttl: dt.timedelta,
        now: dt.datetime | None = None,
    ) -> WriteOutcome:
        """Store one target's outcome and move the job along, in one transaction.

        Compare-and-set: only a ``pending`` target is written. The job's counters advance
        and its lease moves to ``now + ttl``; if this was the last target of a running
        job, the terminal status (``done``/``failed``/``partial``) is set here, once. If
        the job is no longer live (cancelled, or failed by a reaper), the target is still
        stored and the job is marked finished, so its drain stops after this write.

        Writes of concurrent drains are committed together (group commit, see
        ``dcache._writer``); this returns once this write is committed.
        """
        if status not in ("done", "failed"):
            raise ValueError(f"a target is written done or failed, not {status!r}")
        self._check_size(result, error, hint, job_id)
        return self._group.write(
            job_id,
            idx,
            status=status,
            result=result,
            error=error,
            hint=hint,
            ttl=ttl,
            now=_now(now),
        )

    # -- status changes (compare-and-set, each bumps the lease) -------------------------

    def _ttl_of(self, conn: Connection, job_id: str) -> dt.timedelta | None:
        ttl_us = conn.execute(select(jobs.c.ttl_us).where(jobs.c.id == job_id)).scalar()
        return dt.timedelta(microseconds=ttl_us) if ttl_us is not None else None

    @wrap_errors
    def cancel(self, job_id: str, now: dt.datetime | None = None) -> bool:
        """Flip a live job to ``cancelled``; False if unknown or already terminal."""
        if not _findable(job_id):
            return False
        now = _now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            won = conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.status.in_(LIVE))
                .values(status="cancelled", updated_at=now, expires_at=now + ttl)
            ).rowcount
        return bool(won == 1)

    @wrap_errors
    def fail_job(
        self,
        job_id: str,
        reason: str,
        now: dt.datetime | None = None,
        *,
        release_key: bool = False,
    ) -> bool:
        """Mark a live job failed with ``error=reason`` and finished; False if not live.

        With ``release_key``, for a job that no drain ever ran, the job also gives up its
        idempotency key: the same submission made again creates a fresh job instead of
        being handed this one.
        """
        if not _findable(job_id):
            return False
        now = _now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._fail(conn, job_id, reason, ttl, now, release_key=release_key)

    @staticmethod
    def _fail(
        conn: Connection,
        job_id: str,
        reason: str,
        ttl: dt.timedelta,
        now: dt.datetime,
        *,
        release_key: bool = False,
    ) -> bool:
        values: dict[str, Any] = {
            "status": "failed",
            "error": reason,
            "updated_at": now,
            "expires_at": now + ttl,
            "finished_at": now,
        }
        if release_key:
            # Keys are 64 hex digits: this one can never be looked up.
            values["idem_key"] = "released:" + job_id
        won = conn.execute(
            update(jobs).where(jobs.c.id == job_id, jobs.c.status.in_(LIVE)).values(**values)
        ).rowcount
        return bool(won == 1)

    @staticmethod
    def _close_cancelled(
        conn: Connection, job_id: str, ttl: dt.timedelta, now: dt.datetime
    ) -> bool:
        won = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.status.not_in(LIVE),
                jobs.c.finished_at.is_(None),
            )
            .values(finished_at=now, updated_at=now, expires_at=now + ttl)
        ).rowcount
        return bool(won == 1)

    @wrap_errors
    def mark_finished(self, job_id: str, now: dt.datetime | None = None) -> bool:
        """Record that a stopped (non-live) job's drain has ended; False if nothing to do."""
        if not _findable(job_id):
            return False
        now = _now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._close_cancelled(conn, job_id, ttl, now)

    @wrap_errors
    def mark_in_flight_failed(self, reason: str, now: dt.datetime | None = None) -> int:
        """Mark every ``queued``/``running`` job failed with ``error=reason``.

        The single-process restart tool: call it at start, before any runner drains,
        when this process is the only one using the database. Stored targets stay
        readable, pending ones stay pending, nothing is resumed. Cancelled jobs whose
        drain died before finishing are marked finished too. Returns how many jobs were
        marked failed.
        """
        now = _now(now)
        with self._write() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .where(
                    or_(
                        jobs.c.status.in_(LIVE),
                        and_(jobs.c.status == "cancelled", jobs.c.finished_at.is_(None)),
                    )
                )
                .order_by(jobs.c.id)
            ).all()
            return self._reap(conn, rows, reason, now)

    def _reap(self, conn: Connection, rows: Sequence[Any], reason: str, now: dt.datetime) -> int:
        # One compare-and-set per job, by primary key in id order: on InnoDB an UPDATE
        # through a secondary index would deadlock against per-target writes.
        marked = 0
        for r in rows:
            ttl = dt.timedelta(microseconds=r.ttl_us)
            if r.status in LIVE:
                marked += self._fail(conn, r.id, reason, ttl, now)
            else:
                self._close_cancelled(conn, r.id, ttl, now)
        return marked

    # -- owners and orphans -------------------------------------------------------------

    @wrap_errors
    def heartbeat(
        self,
        owner: str,
        now: dt.datetime | None = None,
        *,
        stale_after: dt.timedelta | None = None,
    ) -> None:
        """Record that ``owner`` (a live runner) is alive at ``now``.

        ``stale_after`` is the owner's own word on how long after this beat it may be
        taken for dead; :meth:`reap_orphans` honours it, so runners with different
        heartbeat periods (a rolling deploy) never reap a punctual peer.
        """
        now = _now(now)
        stale_at = None if stale_after is None else now + stale_after
        # On a pool of its own: drains holding every pooled connection cannot starve it.
        with self._control() as conn:
            n = conn.execute(
                update(owners)
                .where(owners.c.owner == owner)
                .values(heartbeat_at=now, stale_at=stale_at, beats=owners.c.beats + 1)
            ).rowcount
            if n == 0:
                conn.execute(
                    insert(owners).values(
                        owner=owner, heartbeat_at=now, started_at=now, stale_at=stale_at, beats=1
                    )
                )

    @wrap_errors
    def remove_owner(self, owner: str) -> None:
        """Forget an owner that stopped cleanly."""
        with self._control() as conn:
            conn.execute(delete(owners).where(owners.c.owner == owner))

    @wrap_errors
    def owners(self) -> list[OwnerRow]:
        """Every owner row, and every owner named by an unfinished job but without a row.

        What a judge of liveness observes: see :class:`OwnerRow` and :meth:`reap_owners`.
        """
        with self._control() as conn:
            found = [
                OwnerRow(
                    owner=r.owner,
                    present=True,
                    beats=r.beats,
                    heartbeat_at=r.heartbeat_at,
                    stale_after=None if r.stale_at is None else r.stale_at - r.heartbeat_at,
                )
                for r in conn.execute(
                    select(owners.c.owner, owners.c.beats, owners.c.heartbeat_at, owners.c.stale_at)
                )
            ]
            missing = conn.execute(
                select(jobs.c.owner)
                .distinct()
                .select_from(jobs.outerjoin(owners, owners.c.owner == jobs.c.owner))
                .where(_UNFINISHED, owners.c.owner.is_(None))
            ).scalars()
            found.extend(OwnerRow(owner=o, present=False) for o in missing)
        return found

    @wrap_errors
    def reap_owners(
        self,
        dead: Mapping[str, tuple[int, dt.datetime | None] | None],
        reason: str,
        now: dt.datetime | None = None,
    ) -> int:
        """Fail the unfinished jobs of owners judged dead; return how many were failed.

        ``dead`` maps each owner to the :attr:`OwnerRow.token` the judge saw unchanged
        for its staleness window. Under the owner rows' locks, an owner whose token has
        changed since (it beat after all, or came back) is spared; the others' live jobs
        are failed with ``error=reason`` (compare-and-set each), their cancelled jobs are
        marked finished, and their rows are deleted, in one transaction.
        """
        if not dead:
            return 0
        now = _now(now)
        names = sorted(dead)
        with self._control() as conn:
            rows = conn.execute(
                select(owners.c.owner, owners.c.beats, owners.c.heartbeat_at)
                .where(owners.c.owner.in_(names))
                .with_for_update()
            ).all()
            current: dict[str, tuple[int, dt.datetime | None] | None] = dict.fromkeys(names)
            current.update({r.owner: (r.beats, r.heartbeat_at) for r in rows})
            confirmed = [o for o in names if current[o] == dead[o]]
            if not confirmed:
                return 0
            unfinished = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .where(jobs.c.owner.in_(confirmed), _UNFINISHED)
                .order_by(jobs.c.id)
            ).all()
            marked = self._reap(conn, unfinished, reason, now)
            conn.execute(delete(owners).where(owners.c.owner.in_(confirmed)))
        return marked

    @wrap_errors
    def reap_orphans(
        self, reason: str, stale_after: dt.timedelta, now: dt.datetime | None = None
    ) -> int:
        """Fail the live jobs whose owner stopped beating; return how many.

        An owner is stale when it has no row, or when its last heartbeat is older than
        ``now - stale_after`` and the ``stale_after`` it declared in :meth:`heartbeat`
        has passed too. Each job is a compare-and-set, so one that finished
        meanwhile is never touched. Cancelled jobs of stale owners are marked finished.
        Stale owner rows are removed after their jobs, in the same transaction.
        """
        now = _now(now)
        cutoff = now - stale_after
        # Dead by the reaper's measure AND past the owner's own declared deadline.
        dead = and_(
            owners.c.heartbeat_at < cutoff,
            or_(owners.c.stale_at.is_(None), owners.c.stale_at < now),
        )
        with self._write() as conn:
            rows = conn.execute(
                select(jobs.c.id, jobs.c.status, jobs.c.ttl_us)
                .select_from(jobs.outerjoin(owners, owners.c.owner == jobs.c.owner))
                .where(
                    or_(
                        jobs.c.status.in_(LIVE),
                        and_(jobs.c.status == "cancelled", jobs.c.finished_at.is_(None)),
                    ),
                    or_(owners.c.owner.is_(None), dead),
                )
                .order_by(jobs.c.id)
            ).all()
            marked = self._reap(conn, rows, reason, now)
            gone = conn.execute(select(owners.c.owner).where(dead)).scalars().all()
            if gone:
                # Re-check in the DELETE: an owner that beat since the select keeps its row.
                conn.execute(delete(owners).where(owners.c.owner.in_(gone), dead))
        return marked

    # -- purge --------------------------------------------------------------------------

    @wrap_errors
    def purge_expired(
        self,
        now: dt.datetime | None = None,
        *,
        limit: int = 500,
        max_batches: int = 100,
        tombstone_ttl: dt.timedelta = TOMBSTONE_TTL,
    ) -> int:
        """Delete jobs whose lease lapsed (never live ones) with their targets.

        Each deleted job leaves a tombstone (its id, caller and expiry) for
        ``tombstone_ttl`` (7 days by default), so :meth:`lookup` can tell "expired" from
        "unknown"; older tombstones are deleted here too. Works in batches of ``limit``
        jobs, each its own short transaction, so live writers are never blocked for long.
        Returns how many jobs were deleted.
        """
        now = _now(now)
        gone = 0
        with self._write() as conn:
            conn.execute(delete(tombstones).where(tombstones.c.expired_at < now - tombstone_ttl))
        for _ in range(max_batches):
            with self._write() as conn:
                lapsed = and_(jobs.c.expires_at <= now, jobs.c.status.not_in(LIVE))
                ids = (
                    conn.execute(select(jobs.c.id).where(lapsed).order_by(jobs.c.id).limit(limit))
                    .scalars()
                    .all()
                )
                if not ids:
                    break
                # Lock in the per-target write's order, targets then job, so a late write
                # to a lapsed job waits (and then finds its target gone) instead of
                # deadlocking; then re-check each job under its lock: a job whose lease a
                # write just moved is kept whole.
                conn.execute(
                    select(targets.c.job_id, targets.c.idx)
                    .where(targets.c.job_id.in_(ids))
                    .with_for_update()
                ).all()
                found = conn.execute(
                    select(jobs.c.id, jobs.c.caller, jobs.c.expires_at)
                    .where(jobs.c.id.in_(ids), lapsed)
                    .with_for_update()
                ).all()
                confirmed = [r.id for r in found]
                if confirmed:
                    conn.execute(
                        insert(tombstones),
                        [
                            {"id": r.id, "caller": r.caller, "expired_at": r.expires_at}
                            for r in found
                        ],
                    )
                    conn.execute(delete(targets).where(targets.c.job_id.in_(confirmed)))
                    gone += conn.execute(delete(jobs).where(jobs.c.id.in_(confirmed))).rowcount
            if len(ids) < limit:
                break
        return gone


class Writer:
    """A drain's handle on the store's per-target write (see :meth:`DB.writer`).

    It holds no connection: every write goes through the store's group-commit writer
    (``dcache._writer``), which commits the outcomes of all drains waiting at that moment
    in one transaction on one connection.
    """

    def __init__(self, db: DB) -> None:
        self._db = db

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to give back (kept for the context-manager protocol)."""

    def write_target(
        self,
        job_id: str,
        idx: int,
        *,
        status: str,
        result: str | None = None,
        error: str = "",
        hint: str = "",
        ttl: dt.timedelta,
        now: dt.datetime | None = None,
    ) -> WriteOutcome:
        """As :meth:`DB.write_target`."""
        return self._db.write_target(
            job_id, idx, status=status, result=result, error=error, hint=hint, ttl=ttl, now=now
        )
