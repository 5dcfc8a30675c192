"""Tables, dialect-aware column types and the schema version."""

from __future__ import annotations

import datetime as dt
import enum
import re
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    literal_column,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateTable
from sqlalchemy.sql.compiler import DDLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeDecorator, TypeEngine

__all__ = [
    "CANCELLED",
    "DELIVERY_STATUSES",
    "DONE",
    "FAILED",
    "JOB_STATUSES",
    "KEY",
    "LIVE",
    "NOPAD_COLLATIONS",
    "PARTIAL",
    "PENDING",
    "QUEUED",
    "RUNNING",
    "SCHEMA_VERSION",
    "TARGET_ROWID",
    "TARGET_STATUSES",
    "TERMINAL",
    "Delivery",
    "Status",
    "UTCDateTime",
    "jobs",
    "locks",
    "meta",
    "metadata",
    "outbox",
    "owners",
    "result_bytes",
    "targets",
    "tombstones",
    "utf8",
]

# 2: batch_owner.beats (added in place to version-1 tables; see SchemaSetup._tables in dcache._ddl).
# 3: batch_target.result_bytes (added in place, NULL for the results already stored).
SCHEMA_VERSION = 3


class Status(str, enum.Enum):
    """Every status a job or a target can have: the one spelling of each.

    Jobs are ``queued``, ``running``, ``done``, ``failed``, ``partial`` or ``cancelled``
    (:data:`dcache.JOB_STATUSES`); stored targets are ``pending``, ``done`` or ``failed``, and
    the HTTP API and the runner show the target in flight as ``running``
    (:data:`dcache.TARGET_STATUSES`). Rows hold the plain strings (``Status.DONE.value``); a
    member compares equal to its string.
    """

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    PARTIAL = "partial"
    CANCELLED = "cancelled"
    PENDING = "pending"

    def __str__(self) -> str:
        return self.value


class Delivery(str, enum.Enum):
    """Every status of a job's end notification (a ``batch_outbox`` row): ``pending``
    (due, or retrying), ``delivered`` or ``failed`` (given up); the one spelling of each."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


# The plain strings rows hold, one name each, for the code that compares or builds them
# (a member compares equal to its string; these cost no enum lookup on the hot paths).
QUEUED = Status.QUEUED.value
RUNNING = Status.RUNNING.value
DONE = Status.DONE.value
FAILED = Status.FAILED.value
PARTIAL = Status.PARTIAL.value
CANCELLED = Status.CANCELLED.value
PENDING = Status.PENDING.value
# A notification's, named apart from the job's and target's same strings.
UNDELIVERED = Delivery.PENDING.value  # due, or retrying
DELIVERED = Delivery.DELIVERED.value
GIVEN_UP = Delivery.FAILED.value


def _values(*members: Status | Delivery) -> tuple[str, ...]:
    return tuple(m.value for m in members)


JOB_STATUSES = _values(
    Status.QUEUED, Status.RUNNING, Status.DONE, Status.FAILED, Status.PARTIAL, Status.CANCELLED
)
TARGET_STATUSES = _values(Status.PENDING, Status.RUNNING, Status.DONE, Status.FAILED)
# "Live" is by status, never by lease.
LIVE = _values(Status.QUEUED, Status.RUNNING)
TERMINAL = _values(Status.DONE, Status.FAILED, Status.PARTIAL, Status.CANCELLED)
DELIVERY_STATUSES = _values(*Delivery)

# Key columns are VARCHAR(191) at most: 191 * 4 bytes (utf8mb4) stays within the
# 767-byte index prefix limit of older InnoDB row formats, so composite keys fit too.
KEY = 191
GLOBAL_LOCK = "global"


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timestamp that goes in and comes out as an aware UTC datetime on every backend.

    Stored naive in UTC (``DATETIME(6)`` on MySQL for microseconds, ``TIMESTAMP`` without
    zone elsewhere); naive input is rejected so local time can never sneak in.
    """

    impl = DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=False))

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware UTC datetime")
        at = value.astimezone(dt.timezone.utc)
        return _combine(at, at.time())  # as .replace(tzinfo=None), in a seventh of the time

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        assert isinstance(value, dt.datetime)
        # As .replace(tzinfo=utc): 0.12 against 0.75 µs, for every time of every row read.
        return _combine(value, value.time(), dt.timezone.utc)

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        """The conversion above, then the dialect's own; on SQLite, for the store's own
        values (aware, in ``datetime.timezone.utc``), both in one step.

        SQLite stores text, and the two steps (a naive copy, then SQLAlchemy's format
        with seven fields) cost 2.4 µs a value, on a write that binds two; one format
        writes the same text in 0.75 µs. It is used only where a probe value gives the
        same text both ways (SQLAlchemy's default storage format); any other value, and
        any other dialect, goes through the two steps.
        """
        reference = super().bind_processor(dialect)
        if dialect.name != "sqlite" or reference is None:
            return reference
        if reference(_PROBE) != _sqlite_text(_PROBE):
            return reference
        utc = dt.timezone.utc

        def process(value: Any) -> Any:
            if value.__class__ is dt.datetime and value.tzinfo is utc:
                return _sqlite_text(value)
            if value is None:
                return None  # a pending target's time: without the two steps' three calls
            return reference(value)

        return process

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        """The dialect's conversion, then the one above; on SQLite, for the text the store
        writes (``YYYY-MM-DD HH:MM:SS.ffffff``), both in one step.

        SQLAlchemy parses SQLite's text with a regular expression, then the time is made
        aware: 1.5 µs a value, and a status read of 32 targets reads 37 of them;
        ``fromisoformat`` reads the same text as a UTC time in 0.2 µs. Used only where a
        probe reads the same both ways; any other text goes through the two steps.
        """
        reference = super().result_processor(dialect, coltype)
        if dialect.name != "sqlite" or reference is None:
            return reference
        parse = dt.datetime.fromisoformat
        stored = _sqlite_text(_PROBE)
        if reference(stored) != _PROBE or parse(stored + "+00:00") != _PROBE:
            return reference

        def process(value: Any) -> Any:
            if value.__class__ is str and len(value) == _SQLITE_TEXT_LEN and value[10] == " ":
                return parse(value + "+00:00")
            return reference(value)

        return process


