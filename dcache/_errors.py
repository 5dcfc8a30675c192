"""The store's exceptions: one root, and the transient kind callers may retry.

Every database failure crosses the public API as a :class:`StoreError`, translated in one
place (:func:`translate`, applied by :func:`wrap_errors`). Two kinds of failure arrive
there: SQLAlchemy's wrapped errors, and raw DBAPI errors of a loaded driver (``sqlite3``,
``psycopg``, ``pymysql``), which escape SQLAlchemy's wrapping where the store or the pool
talks to the driver directly (the held cursor of the hot paths, pool events).
"""

from __future__ import annotations

import functools
import re
import sqlite3
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy import exc as sa_exc

__all__ = [
    "NoStoreError",
    "PoolExhaustedError",
    "ResultTooLargeError",
    "SchemaVersionError",
    "StoreError",
    "StoreUnavailableError",
    "wrap_errors",
]

P = ParamSpec("P")
R = TypeVar("R")

# MySQL/MariaDB server error codes that mean "try again": lock wait timeout, deadlock,
# server gone away / lost connection, too many connections, server shutting down, and a
# statement interrupted (KILL QUERY 1317, MariaDB's max_statement_time 1969, MySQL's
# max_execution_time 3024), which says nothing about its data, as a lock timeout does not.
_MYSQL_TRANSIENT = frozenset(
    {1205, 1213, 2002, 2003, 2006, 2013, 1040, 1053, 2055, 4031, 1317, 1969, 3024}
)
# The client-side codes among them that mean the connection itself is gone (plus 1927,
# "connection was killed", and 2014, "commands out of sync", which only a reconnect heals).
_MYSQL_DISCONNECT = frozenset({1927, 2006, 2013, 2014, 2045, 2055, 4031})
# PostgreSQL SQLSTATE classes that mean "try again": serialization failure, deadlock,
# lock not available (lock_timeout), connection exceptions, operator intervention (admin
# shutdown; a statement cancelled by statement_timeout or pg_cancel_backend, 57014),
# insufficient resources.
_PG_TRANSIENT_PREFIXES = ("40001", "40P01", "55P03", "08", "57P", "57014", "53")


class StoreError(Exception):
    """The database refused or failed an operation; the cause is chained."""


class StoreUnavailableError(StoreError):
    """The database is unreachable or asked for a retry (deadlock, lock timeout, restart)."""


class PoolExhaustedError(StoreUnavailableError):
    """Every pooled connection was in use until the checkout timed out (not an outage)."""


class StoreClosedError(StoreError):
    """The store was closed (:meth:`DB.close`): it opens no connection again."""


class SchemaVersionError(StoreError):
    """The database holds a schema this version of dcache cannot use: a newer one, or a
    version row that is not a number (nothing is changed in the database first); with
    ``DB.open(..., create=False)``, an older one too.

    Attributes:
        found: the version the database records, when it is a number (else ``None``).
    """

    found: int | None = None


class NoStoreError(StoreError):
    """There is no store where ``DB.open(..., create=False)`` looked (no SQLite file, or
    no store's tables in the database); nothing was created there."""


class ResultTooLargeError(StoreError, ValueError):
    """A result is larger than this store can hold on its backend (see ``DB.max_result_bytes``).

    Attributes:
        size: the result's size in UTF-8 bytes.
        limit: the largest result of any content the store accepts (``DB.max_result_bytes``).
    """

    def __init__(self, size: int, limit: int, detail: str = "") -> None:
        super().__init__(
            f"result of {size} bytes is too large for this store (at most {limit} bytes"
            f"{detail}); store it elsewhere or raise the server's limit"
        )
        self.size = size
        self.limit = limit


def _driver_errors() -> tuple[type[BaseException], ...]:
    """The DBAPI error roots of the drivers loaded in this process (none is imported here)."""
    kinds: list[type[BaseException]] = [sqlite3.Error]
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        kinds.append(psycopg.Error)
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None:
        kinds.append(pymysql.err.MySQLError)
    return tuple(kinds)


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a raw DBAPI error of a loaded driver (not wrapped by SQLAlchemy)."""
    return isinstance(exc, _driver_errors())


# A PostgreSQL server (or PgBouncer) that answered and refused the login for good: libpq
# reports it without a SQLSTATE, like a lost connection, but no retry will get in.
_PG_LOGIN_REFUSED = re.compile(
    r"fatal:.*(does not exist|password authentication failed|no pg_hba\.conf entry"
    r"|permission denied for database|is not permitted to log in|no such (database|user))",
    re.IGNORECASE | re.DOTALL,
)


def _is_login_refused(exc: BaseException) -> bool:
    """Whether a raw DBAPI error is a server's final "no" to this login (PostgreSQL's
    are told by their text; MySQL's carry codes that are not transient anyway)."""
    psycopg = sys.modules.get("psycopg")
    return (
        psycopg is not None
        and isinstance(exc, psycopg.OperationalError)
        and getattr(exc, "sqlstate", None) is None
        and _PG_LOGIN_REFUSED.search(str(exc)) is not None
    )


