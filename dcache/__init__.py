"""dcache: the durable store behind ``batch``, on SQLAlchemy Core.

SQLite by default (a file, or :meth:`DB.memory` for tests); PostgreSQL (psycopg 3) and
MySQL/MariaDB (PyMySQL) when several processes or hosts share one database.
"""

from __future__ import annotations

from ._db import DB, Writer, utcnow
from ._errors import (
    NoStoreError,
    PoolExhaustedError,
    ResultTooLargeError,
    SchemaVersionError,
    StoreClosedError,
    StoreError,
    StoreUnavailableError,
    is_transient,
)
from ._reads import JobStream
from ._rows import (
    JobRow,
    Lookup,
    NewTarget,
    NotificationRow,
    OwnerRow,
    SubmitOutcome,
    TargetRow,
    WriteOutcome,
)
from ._schema import (
    DELIVERY_STATUSES,
    JOB_STATUSES,
    LIVE,
    SCHEMA_VERSION,
    TARGET_STATUSES,
    TERMINAL,
    Delivery,
    Status,
)
from ._upkeep import TOMBSTONE_TTL

__all__ = [
    "DB",
    "DELIVERY_STATUSES",
    "JOB_STATUSES",
    "LIVE",
    "SCHEMA_VERSION",
    "TARGET_STATUSES",
    "TERMINAL",
    "TOMBSTONE_TTL",
    "Delivery",
    "JobRow",
    "JobStream",
    "Lookup",
    "NewTarget",
    "NoStoreError",
    "NotificationRow",
    "OwnerRow",
    "PoolExhaustedError",
    "ResultTooLargeError",
    "SchemaVersionError",
    "Status",
    "StoreClosedError",
    "StoreError",
    "StoreUnavailableError",
    "SubmitOutcome",
    "TargetRow",
    "WriteOutcome",
    "Writer",
    "is_transient",
    "utcnow",
]
