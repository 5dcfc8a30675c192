"""dcache: the durable store behind ``batch``, on SQLAlchemy Core.

SQLite by default (a file, or :meth:`DB.memory` for tests); PostgreSQL (psycopg 3) and
MySQL/MariaDB (PyMySQL) when several processes or hosts share one database.
"""

from __future__ import annotations

from ._db import DB, Writer, utcnow
from ._errors import (
    PoolExhaustedError,
    ResultTooLargeError,
    SchemaVersionError,
    StoreError,
    StoreUnavailableError,
    is_transient,
)
from ._reads import JobStream
from ._rows import (
    JobRow,
    Lookup,
    NewTarget,
    OwnerRow,
    SubmitOutcome,
    TargetRow,
    WriteOutcome,
)
from ._schema import LIVE, SCHEMA_VERSION, TERMINAL

__all__ = [
    "DB",
    "LIVE",
    "SCHEMA_VERSION",
    "TERMINAL",
    "JobRow",
    "JobStream",
    "Lookup",
    "NewTarget",
    "OwnerRow",
    "PoolExhaustedError",
    "ResultTooLargeError",
    "SchemaVersionError",
    "StoreError",
    "StoreUnavailableError",
    "SubmitOutcome",
    "TargetRow",
    "WriteOutcome",
    "Writer",
    "is_transient",
    "utcnow",
]
