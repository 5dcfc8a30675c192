"""The store: every public method is one short transaction (``purge_expired`` a few)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    and_,
    bindparam,
    create_engine,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool

from ._engine import WRITE_OPTION, prepare_engine
from ._errors import ResultTooLargeError, SchemaVersionError, StoreError, wrap_errors
from ._rows import JobRow, NewTarget, SubmitOutcome, TargetRow, WriteOutcome
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
    targets,
)

__all__ = ["DB", "Writer", "utcnow"]

log = logging.getLogger("dcache")

DEFAULT_URL = "sqlite:///dcache.sqlite3"
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


def _job_row(row: Row[Any]) -> JobRow:
    m = row._mapping
    return JobRow(
        id=m["id"],
        caller=m["caller"],
        caller_class=m["caller_class"],
        idem_key=m["idem_key"],
        status=m["status"],
        error=m["error"],
        targets_total=m["targets_total"],
        targets_done=m["targets_done"],
        targets_failed=m["targets_failed"],
        owner=m["owner"],
        ttl=dt.timedelta(microseconds=m["ttl_us"]),
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        expires_at=m["expires_at"],
        finished_at=m["finished_at"],
    )


_JOB_COLS = [c for c in jobs.c]


# "Live" with the statuses inlined: an expanding IN parameter is re-rendered per execute.
_LIVE_IN = jobs.c.status.in_([literal_column(f"'{s}'") for s in LIVE])


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
_Q_LIVE_CALLER = _Q_LIVE_ALL.where(jobs.c.caller == bindparam("c"))


class DB:
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
        self, job_id: str, now: dt.datetime | None = None
    ) -> tuple[JobRow, list[TargetRow]] | None:
        """The job and all its targets in index order, read in one statement (consistent).

        ``None`` when the job is unknown or its lease has lapsed.
        """
        if not _findable(job_id):
            return None
        now = _now(now)
        dialect = self._engine.dialect
        sql = _SQL_STATUS.replace("?", "?" if dialect.paramstyle == "qmark" else "%s")
        sqlite = dialect.name == "sqlite"
        at = _sqlite_time(now) if sqlite else _naive_utc(now)
        # Status polling is the hot read: one statement on the DBAPI cursor, converting
        # only what is needed (the job's columns once, not once per target row).
        with self._engine.connect() as conn:
            dbapi: Any = conn.connection.driver_connection
            cursor: Any = None
            try:
                cursor = dbapi.cursor()
                cursor.execute(sql, (job_id, at))
                rows = cursor.fetchall()
            except Exception as exc:
                _reraise_dbapi(conn, exc, sql, cursor)
                raise
            finally:
                if cursor is not None:
                    with contextlib.suppress(Exception):
                        cursor.close()
        if not rows:
            return None
        when = _from_sqlite if sqlite else _from_naive
        first = rows[0]
        job = JobRow(
            id=first[0],
            caller=first[1],
            caller_class=first[2],
            idem_key=first[3],
            status=first[4],
            error=first[5],
            targets_total=int(first[6]),
            targets_done=int(first[7]),
            targets_failed=int(first[8]),
            owner=first[9],
            ttl=dt.timedelta(microseconds=int(first[10])),
            created_at=when(first[11]),
            updated_at=when(first[12]),
            expires_at=when(first[13]),
            finished_at=when(first[14]) if first[14] is not None else None,
        )
        out = [
            TargetRow(
                idx=int(r[15]),
                url=r[16],
                options=r[17],
                status=r[18],
                result=r[19],
                error=r[20],
                hint=r[21],
                updated_at=when(r[22]) if r[22] is not None else None,
            )
            for r in rows
            if r[15] is not None
        ]
        return job, out

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
        """A writer that holds one connection for a drain's life (use it as a context).

        A drain writes each target in its own transaction; reusing one connection saves
        a pool checkout and a reset round trip per target. A connection that fails is
        dropped and replaced on the next write.
        """
        return Writer(self)

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

        Compare-and-set: only a ``pending`` target is written. The job's lease moves to
        ``now + ttl`` and its counters advance; if this was the last target of a running
        job, the terminal status (``done``/``failed``/``partial``) is set here, once. If
        the job is no longer live (cancelled, or failed by a reaper), the target is still
        stored and the job is marked finished, so its drain stops after this write.
        """
        with self.writer() as w:
            return w.write_target(
                job_id,
                idx,
                status=status,
                result=result,
                error=error,
                hint=hint,
                ttl=ttl,
                now=now,
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
    def fail_job(self, job_id: str, reason: str, now: dt.datetime | None = None) -> bool:
        """Mark a live job failed with ``error=reason`` and finished; False if not live."""
        if not _findable(job_id):
            return False
        now = _now(now)
        with self._write() as conn:
            ttl = self._ttl_of(conn, job_id)
            if ttl is None:
                return False
            return self._fail(conn, job_id, reason, ttl, now)

    @staticmethod
    def _fail(
        conn: Connection, job_id: str, reason: str, ttl: dt.timedelta, now: dt.datetime
    ) -> bool:
        won = conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.status.in_(LIVE))
            .values(
                status="failed",
                error=reason,
                updated_at=now,
                expires_at=now + ttl,
                finished_at=now,
            )
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
        with self._write() as conn:
            n = conn.execute(
                update(owners)
                .where(owners.c.owner == owner)
                .values(heartbeat_at=now, stale_at=stale_at)
            ).rowcount
            if n == 0:
                conn.execute(
                    insert(owners).values(
                        owner=owner, heartbeat_at=now, started_at=now, stale_at=stale_at
                    )
                )

    @wrap_errors
    def remove_owner(self, owner: str) -> None:
        """Forget an owner that stopped cleanly."""
        with self._write() as conn:
            conn.execute(delete(owners).where(owners.c.owner == owner))

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
        self, now: dt.datetime | None = None, *, limit: int = 500, max_batches: int = 100
    ) -> int:
        """Delete jobs whose lease lapsed (never live ones) with their targets.

        Works in batches of ``limit`` jobs, each its own short transaction, so live
        writers are never blocked for long. Returns how many jobs were deleted.
        """
        now = _now(now)
        gone = 0
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
                confirmed = (
                    conn.execute(
                        select(jobs.c.id).where(jobs.c.id.in_(ids), lapsed).with_for_update()
                    )
                    .scalars()
                    .all()
                )
                if confirmed:
                    conn.execute(delete(targets).where(targets.c.job_id.in_(confirmed)))
                    gone += conn.execute(delete(jobs).where(jobs.c.id.in_(confirmed))).rowcount
            if len(ids) < limit:
                break
        return gone


