"""The store's exceptions: one root, and the transient kind callers may retry."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy import exc as sa_exc

__all__ = [
    "PoolExhaustedError",
    "SchemaVersionError",
    "StoreError",
    "StoreUnavailableError",
    "wrap_errors",
]

P = ParamSpec("P")
R = TypeVar("R")

# MySQL/MariaDB server error codes that mean "try again": lock wait timeout, deadlock,
# server gone away / lost connection, too many connections, server shutting down.
_MYSQL_TRANSIENT = frozenset({1205, 1213, 2002, 2003, 2006, 2013, 1040, 1053, 2055, 4031})
# PostgreSQL SQLSTATE classes that mean "try again": serialization failure, deadlock,
# lock not available (lock_timeout), connection exceptions, operator intervention (admin
# shutdown), insufficient resources.
_PG_TRANSIENT_PREFIXES = ("40001", "40P01", "55P03", "08", "57P", "53")


class StoreError(Exception):
    """The database refused or failed an operation; the cause is chained."""


class StoreUnavailableError(StoreError):
    """The database is unreachable or asked for a retry (deadlock, lock timeout, restart)."""


class PoolExhaustedError(StoreUnavailableError):
    """Every pooled connection was in use until the checkout timed out (not an outage)."""


class SchemaVersionError(StoreError):
    """The database holds a schema newer than this version of dcache understands."""


def is_transient(exc: BaseException) -> bool:
    """Tell whether a SQLAlchemy/DBAPI error is worth retrying."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        orig = exc.orig
        args = getattr(orig, "args", ())
        # MySQL first: PyMySQL sets a generic sqlstate (HY000) on server errors, so the
        # error number is what tells a lock wait timeout from a syntax error.
        if args and isinstance(args[0], int):
            return args[0] in _MYSQL_TRANSIENT
        sqlstate = getattr(orig, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate.startswith(_PG_TRANSIENT_PREFIXES)
        if isinstance(orig, sqlite3.Error):
            # SQLite: only lock contention passes; a syntax error or a read-only file stays.
            return is_sqlite_busy(orig)
        return isinstance(exc, sa_exc.OperationalError)
    return isinstance(exc, sa_exc.TimeoutError)  # pool checkout timed out


def is_sqlite_busy(exc: BaseException) -> bool:
    """Whether a ``sqlite3`` error is lock contention (SQLITE_BUSY / SQLITE_LOCKED)."""
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def translate(exc: sa_exc.SQLAlchemyError) -> StoreError:
    """Map a SQLAlchemy error onto the store's own exception types."""
    if isinstance(exc, sa_exc.TimeoutError):
        kind: type[StoreError] = PoolExhaustedError
    else:
        kind = StoreUnavailableError if is_transient(exc) else StoreError
    err = kind(f"{type(exc).__name__}: {exc}".splitlines()[0])
    err.__cause__ = exc
    return err


def wrap_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Let no ``sqlalchemy.exc`` type cross the public API: translate it in one place."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except sa_exc.SQLAlchemyError as exc:
            raise translate(exc) from exc

    return wrapper
