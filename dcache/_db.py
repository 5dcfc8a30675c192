"""The store: every public method is one short transaction (``purge_expired`` a few)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import secrets
import sqlite3
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Integer, create_engine, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.engine.base import OptionEngine
from sqlalchemy.pool import NullPool, Pool, QueuePool

from . import _sql as sql
from ._admin import AdminQueries
from ._changes import JobChanges
from ._checkpoint import Checkpointer
from ._ddl import SchemaSetup
from ._engine import WRITE_OPTION, prepare_engine
from ._errors import (
    NoStoreError,
    ResultTooLargeError,
    StoreClosedError,
    StoreError,
    translate,
    wrap_errors,
)
from ._outbox import OutboxQueries
from ._prepared import Prepared
from ._queries import JobReads
from ._reads import WebReads
from ._rows import WriteOutcome
from ._schema import meta
from ._shared import JOB_COLS, Q_STATUS, Q_STATUS_BRIEF, TARGET_COLS, utcnow
from ._submit import SubmitQueries
from ._upkeep import MAX_TOMBSTONE_TTL, TOMBSTONE_TTL, Upkeep
from ._writer import GroupWriter

__all__ = ["DB", "Writer", "utcnow"]

log = logging.getLogger("dcache")

# Every store not yet closed, so that a forked child can set each one up for itself.
_OPEN: weakref.WeakSet[DB] = weakref.WeakSet()


def _after_fork() -> None:
    """(In a child process, right after ``fork``.) See :meth:`DB._forked`."""
    for store in list(_OPEN):
        try:
            store._forked()
        except Exception:  # one store's failure must not leave the others as they were
            log.exception("setting up %r after a fork failed", store)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork)


DEFAULT_URL = "sqlite:///dcache.sqlite3"
_WRITE = WRITE_OPTION


def _check_io_timeout(io_timeout: float | None) -> float | None:
    if io_timeout is None:
        return None
    if isinstance(io_timeout, bool) or not isinstance(io_timeout, (int, float)):
        raise ValueError(f"io_timeout must be a number of seconds or None, not {io_timeout!r}")
    if not 0 < io_timeout < 86400:
        raise ValueError(f"io_timeout must be more than 0 and less than a day, not {io_timeout!r}")
    return float(io_timeout)


def _check_tombstone_ttl(ttl: dt.timedelta) -> dt.timedelta:
    if not isinstance(ttl, dt.timedelta) or not dt.timedelta(0) <= ttl <= MAX_TOMBSTONE_TTL:
        raise ValueError(
            "tombstone_ttl must be a timedelta from 0 to 100 years "
            f"({MAX_TOMBSTONE_TTL.days:,} days), not {ttl!r}"
        )
    return ttl


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

# The pool hands out the connection given back last (SQLAlchemy's default takes the
# longest-idle one). A process that reads now and then keeps reusing one warm connection,
# whose recent use spares it the servers' pre-ping (see dcache._engine.RecentPing): with
# four connections idle in the pool and a read every 0.2 s, the longest-idle one had
# waited 0.8 s, and every read paid a ping's round trip first. The connections left idle
# are the ones a server (or PgBouncer) may time out; the pre-ping finds those.
_POOL_ORDER = {"pool_use_lifo": True}
# SQLite's pool, for a database in a file and in memory alike.
_SQLITE_POOL: dict[str, Any] = {
    "poolclass": QueuePool,
    "pool_size": 8,
    "max_overflow": 56,
    **_POOL_ORDER,
}


_BOOL = {"true": True, "1": True, "yes": True, "on": True}
_BOOL.update({"false": False, "0": False, "no": False, "off": False})


def _pgbouncer_flag(url: URL, flag: bool) -> tuple[URL, bool]:
    """Strip ``?pgbouncer=`` from the URL; the store's option is on if either says so."""
    if "pgbouncer" not in url.query:
        return url, flag
    raw = url.query["pgbouncer"]
    value = (raw[-1] if isinstance(raw, tuple) else raw).strip().lower()
    if value not in _BOOL:
        raise ValueError(f"?pgbouncer= takes true or false, not {value!r}")
    return url.difference_update_query(["pgbouncer"]), flag or _BOOL[value]