# The per-target write is the hot path: one transaction per fetched target. It runs as
# fixed SQL on the held connection's DBAPI cursor, because SQLAlchemy's per-execute work
# (cache keys, parameter processing, events) costs as much as SQLite's own work for the
# write. The statements are the ones the schema in _schema.py implies; the store tests
# hold them to the same behaviour as the rest of the store on every backend.
_LAST = "status = 'running' AND targets_done + 1 >= targets_total"
_SQL_TARGET = (
    "UPDATE batch_target SET status = ?, result = ?, error = ?, hint = ?, updated_at = ? "
    "WHERE job_id = ? AND idx = ? AND status = 'pending'"
)
# Every right-hand side reads only old values: MySQL evaluates SET assignments left to
# right with the new values, PostgreSQL and SQLite with the old ones; ordering the
# assignments so that none reads a column set before it makes them agree.
_SQL_JOB = (
    "UPDATE batch_job SET "
    f"finished_at = CASE WHEN ({_LAST}) OR status NOT IN ('queued', 'running') "
    "THEN COALESCE(finished_at, ?) ELSE finished_at END, "
    f"status = CASE WHEN {_LAST} THEN (CASE WHEN targets_failed + ? = 0 THEN 'done' "
    "WHEN targets_failed + ? >= targets_total THEN 'failed' ELSE 'partial' END) "
    "ELSE status END, "
    "targets_done = targets_done + 1, targets_failed = targets_failed + ?, "
    "updated_at = ?, expires_at = ? WHERE id = ?"
)
_SQL_JOB_READ = "SELECT status, finished_at FROM batch_job WHERE id = ?"


_SQL_STATUS = (
    "SELECT j.id, j.caller, j.caller_class, j.idem_key, j.status, j.error, j.targets_total, "
    "j.targets_done, j.targets_failed, j.owner, j.ttl_us, j.created_at, j.updated_at, "
    "j.expires_at, j.finished_at, t.idx, t.url, t.options, t.status, t.result, t.error, "
    "t.hint, t.updated_at FROM batch_job j LEFT OUTER JOIN batch_target t ON t.job_id = j.id "
    "WHERE j.id = ? AND (j.expires_at > ? OR j.status IN ('queued', 'running')) "
    "ORDER BY t.idx"
)


def _from_sqlite(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.timezone.utc)
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.timezone.utc)


def _from_naive(value: Any) -> dt.datetime:
    assert isinstance(value, dt.datetime)
    return value.replace(tzinfo=dt.timezone.utc)