def _is_raw_disconnect(exc: BaseException) -> bool:
    """Whether a raw DBAPI error says the connection is gone (as the dialects judge it)."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(exc, psycopg.Error):
        # Errors without a SQLSTATE come from the client: the socket failed, timed out or
        # was closed ("consuming input failed", "the connection is closed").
        return getattr(exc, "sqlstate", None) is None and isinstance(
            exc, (psycopg.OperationalError, psycopg.InterfaceError)
        )
    pymysql = sys.modules.get("pymysql")
    if pymysql is not None and isinstance(exc, pymysql.err.MySQLError):
        if isinstance(exc, pymysql.err.InterfaceError):
            return True  # PyMySQL's "(0, '')": the socket is already closed
        code = exc.args[0] if exc.args else None
        text = str(exc).lower()
        return code in _MYSQL_DISCONNECT or "already closed" in text or "was killed" in text
    return False


def _is_transient_dbapi(orig: BaseException) -> bool | None:
    """Classify a driver error by its code; ``None`` when the code does not decide."""
    args = getattr(orig, "args", ())
    # MySQL first: PyMySQL sets a generic sqlstate (HY000) on server errors, so the
    # error number is what tells a lock wait timeout from a syntax error.
    if args and isinstance(args[0], int) and not isinstance(orig, sqlite3.Error):
        return args[0] in _MYSQL_TRANSIENT
    sqlstate = getattr(orig, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_PG_TRANSIENT_PREFIXES)
    if isinstance(orig, sqlite3.Error):
        # SQLite: only lock contention passes; a syntax error or a read-only file stays.
        return is_sqlite_busy(orig)
    return None


def is_transient(exc: BaseException) -> bool:
    """Tell whether a SQLAlchemy or raw DBAPI error is worth retrying.

    Lost connections, lock waits that timed out, deadlocks, serialization failures, a
    statement cancelled (a statement timeout, an operator's cancel), a server shutting down
    and an exhausted pool are transient; an error in what was asked (bad SQL, a duplicate
    key, a read-only file) is not.
    """
    if isinstance(exc, sa_exc.DBAPIError):
        orig: BaseException | None = exc.orig
        if orig is not None and _is_login_refused(orig):
            return False
        if exc.connection_invalidated or (orig is not None and _is_raw_disconnect(orig)):
            return True
        decided = None if orig is None else _is_transient_dbapi(orig)
        if decided is not None:
            return decided
        return isinstance(exc, sa_exc.OperationalError)
    if is_driver_error(exc):
        if _is_login_refused(exc):
            return False
        if _is_raw_disconnect(exc):
            return True
        decided = _is_transient_dbapi(exc)
        if decided is not None:
            return decided
        return type(exc).__name__ == "OperationalError"
    return isinstance(exc, sa_exc.TimeoutError)  # pool checkout timed out


# A statement that waited too long for a row lock, or was cancelled while it waited, on
# the servers: lock wait timeouts, deadlocks and statements cancelled (see above). The
# session and its other rows are fine: only that statement's row was in the way.
_MYSQL_ROW_WAIT = frozenset({1205, 1213, 1317, 1969, 3024})
_PG_ROW_WAIT = ("55P03", "40P01", "57014")


def is_row_wait(exc: BaseException) -> bool:
    """Whether a server error is one statement's wait for a row that another session
    holds (timed out, cancelled, or a deadlock), not the session's or the server's
    trouble; SQLite's busy lock is the whole database's, so it is not one."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated or exc.orig is None:
            return False
        exc = exc.orig
    if isinstance(exc, sqlite3.Error) or _is_raw_disconnect(exc):
        return False
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], int):
        return args[0] in _MYSQL_ROW_WAIT
    sqlstate = getattr(exc, "sqlstate", None)
    return isinstance(sqlstate, str) and sqlstate.startswith(_PG_ROW_WAIT)


def is_sqlite_busy(exc: BaseException) -> bool:
    """Whether a ``sqlite3`` error is lock contention (SQLITE_BUSY / SQLITE_LOCKED)."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def translate(exc: BaseException) -> StoreError:
    """Map a SQLAlchemy error or a raw DBAPI error onto the store's own exception types."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, sa_exc.TimeoutError):
        kind: type[StoreError] = PoolExhaustedError
    else:
        kind = StoreUnavailableError if is_transient(exc) else StoreError
    first = (str(exc).splitlines() or [""])[0]
    err = kind(f"{type(exc).__name__}: {first}")
    err.__cause__ = exc
    return err


def is_store_failure(exc: BaseException) -> bool:
    """Whether :func:`translate` must turn ``exc`` into a :class:`StoreError`."""
    return isinstance(exc, sa_exc.SQLAlchemyError) or is_driver_error(exc)


def wrap_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Let no ``sqlalchemy.exc`` or driver type cross the public API: translate it here."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if is_store_failure(exc):
                raise translate(exc) from exc
            raise

    return wrapper