def _sqlite_store_exists(url: URL) -> None:
    """(``DB.open(create=False)`` on a SQLite file.) Refuse a missing file before SQLite
    creates it, and a file without a store before the engine's connections switch it to
    WAL: a read-only look (``mode=ro``) changes nothing. The version is checked after,
    as on every backend. A URL in SQLite's own URI form (``?uri=true``) is left to it.

    Raises:
        NoStoreError: no such file, or no store's tables in it.
        StoreError: SQLite cannot read it (a folder, not a database, no permission).
    """
    if "uri" in url.query or url.database is None:
        return
    path = Path(url.database)
    shown = repr(url.render_as_string(hide_password=True))
    if not path.exists():
        raise NoStoreError(
            f"no batch store at {shown}: the file {str(path)!r} does not exist (nothing was "
            "created); check the URL"
        )
    try:
        with contextlib.closing(
            sqlite3.connect(path.absolute().as_uri() + "?mode=ro", uri=True)
        ) as conn:
            found = conn.execute(sql.SQLITE_HAS_TABLE, (meta.name,)).fetchone()
    except sqlite3.Error as exc:
        raise translate(exc) from exc
    if found is None:
        raise NoStoreError(
            f"no batch store in {shown}: the file holds no table {meta.name}; check the URL"
        )


def _escaped_size(text: str) -> int:
    """Bytes of ``text`` once PyMySQL has escaped it into a statement."""
    return len(text.encode("utf-8")) + sum(text.count(c) for c in _MYSQL_ESCAPED)


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
        """Replace this pool (never the parent engine's), as ``Engine.dispose`` does.

        ``close=False`` (a forked child, see ``DB._forked``) leaves the old pool's
        connections alone: closing one sends the server a terminate message on the
        parent's session, which the parent's next heartbeat then found gone.
        """
        if close:
            self.pool.dispose()
        self.pool = self.pool.recreate()