_PROBE = dt.datetime(2001, 2, 3, 4, 5, 6, 7, tzinfo=dt.timezone.utc)
_SQLITE_TEXT_LEN = 26  # YYYY-MM-DD HH:MM:SS.ffffff
_combine = dt.datetime.combine


def _sqlite_text(value: dt.datetime) -> str:
    """An aware UTC datetime as SQLite's DATETIME text: ``YYYY-MM-DD HH:MM:SS.ffffff``.

    ``isoformat(" ", "microseconds")`` less its ``+00:00``, in three quarters of its time
    (0.75 against 1.0 µs; a per-target write binds two).
    """
    return "%04d-%02d-%02d %02d:%02d:%02d.%06d" % (  # noqa: UP031 (an f-string: 1.3 µs)
        value.year,
        value.month,
        value.day,
        value.hour,
        value.minute,
        value.second,
        value.microsecond,
    )


class LongText(TypeDecorator[str]):
    """Text that holds megabytes everywhere: ``LONGTEXT`` on MySQL (``TEXT`` is 64 KiB)."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.LONGTEXT())
        return dialect.type_descriptor(Text())


metadata = MetaData()

# Binary collations without trailing-space padding: MariaDB, then MySQL 8.
NOPAD_COLLATIONS = ("utf8mb4_nopad_bin", "utf8mb4_0900_bin")

# On MySQL/MariaDB every table is utf8mb4 with a binary collation: the server defaults
# (latin1, or case- and accent-insensitive collations) would merge distinct callers,
# keys and ids ("Alice" = "alice" = "Alicé") and corrupt non-Latin-1 text. utf8mb4_bin
# still pads ("x" = "x "), so schema creation converts the tables to a NO PAD binary
# collation where the server has one (see NOPAD_COLLATIONS).
_MYSQL: dict[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
}

meta = Table(
    "dcache_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(255), nullable=False),
    **_MYSQL,
)

# Lock rows: one global row (created with the schema) and one per caller (created on
# demand). Submits lock caller row -> global row, always in that order.
locks = Table(
    "batch_lock",
    metadata,
    Column("name", String(KEY + 9), primary_key=True),
    **_MYSQL,
)

jobs = Table(
    "batch_job",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("caller", String(KEY), nullable=False),
    Column("caller_class", String(KEY), nullable=False),
    Column("idem_key", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("error", Text, nullable=False, default=""),
    Column("targets_total", Integer, nullable=False),
    Column("targets_done", Integer, nullable=False, default=0),
    Column("targets_failed", Integer, nullable=False, default=0),
    Column("owner", String(64), nullable=False, default=""),
    Column("ttl_us", BigInteger, nullable=False),  # exact: microseconds
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("expires_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime, nullable=True),
    # sha256 of the canonical targets: a client key reused for other targets is told by
    # one comparison, without reading them (NULL in rows from before it existed).
    Column("payload_key", String(64), nullable=True),
    # Where to announce the job's end (a webhook URL), NULL for none: see batch_outbox.
    Column("notify_url", Text, nullable=True),
    Index("ix_batch_job_idem", "caller", "idem_key"),
    Index("ix_batch_job_caller_status", "caller", "status"),
    Index("ix_batch_job_status", "status"),
    Index("ix_batch_job_expires", "expires_at"),
    Index("ix_batch_job_owner_status", "owner", "status"),
    Index("ix_batch_job_created", "created_at"),  # the newest-first listings
    **_MYSQL,
)

targets = Table(
    "batch_target",
    metadata,
    Column(
        "job_id",
        String(64),
        ForeignKey("batch_job.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("idx", Integer, primary_key=True, autoincrement=False),
    Column("url", Text, nullable=False),
    Column("options", LongText, nullable=False),
    Column("status", String(16), nullable=False),
    Column("error", Text, nullable=False, default=""),
    Column("hint", Text, nullable=False, default=""),
    Column("updated_at", UTCDateTime, nullable=True),
    # The result's size in UTF-8 bytes, stored with it: a read that leaves the results out
    # answers their sizes without touching them (SQLite and MySQL would load each value to
    # measure it). NULL for a result stored before version 3: measured when read.
    Column("result_bytes", BigInteger, nullable=True),
    # Last: SQLite keeps a large value in a chain of overflow pages, and a column stored
    # after it is reached only by walking the chain; before it, a read that leaves the
    # result out never touches those pages. (Tables made before version 3 have it before
    # error, hint and updated_at: correct, only slower to read without results.)
    Column("result", LongText, nullable=True),
    **_MYSQL,
)

# SQLite's implicit key of a target row (the tables are rowid tables): what its
# incremental blob I/O opens a value by (see DB.read_result).
TARGET_ROWID = literal_column(f"{targets.name}.rowid", Integer)

# One row per live Runner (its owner id), refreshed by its heartbeat thread.
owners = Table(
    "batch_owner",
    metadata,
    Column("owner", String(64), primary_key=True),
    Column("heartbeat_at", UTCDateTime, nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    # When the owner itself says it may be taken for dead (its last beat + 3 periods).
    Column("stale_at", UTCDateTime, nullable=True),
    # Incremented by every beat: peers judge liveness by watching it change on their own
    # monotonic clocks, never by comparing wall-clock times written by another host.
    Column("beats", BigInteger, nullable=False, default=0, server_default="0"),
    **_MYSQL,
)


# The ids of purged jobs, kept a while (DB.purge_expired's tombstone_ttl) so that a late
# poll of a job whose lease lapsed learns "expired" instead of "unknown".
tombstones = Table(
    "batch_tombstone",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("caller", String(KEY), nullable=False),
    Column("expired_at", UTCDateTime, nullable=False),
    Index("ix_batch_tombstone_expired", "expired_at"),
    **_MYSQL,
)


# The transactional outbox: one row per job end to announce, inserted by the same
# transaction that sets the terminal status (dcache._outbox); senders claim due rows.
outbox = Table(
    "batch_outbox",
    metadata,
    Column("id", String(64), primary_key=True),  # the webhook-id, stable over attempts
    Column("job_id", String(64), nullable=False),
    Column("caller", String(KEY), nullable=False),
    Column("url", Text, nullable=False),
    Column("job_status", String(16), nullable=False),
    Column("status", String(16), nullable=False),  # a Delivery
    Column("attempts", Integer, nullable=False, default=0),
    Column("next_attempt_at", UTCDateTime, nullable=False),
    Column("claimed_by", String(64), nullable=False, default=""),
    Column("claimed_until", UTCDateTime, nullable=True),
    Column("last_answer", Text, nullable=False, default=""),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Index("ix_batch_outbox_due", "status", "next_attempt_at"),
    Index("ix_batch_outbox_job", "job_id"),
    **_MYSQL,
)


class result_bytes(FunctionElement[int]):
    """The size in UTF-8 bytes of a text column (``octet_length`` where there is one)."""

    type = Integer()
    inherit_cache = True


@compiles(result_bytes)
def _result_bytes(element: result_bytes, compiler: Any, **kw: Any) -> str:
    return f"octet_length({compiler.process(element.clauses, **kw)})"


class utf8(FunctionElement[bytes]):
    """A text column's UTF-8 encoding, as bytes (``substr`` on it counts bytes)."""

    type = LargeBinary()
    inherit_cache = True