def _reraise_dbapi(conn: Connection, exc: BaseException, sql: str, cursor: Any) -> None:
    """Raise a DBAPI error as SQLAlchemy's (invalidating a dead connection); else return."""
    dialect = conn.dialect
    base = getattr(dialect.loaded_dbapi, "Error", ())
    if not (base and isinstance(exc, base)):
        return
    dbapi = conn.connection.driver_connection
    disconnect = bool(dialect.is_disconnect(exc, dbapi, cursor))
    if disconnect:
        with contextlib.suppress(Exception):
            # As SQLAlchemy does for a disconnect under Connection.execute: every pooled
            # connection opened before now is suspect too (a server restart killed them
            # all) and is replaced at its next checkout, not handed out to fail again.
            conn.engine.pool._invalidate(conn.connection, exc)
        with contextlib.suppress(Exception):
            conn.invalidate(exc)
    raise sa_exc.DBAPIError.instance(
        sql, None, exc, base, connection_invalidated=disconnect
    ) from exc


def _sqlite_time(value: dt.datetime) -> str:
    """A UTC instant as SQLAlchemy's SQLite DATETIME stores it (so comparisons agree)."""
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def _naive_utc(value: dt.datetime) -> dt.datetime:
    return value.astimezone(dt.timezone.utc).replace(tzinfo=None)


class Writer:
    """Per-target writes for one drain, on one held connection (see :meth:`DB.writer`)."""

    def __init__(self, db: DB) -> None:
        self._db = db
        self._conn: Connection | None = None
        self._dbapi: Any = None
        self._cursor: Any = None
        dialect = db.engine.dialect
        self._dialect = dialect
        self._sqlite = dialect.name == "sqlite"
        self._returning = self._sqlite or dialect.name == "postgresql"
        mark = "?" if dialect.paramstyle == "qmark" else "%s"
        self._sql_target = _SQL_TARGET.replace("?", mark)
        self._sql_job = _SQL_JOB.replace("?", mark)
        if self._returning:
            self._sql_job += " RETURNING status, finished_at"
        self._sql_read = _SQL_JOB_READ.replace("?", mark)
        self._time = _sqlite_time if self._sqlite else _naive_utc

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give the held connection back to the pool."""
        conn, self._conn = self._conn, None
        cursor, self._cursor, self._dbapi = self._cursor, None, None
        if cursor is not None:
            with contextlib.suppress(Exception):
                cursor.close()
        if conn is not None:
            # Closing returns the connection to the pool, which logs (never raises) a
            # failed reset; nothing a caller could act on may escape from here.
            with contextlib.suppress(Exception):
                conn.close()

    def _connect(self) -> Any:
        if self._conn is None:
            # Connecting through the engine applies the pool, the SQLite hooks and the
            # READ COMMITTED isolation level to the DBAPI connection.
            self._conn = self._db._wengine.connect()
            self._dbapi = self._conn.connection.driver_connection
            self._cursor = self._dbapi.cursor()
        return self._cursor

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
        """As :meth:`DB.write_target`, on the held connection."""
        if status not in ("done", "failed"):
            raise ValueError(f"a target is written done or failed, not {status!r}")
        self._db._check_size(result, error, hint, job_id)
        now = _now(now)
        at = self._time(now)
        failed = 1 if status == "failed" else 0
        sql = ""
        try:
            cur = self._connect()
            if self._sqlite:
                cur.execute("BEGIN IMMEDIATE")
            sql = self._sql_target
            cur.execute(sql, (status, result, error, hint, at, job_id, idx))
            if cur.rowcount != 1:
                sql = self._sql_read
                cur.execute(sql, (job_id,))
                row = cur.fetchone()
                self._commit()
                return WriteOutcome(False, row[0] if row is not None else "")
            sql = self._sql_job
            cur.execute(sql, (at, failed, failed, failed, at, self._time(now + ttl), job_id))
            if not self._returning:
                sql = self._sql_read
                cur.execute(sql, (job_id,))
            row = cur.fetchone()
            self._commit()
            return WriteOutcome(True, row[0], finished=row[1] is not None)
        except BaseException as exc:
            self._fail(exc, sql)
            raise

    def _commit(self) -> None:
        if self._sqlite:
            self._cursor.execute("COMMIT")
        else:
            self._dbapi.commit()

    def _fail(self, exc: BaseException, sql: str) -> None:
        """Roll back, drop the connection, and re-raise a driver error as SQLAlchemy's."""
        conn, cursor = self._conn, self._cursor
        if conn is not None:
            with contextlib.suppress(Exception):
                if self._sqlite:
                    cursor.execute("ROLLBACK")
                else:
                    self._dbapi.rollback()
        try:
            if conn is not None:
                _reraise_dbapi(conn, exc, sql, cursor)
        finally:
            # Never reuse a connection that failed mid-write.
            self.close()
