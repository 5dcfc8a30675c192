"""Per-engine set-up: every connection the store uses is prepared once, the same way.

:func:`prepare_engine` is the one place that attaches the store's settings to an engine,
whether :meth:`dcache.DB.open` built it or a caller handed it over. It can be called on
several engines sharing one pool (or a pool made by ``pool.recreate()``) and on the same
engine twice: what is already attached is not attached again.

What it attaches, and why here rather than per checkout or per statement:

- **The isolation level, once per DBAPI connection** (PostgreSQL, MySQL/MariaDB: READ
  COMMITTED). ``engine.execution_options(isolation_level=...)`` would set it on every
  checkout and reset it on every checkin (on MySQL four statements per transaction), and
  a connection lost there raised the driver's exception outside SQLAlchemy's wrapping.
  Set from a pool "connect" (or first "checkout") listener, it runs inside the pool's
  checkout, whose driver errors SQLAlchemy wraps and the store translates.
- **io_timeout, the most a statement (or COMMIT) may wait for the server.** PyMySQL:
  ``read_timeout``/``write_timeout``. psycopg: libpq's ``tcp_user_timeout`` and keepalives
  (a partition that drops packets), and a client-side deadline on every wait of the
  connection for the server (a peer that takes bytes and never answers, which no TCP
  timer notices): psycopg funnels every such wait (execute, fetch, commit, rollback, the
  pool's pre-ping) through ``Connection.wait``, whose ``timeout`` the store fills in. On
  expiry the connection is closed (it is mid-protocol and unusable), so SQLAlchemy sees a
  disconnect and the store a transient error. The cost is one Python call per wait.
- **No reconnect after a silent pre-ping.** A pre-ping that timed out says the server is
  silent; reconnecting at once would add a whole ``connect_timeout`` to the request's
  wait, so the checkout fails (transient) and the next request gets a new connection.
- **A ping only after a pause.** The pre-ping is skipped for a connection given back to
  the pool less than half a second ago (:class:`RecentPing`): under load every checkout
  paid a round trip for it, as long as the read it guarded.
- **SQLite's hooks**: BEGIN IMMEDIATE for writes, WAL, busy timeout.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import stamina
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import ExceptionContext

from . import _sql as sql
from ._checkpoint import AUTOCHECKPOINT_PAGES
from ._errors import is_sqlite_busy

__all__ = ["WRITE_OPTION", "prepare_engine"]

log = logging.getLogger("dcache")

WRITE_OPTION = "dcache_write"  # execution option read by the SQLite "begin" hook
ISOLATION_LEVEL = "READ COMMITTED"
_SETUP_KEY = "dcache.setup"  # in a pool record's info: this DBAPI connection is prepared


def prepare_engine(
    engine: Engine,
    *,
    io_timeout: float | None,
    synchronous: str = "NORMAL",
    busy_timeout: float = 30.0,
    guard_prepared: bool = False,
) -> None:
    """Attach the store's per-connection settings to ``engine`` (idempotent).

    Args:
        engine: the engine the store (or a second engine on the same pool) runs on.
        io_timeout: PostgreSQL and MySQL: seconds a statement may wait for the server
            before it fails as a lost connection; ``None``: no limit.
        synchronous: SQLite only: the ``PRAGMA synchronous`` of new connections.
        busy_timeout: SQLite only: seconds to wait for a write lock.
        guard_prepared: psycopg: take a lost prepared statement for a pooler the store
            was not told of (:class:`LostPrepared`). Only for engines the store built:
            a caller's engine may run SQL of its own that such an error comes from.
    """
    if engine.dialect.name == "sqlite":
        if not event.contains(engine, "begin", _sqlite_begin_marker):
            _install_sqlite_hooks(engine, synchronous=synchronous, busy_timeout=busy_timeout)
            event.listen(engine, "begin", _sqlite_begin_marker)
        return
    pool = engine.pool
    dialect = engine.dialect
    if guard_prepared and dialect.driver == "psycopg" and lost_prepared(engine) is None:
        # The engine's own dialect instance (shared by its execution_options engines).
        setattr(dialect, "is_disconnect", LostPrepared(dialect.is_disconnect))  # noqa: B010
    lost = lost_prepared(engine)
    if not any(isinstance(fn, _ConnectionSetup) for fn in pool.dispatch.checkout):
        setup = _ConnectionSetup(engine.dialect, io_timeout, lost)
        # "connect" prepares new connections before their first use; "checkout" catches
        # those a caller's pool opened before the store was attached (a dict lookup).
        event.listen(pool, "connect", setup)
        event.listen(pool, "checkout", setup)
    if io_timeout is not None and not any(
        isinstance(fn, _ConnectArgs) for fn in dialect.dispatch.do_connect
    ):
        event.listen(engine, "do_connect", _ConnectArgs(io_timeout))
    if not event.contains(engine, "handle_error", _silent_ping_fails):
        event.listen(engine, "handle_error", _silent_ping_fails)
    if getattr(pool, "_pre_ping", False) and not isinstance(dialect.do_ping, RecentPing):
        recent = RecentPing(dialect.do_ping)
        # The engine's own dialect instance: this engine's pings only.
        setattr(dialect, "do_ping", recent)  # noqa: B010 (mypy: a method is not assignable)
        event.listen(pool, "checkin", recent.checkin)


class RecentPing:
    """The pool's pre-ping, skipped for a connection given back less than ``window``
    seconds ago (HikariCP's ``aliveBypassWindowMs``).

    A ping is a round trip as long as a short read's own: on a busy pool it doubled the
    cost of every read. A connection used moments ago is alive but for a server that
    went away in those moments, and then the statement fails as a lost connection
    (SQLAlchemy invalidates the pool) as it would have a moment later; a connection idle
    for longer, as every one is after a server restart, is still pinged first.
    """

    def __init__(self, ping: Callable[[Any], bool], window: float = 0.5) -> None:
        self.ping = ping
        self.window = window
        self.used: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def __call__(self, dbapi_conn: Any) -> bool:
        last = self.used.get(dbapi_conn)
        if last is not None and time.monotonic() - last < self.window:
            return True
        return self.ping(dbapi_conn)

    def checkin(self, dbapi_conn: Any, _record: Any) -> None:
        if dbapi_conn is not None:  # None: the connection was invalidated
            self.used[dbapi_conn] = time.monotonic()


def lost_prepared(engine: Engine) -> LostPrepared | None:
    """The engine's :class:`LostPrepared`, if the store installed one."""
    found = engine.dialect.is_disconnect
    return found if isinstance(found, LostPrepared) else None


class LostPrepared:
    """psycopg's ``is_disconnect``, which also takes a lost or clashing prepared statement
    (26000, 42P05) for the sign it is: a pooler in transaction mode (PgBouncer) between
    the store and PostgreSQL that the store was not told of (``pgbouncer=True``).

    psycopg prepares a statement after 5 executions, under a name counted per client
    connection; behind such a pooler the next transaction may run on a server connection
    that lacks it ("does not exist") or holds another client's under that name ("already
    exists"). Taken as a lost connection, the error invalidates the pool's connections
    and is transient (the outcome is retried, not refused), and from then on the store
    prepares nothing (:class:`_ConnectionSetup`), as the option would have made it. Until
    the first such error, a statement of another client's under the same name and
    parameter types may run in the store's place: only the option rules that out.
    """

    def __init__(self, is_disconnect: Callable[..., bool]) -> None:
        self.is_disconnect = is_disconnect
        self.seen = False

    def __call__(self, e: Any, connection: Any, cursor: Any) -> bool:
        if getattr(e, "sqlstate", None) in ("26000", "42P05"):
            if not self.seen:
                self.seen = True
                log.error(
                    "PostgreSQL lost a prepared statement of the store's (%s): is a pooler "
                    "in transaction mode (PgBouncer) in between? The store prepares no more "
                    "statements from now on; open it with pgbouncer=True (or ?pgbouncer=true "
                    "in the URL) to say so from the start",
                    e,
                )
            return True
        return self.is_disconnect(e, connection, cursor)


class _ConnectionSetup:
    """Pool listener: prepare each DBAPI connection once (isolation level, io deadline),
    and stop every one preparing statements once :class:`LostPrepared` has seen why."""

    def __init__(
        self, dialect: Any, io_timeout: float | None, lost: LostPrepared | None = None
    ) -> None:
        self.dialect = dialect
        self.io_timeout = io_timeout
        self.lost = lost

    def __call__(self, dbapi_conn: Any, record: Any, *_proxy: Any) -> None:
        if self.lost is not None and self.lost.seen:
            dbapi_conn.prepare_threshold = None
        info = record.info
        if info.get(_SETUP_KEY):
            return
        if self.io_timeout is not None:
            _bound_waits(dbapi_conn, self.io_timeout)
        # A driver error here propagates out of the pool's checkout, which SQLAlchemy
        # wraps (and invalidates the record), so the store translates it.
        self.dialect.set_isolation_level(dbapi_conn, ISOLATION_LEVEL)
        # What a connection goes back to after a read in autocommit (DB._one_statement):
        # SQLAlchemy resets it to the level it found on the server's first connection,
        # which a server configured otherwise would make other than this one.
        self.dialect.default_isolation_level = ISOLATION_LEVEL
        info[_SETUP_KEY] = True


class _ConnectArgs:
    """``do_connect`` listener: the driver's own I/O timeouts for every new connection."""

    def __init__(self, io_timeout: float) -> None:
        self.io_timeout = io_timeout

    def __call__(self, dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        io = self.io_timeout
        if dialect.driver == "pymysql":
            cparams.setdefault("read_timeout", io)
            cparams.setdefault("write_timeout", io)
        elif dialect.driver == "psycopg":
            # Unacknowledged data for longer than io_timeout breaks the connection (a
            # partition under a statement); keepalives find one that died while idle.
            cparams.setdefault("tcp_user_timeout", max(1, int(io * 1000)))
            cparams.setdefault("keepalives", 1)
            cparams.setdefault("keepalives_idle", max(1, int(io)))
            cparams.setdefault("keepalives_interval", max(1, int(io / 3)))
            cparams.setdefault("keepalives_count", 3)


def _bound_waits(dbapi_conn: Any, io_timeout: float) -> None:
    """Give every wait of this driver connection for the server a deadline."""
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None and isinstance(dbapi_conn, pymysql.connections.Connection):
        # Connections opened before the store's do_connect hook (a caller's pool).
        for attr in ("_read_timeout", "_write_timeout"):
            if getattr(dbapi_conn, attr, 0) is None:
                setattr(dbapi_conn, attr, io_timeout)
        return
    psycopg = sys.modules.get("psycopg")
    if psycopg is None or not isinstance(dbapi_conn, psycopg.Connection):
        return
    timeout_error = _psycopg_wait_timeout()
    if timeout_error is None:
        return
    wait = dbapi_conn.wait  # the bound method: cursors call ``conn.wait(gen)``
    pgconn = dbapi_conn.pgconn

    def timed_wait(gen: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or kwargs.get("timeout") is not None:
            return wait(gen, *args, **kwargs)  # psycopg set its own deadline
        kwargs["timeout"] = io_timeout
        try:
            return wait(gen, *args, **kwargs)
        except timeout_error:
            # The protocol is mid-exchange: the connection cannot be used again. Closing
            # it makes SQLAlchemy see a disconnect (and invalidate it).
            pgconn.finish()
            raise psycopg.OperationalError(
                f"no answer from the server within {io_timeout:g} s (io_timeout): timed out"
            ) from None

    dbapi_conn.wait = timed_wait


_WAIT_TIMEOUT: list[Any] = []


def _psycopg_wait_timeout() -> type[BaseException] | None:
    """psycopg's wait-timeout error if its ``Connection.wait`` takes a timeout, else None."""
    if not _WAIT_TIMEOUT:
        import psycopg

        found: type[BaseException] | None = getattr(psycopg.errors, "_WaitTimeout", None)
        try:
            # psycopg 3.1's wait(gen, timeout) took a poll interval there: ask for both.
            params = inspect.signature(psycopg.Connection.wait).parameters
            takes = "interval" in params and "timeout" in params
        except (TypeError, ValueError):
            takes = False
        if found is None or not takes:
            log.warning(
                "psycopg %s has no wait timeout: io_timeout bounds PostgreSQL statements "
                "only through tcp_user_timeout (a partition), not a silent server",
                psycopg.__version__,
            )
            found = None
        _WAIT_TIMEOUT.append(found)
    kind: type[BaseException] | None = _WAIT_TIMEOUT[0]
    return kind


def _silent_ping_fails(ctx: ExceptionContext) -> None:
    """A pre-ping that timed out fails the checkout instead of reconnecting at once."""
    if ctx.is_pre_ping and ctx.is_disconnect and "timed out" in str(ctx.original_exception):
        ctx.is_disconnect = False


def _install_sqlite_hooks(engine: Engine, *, synchronous: str, busy_timeout: float) -> None:
    """Make pysqlite transactional the way SQLAlchemy's SQLite docs recommend.

    pysqlite's own BEGIN handling is off (``isolation_level = None``); SQLAlchemy's
    "begin" event emits ``BEGIN IMMEDIATE`` for write transactions (so a write lock is
    taken up front: ``FOR UPDATE`` renders nothing on SQLite) and a plain ``BEGIN``
    for reads, which under WAL never block writers.
    """

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            wait, durability, foreign_keys = sql.sqlite_pragmas(
                busy_timeout=busy_timeout, synchronous=synchronous
            )
            cur.execute(wait)
            mode = cur.execute(sql.SQLITE_JOURNAL_MODE).fetchone()[0]
            if str(mode).lower() not in ("memory", "wal"):
                # Switching a new file to WAL needs an exclusive lock and can report
                # "database is locked" at once, without the busy handler, while another
                # process opens the same new file: retry it like any lock wait.
                for attempt in stamina.retry_context(
                    on=is_sqlite_busy,
                    # No busy timeout: tried once, as SQLite's own lock waits are.
                    attempts=None if busy_timeout > 0 else 1,
                    timeout=busy_timeout if busy_timeout > 0 else None,
                    wait_initial=0.01,
                    wait_max=0.25,
                ):
                    with attempt:
                        cur.execute(sql.SQLITE_WAL)
            if str(mode).lower() != "memory":
                # The store's checkpointer thread keeps the log short; a connection
                # checkpoints on its own commit only past this bound (dcache._checkpoint).
                cur.execute(sql.sqlite_autocheckpoint(AUTOCHECKPOINT_PAGES))
            cur.execute(durability)
            cur.execute(foreign_keys)
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        dbapi_conn = conn.connection.driver_connection
        if dbapi_conn is not None and dbapi_conn.isolation_level is not None:
            # A caller-made engine whose connections predate our "connect" hook.
            dbapi_conn.isolation_level = None
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql(sql.SQLITE_BEGIN_WRITE if write else sql.SQLITE_BEGIN)


def _sqlite_begin_marker(conn: Connection) -> None:
    """Marks an engine whose SQLite hooks are installed (does nothing itself)."""