class DB(
    SchemaSetup,
    SubmitQueries,
    JobReads,
    WebReads,
    JobChanges,
    Upkeep,
    OutboxQueries,
    AdminQueries,
):
    """The durable store for batch jobs, on SQLite, PostgreSQL or MySQL/MariaDB.

    Build it with :meth:`open` (the store owns and disposes the engine), :meth:`memory`
    (in-memory SQLite for tests), or ``DB(engine)`` (the caller owns the engine). The
    schema is created on construction if missing (and an older one upgraded); doing so
    from several processes at once is safe. With ``create=False`` nothing is created or
    changed: the store must be there, of exactly this version.

    Every public method is one transaction and translates database failures into
    :class:`dcache.StoreError` (``StoreUnavailableError`` for transient ones).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        io_timeout: float | None = None,
        tombstone_ttl: dt.timedelta = TOMBSTONE_TTL,
        create: bool = True,
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
                (PyMySQL). Behind PgBouncer in transaction mode, make it with
                ``connect_args={"prepare_threshold": None}`` (what :meth:`open`'s
                ``pgbouncer`` option does; docs/howto/pgbouncer.md).
            io_timeout: PostgreSQL and MySQL: seconds a statement may wait for the server
                before it fails with :class:`StoreUnavailableError`; ``None`` (the default
                here, as the engine is the caller's) leaves the driver's waits unbounded.
            tombstone_ttl: how long a purged job's id still answers "expired" (rather
                than "unknown") after its lease lapsed: the period :meth:`lookup` honours
                and :meth:`purge_expired` keeps tombstones for (7 days by default, 100
                years at most). The attribute of the same name may be changed later. It is
                not stored in the database: give every process that purges (runners, and
                ``batch purge``, which uses the default) the same period.
            create: create the schema if missing and upgrade an older one (the default).
                ``False`` runs no DDL: the database must hold a store of exactly this
                version, else :class:`NoStoreError` (no store there) or
                :class:`SchemaVersionError` (older or newer) is raised, nothing changed.
        """
        self.tombstone_ttl = _check_tombstone_ttl(tombstone_ttl)
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
        # across batches; reads never wait behind drains for it, and neither do the
        # servers' other writes; on SQLite, where one connection writes at a time, the
        # store's other write transactions take their turns on it between batches: see
        # GroupWriter.transaction).
        self._aux_raw = [
            e for e in (_aux_engine(self._engine), _aux_engine(self._engine)) if e is not None
        ]
        ctl, writer = self._aux_raw if len(self._aux_raw) == 2 else (engine, engine)
        self._wctl = self._writing(ctl)
        self._wwriter = self._writing(writer)
        self._group = GroupWriter(self)
        # SQLite: WAL checkpoints on a thread and connection of their own, started when
        # the group writer first asks (dcache._checkpoint).
        self._checkpoint_raw = _aux_engine(engine) if self.dialect == "sqlite" else None
        self._checkpointer = Checkpointer(self._checkpoint_raw)
        types = [c.type for c in (*JOB_COLS, *TARGET_COLS)]
        self._status_read = Prepared(Q_STATUS, engine.dialect, types)
        self._status_brief = Prepared(Q_STATUS_BRIEF, engine.dialect, [*types, Integer()])
        self._closed = False
        _OPEN.add(self)  # (see _after_fork)
        self._result_room = 0
        self._escapes = False
        try:
            if create:
                self._create_schema()
            else:
                if self.dialect == "sqlite":
                    # Before any connection of the engine's: it would create a missing
                    # file, and switch a foreign one to WAL.
                    _sqlite_store_exists(engine.url)
                self._check_schema()
            self._read_limits()
        except BaseException:
            _OPEN.discard(self)
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
        pgbouncer: bool = False,
        tombstone_ttl: dt.timedelta = TOMBSTONE_TTL,
        create: bool = True,
        **engine_options: Any,
    ) -> DB:
        """Open (and create if needed) the store at a SQLAlchemy URL.

        Args:
            url: e.g. ``sqlite:///batch.sqlite3``, ``postgresql+psycopg://host/db``,
                ``mysql+pymysql://user@host/db``. ``sqlite://`` and ``sqlite:///:memory:``
                open one in-memory database shared by every connection, as :meth:`memory`.
            synchronous: SQLite only: ``NORMAL`` (the default; durable across process
                crashes, WAL) or ``FULL`` (also durable across power loss).
            busy_timeout: SQLite only: seconds a write waits for the database's write
                lock while another connection holds it (another process's, or this
                store's heartbeat's). The store's other writes in this process take
                turns on one connection and wait for each other on a lock in the
                process, which this does not bound (see ``GroupWriter.transaction``).
            connect_timeout: PostgreSQL and MySQL: seconds to wait for a connection.
            io_timeout: PostgreSQL and MySQL: seconds a statement (or its COMMIT) may wait
                for an answer before it fails with :class:`StoreUnavailableError` and its
                connection is dropped, so a silent server or a network partition costs a
                request seconds, not a hung thread; ``None``: no limit. A lock wait counts
                too: keep it above the longest lock a store call may wait for.
            pgbouncer: PostgreSQL only: the URL reaches the server through PgBouncer in
                transaction (or statement) pooling mode, where consecutive transactions of
                one client may run on different server connections. The driver then never
                prepares statements server-side (psycopg's ``prepare_threshold=None``);
                the query flag ``?pgbouncer=true`` in the URL does the same (it is removed
                before the URL reaches the driver). Nothing else the store sends is
                session-level: see :doc:`/deployment`. Left out behind such a pooler,
                the store turns preparing off at the first statement the pooler loses
                (retried, and logged as an error naming this option); until then another
                client's statement could run in the store's place (docs/howto/pgbouncer.md).
            tombstone_ttl: how long a purged job's id answers "expired" (HTTP ``410``)
                rather than "unknown" (``404``) after its lease lapsed; 7 days by default.
            create: create the schema if missing and upgrade an older one (the default).
                ``False``, for tools that must change no database (``batch status``,
                ``jobs``, ``cancel``): no DDL runs and no SQLite file is created; a
                database without a store raises :class:`NoStoreError`, one of another
                schema version :class:`SchemaVersionError`. A SQLite file is first looked
                at read-only, so a file that is not a store is left exactly as it was.
            **engine_options: passed to :func:`sqlalchemy.create_engine`
                (``connect_args`` are merged with the store's). The store's pool holds 8
                connections and up to 24 more on the servers (56 on SQLite), pings a
                server's connection before use unless it was used in the last half second,
                and hands out the connection given back last (``pool_use_lifo``).
        """
        sync = synchronous.upper()
        if sync not in sql.SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sql.SYNCHRONOUS}, not {synchronous!r}")
        io_timeout = _check_io_timeout(io_timeout)
        _check_tombstone_ttl(tombstone_ttl)
        u = make_url(url)
        u, pgbouncer = _pgbouncer_flag(u, pgbouncer)
        if pgbouncer and u.get_backend_name() != "postgresql":
            raise ValueError(f"pgbouncer is for PostgreSQL URLs, not {u.get_backend_name()}")
        try:
            if u.get_backend_name() == "sqlite":
                if u.database in (None, "", ":memory:"):
                    store = cls._memory(busy_timeout, engine_options, create=create)
                    store.tombstone_ttl = tombstone_ttl
                    return store
                opts: dict[str, Any] = dict(_SQLITE_POOL)
                connect_args: dict[str, Any] = {"check_same_thread": False, "timeout": busy_timeout}
            else:
                backend = u.get_backend_name()
                if backend in ("mysql", "mariadb") and "charset" not in u.query:
                    u = u.update_query_dict({"charset": "utf8mb4"})
                # Fail fast when the server is unreachable, and test pooled connections
                # before use so a server restart costs no request an error.
                opts = {"pool_size": 8, "max_overflow": 24, "pool_pre_ping": True, **_POOL_ORDER}
                connect_args = {"connect_timeout": int(connect_timeout)}
                if pgbouncer and u.get_driver_name() == "psycopg":
                    # psycopg 3 prepares a statement after 5 executions and names it
                    # per client connection; behind transaction pooling the next run
                    # lands on another server connection ("does not exist") or on one
                    # where another client's statement has that name ("already exists").
                    connect_args["prepare_threshold"] = None
            opts.update(engine_options)
            opts["connect_args"] = {**connect_args, **engine_options.get("connect_args", {})}
            engine = create_engine(u, **opts)
            # Before DB() runs: a new SQLite connection reads these at connect time.
            prepare_engine(
                engine,
                io_timeout=io_timeout,
                synchronous=sync,
                busy_timeout=busy_timeout,
                guard_prepared=not pgbouncer,
            )
        except sa_exc.SQLAlchemyError as exc:
            raise StoreError(f"cannot open {u!r}: {exc}") from exc
        return cls(
            engine,
            io_timeout=io_timeout,
            tombstone_ttl=tombstone_ttl,
            create=create,
            _owns_engine=True,
        )

    @classmethod
    def memory(cls) -> DB:
        """An in-memory SQLite store that is safe across threads.

        A named ``memdb`` VFS database with a real connection pool: every connection of
        this store sees the same data, and concurrent transactions lock properly (a
        ``StaticPool`` or shared cache would not). It lives until :meth:`close`.
        """
        return cls._memory(30.0, {})

    @classmethod
    def _memory(
        cls, busy_timeout: float, engine_options: dict[str, Any], *, create: bool = True
    ) -> DB:
        name = f"/dcache-{secrets.token_hex(8)}"
        uri = f"file:{name}?vfs=memdb"
        keeper = sqlite3.connect(uri, uri=True, check_same_thread=False)
        opts: dict[str, Any] = dict(_SQLITE_POOL)
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
        # A failing DB() disposes of what it was given, the keeper included.
        return cls(engine, create=create, _owns_engine=True, _keeper=keeper)

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
                packet = int(conn.execute(text(sql.MYSQL_MAX_PACKET)).scalar_one())
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
            _OPEN.discard(self)
            self._dispose()

    def _forked(self) -> None:
        """In a child process just forked from this one (``os.fork``; gunicorn's
        ``--preload`` forks its workers from a process that opened the store).

        Every connection open at the fork belongs to the parent: a statement of the
        child on one would interleave with the parent's on the same session (the same
        socket), and a lock held by another of the parent's threads (a batch being
        committed) would never be released here. So the pools are replaced without
        closing what they held (``Engine.dispose(close=False)``, as SQLAlchemy advises
        for a fork: closing would end the parent's sessions), the group writer starts
        over, and the child opens connections of its own as it needs them. The engine's
        pool is replaced even where the engine is the caller's, for the same reason.

        SQLite is left as it is: its connections keep their locks in the process's memory,
        which the child inherits, so no connection opened before the fork can be set
        aside safely in the child (SQLite's own rule: open the database after forking;
        see docs/deployment.md).
        """
        if self.dialect == "sqlite":
            return
        self._group.forked()
        for aux in (*self._aux_raw, self._checkpoint_raw):
            if aux is not None:
                aux.dispose(close=False)
        self._engine.dispose(close=False)

    def _dispose(self) -> None:
        self._group.close()
        self._checkpointer.close()
        for aux in (*self._aux_raw, self._checkpoint_raw):
            if aux is None:
                continue
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
        """A write transaction of the store's: on SQLite, on the group writer's connection
        between its batches (see ``GroupWriter.transaction``); on the servers, whose locks
        are row locks, on the pool's."""
        self._check_open()
        if self.dialect == "sqlite":
            with self._group.transaction() as conn:
                yield conn
        else:
            with self._wengine.begin() as conn:
                yield conn

    @contextlib.contextmanager
    def _read(self) -> Iterator[Connection]:
        self._check_open()
        with self._engine.begin() as conn:
            yield conn

    def _check_open(self) -> None:
        """Refuse any use after :meth:`close`: a disposed engine would open connections
        again (a drain that outlived its runner's close, say) that nothing closes."""
        if self._closed:
            raise StoreClosedError(f"this store was closed: {self!r}")

    def _one_statement(self) -> Connection:
        """A pooled connection for a read of ONE statement (its own consistent snapshot).

        On PostgreSQL it runs in autocommit: no BEGIN before it and no ROLLBACK when the
        connection goes back to the pool, one round trip instead of three (psycopg sets
        and resets autocommit locally). PyMySQL would send a SET for each, so the others
        keep their transaction (SQLite's BEGIN costs no round trip).
        """
        self._check_open()
        conn = self._engine.connect()
        if self.dialect == "postgresql":
            conn.execution_options(isolation_level="AUTOCOMMIT")
        return conn

    @contextlib.contextmanager
    def _control(self) -> Iterator[Connection]:
        """A write transaction on the control pool (heartbeat and reaping)."""
        self._check_open()
        with self._wctl.begin() as conn:
            yield conn

    # -- the drain's write --------------------------------------------------------------

    def writer(self) -> Writer:
        """A drain's writer; it holds no connection of its own.

        Use it in a ``with`` block: while it is open, the group writer counts on its
        outcomes and a commit may wait a moment (at most 2 ms) for them to arrive.
        """
        return Writer(self)

    def _write_connection(self) -> Connection:
        """A connection for the group-commit writer, which keeps it across batches."""
        self._check_open()
        return self._wwriter.connect()

    @staticmethod
    def _writing(engine: Engine) -> Engine:
        """``engine`` for write transactions (``BEGIN IMMEDIATE`` on SQLite).

        The isolation level needs nothing here: every connection of every pool is READ
        COMMITTED from its first use (pool listeners, copied by ``Pool.recreate``).
        """
        return engine.execution_options(**{_WRITE: True})


class Writer:
    """A drain's handle on the store's per-target write (see :meth:`DB.writer`).

    It holds no connection: every write goes through the store's group-commit writer
    (``dcache._writer``), which commits the outcomes of all drains waiting at that moment
    in one transaction on one connection.
    """

    def __init__(self, db: DB) -> None:
        self._db = db
        self._open: weakref.finalize[[], Writer] | None = None

    def __enter__(self) -> Writer:
        if self._open is None or not self._open.alive:
            # Open, the group writer expects this drain's outcomes (a leader waits a
            # moment for them: see GroupWriter._gather). One dropped without close()
            # (a caller's bug) is closed when it is collected: otherwise every commit of
            # the store would wait a slice for outcomes that never come.
            group = self._db._group
            group.opened()
            self._open = weakref.finalize(self, group.dropped)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """The group writer no longer waits for this drain's outcomes. Idempotent."""
        if self._open is not None and self._open.detach() is not None:
            self._db._group.closed()

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
        job_row: bool = False,
    ) -> WriteOutcome:
        """As :meth:`DB.write_target`."""
        return self._db.write_target(
            job_id,
            idx,
            status=status,
            result=result,
            error=error,
            hint=hint,
            ttl=ttl,
            now=now,
            job_row=job_row,
        )