@compiles(utf8)
def _utf8(element: utf8, compiler: Any, **kw: Any) -> str:
    # MySQL and MariaDB: the binary string of a utf8mb4 column is its UTF-8 bytes.
    return f"CAST({compiler.process(element.clauses, **kw)} AS BINARY)"


@compiles(utf8, "postgresql")
def _utf8_postgresql(element: utf8, compiler: Any, **kw: Any) -> str:
    return f"convert_to({compiler.process(element.clauses, **kw)}, 'UTF8')"


@compiles(utf8, "sqlite")
def _utf8_sqlite(element: utf8, compiler: Any, **kw: Any) -> str:
    # The store's files are UTF-8 (SQLite's default encoding; see DB.read_result).
    return f"CAST({compiler.process(element.clauses, **kw)} AS BLOB)"


@compiles(result_bytes, "sqlite")
def _result_bytes_sqlite(element: result_bytes, compiler: Any, **kw: Any) -> str:
    # SQLite has no octet_length (before 3.43): length() counts a blob's bytes.
    (text,) = element.clauses
    return f"length({compiler.process(utf8(text), **kw)})"


_PADDING_BIN = re.compile(r"COLLATE\s*=?\s*utf8mb4_bin\b")


@compiles(CreateTable, "mysql")
@compiles(CreateTable, "mariadb")
def _create_table_nopad(element: CreateTable, compiler: DDLCompiler, **kw: Any) -> str:
    """Create MySQL tables with the NO PAD binary collation chosen for this engine."""
    sql: str = compiler.visit_create_table(element, **kw)  # type: ignore[no-untyped-call]
    chosen = getattr(compiler.dialect, "dcache_collation", None)
    if chosen:
        sql = _PADDING_BIN.sub(f"COLLATE={chosen}", sql)
    return sql
