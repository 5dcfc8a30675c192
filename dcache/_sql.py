"""The only SQL text in the store: what SQLAlchemy Core does not write for us.

Every query and change of rows is built from the ``Table``s in :mod:`dcache._schema`
and compiled per dialect. What is left is spelled here, once, each with its reason:

- SQLite's connection settings (``PRAGMA``) and transaction control: pysqlite's own
  ``BEGIN`` handling is turned off so that writes can start with ``BEGIN IMMEDIATE`` (a
  write lock up front, as ``FOR UPDATE`` renders nothing on SQLite). Core has no
  construct for either.
- MySQL/MariaDB server variables and the catalog of collations, read once per store.
- SQLite's catalog, looked at read-only on a raw connection before ``DB.open(...,
  create=False)`` builds an engine, whose connections would switch the file to WAL.
- SQLite's WAL checkpoints, moved off the write path (see ``dcache._checkpoint``).
- ``ALTER TABLE ... ADD COLUMN``: Core compiles the column (``CreateColumn``) but has no
  statement that adds one to an existing table (that is Alembic's job, too heavy here).
"""

from __future__ import annotations

__all__ = [
    "MYSQL_COLLATIONS",
    "MYSQL_MAX_PACKET",
    "SQLITE_BEGIN",
    "SQLITE_BEGIN_WRITE",
    "SQLITE_CHECKPOINT",
    "SQLITE_COMMIT",
    "SQLITE_ENCODING",
    "SQLITE_HAS_TABLE",
    "SQLITE_JOURNAL_MODE",
    "SQLITE_ROLLBACK",
    "SQLITE_SHRINK_MEMORY",
    "SQLITE_WAL",
    "SYNCHRONOUS",
    "add_column",
    "sqlite_autocheckpoint",
    "sqlite_pragmas",
]

SQLITE_BEGIN = "BEGIN"
SQLITE_BEGIN_WRITE = "BEGIN IMMEDIATE"
SQLITE_COMMIT = "COMMIT"
SQLITE_ROLLBACK = "ROLLBACK"
SQLITE_JOURNAL_MODE = "PRAGMA journal_mode"
SQLITE_WAL = "PRAGMA journal_mode = WAL"
# The file's text encoding: UTF-8 lets a stored text be read in place as its UTF-8 bytes.
SQLITE_ENCODING = "PRAGMA encoding"
# Give back the connection's unused page cache: after a slice of a large value is read,
# so its pages do not stay cached (up to 2 MiB a connection) for a value read once.
SQLITE_SHRINK_MEMORY = "PRAGMA shrink_memory"
# Whether a file holds a table of this name (one parameter), on a raw sqlite3 connection.
SQLITE_HAS_TABLE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
# A checkpoint that waits for no reader or writer (see dcache._checkpoint).
SQLITE_CHECKPOINT = "PRAGMA wal_checkpoint(PASSIVE)"

MYSQL_MAX_PACKET = "SELECT @@max_allowed_packet"
# Which of the wanted collations this server has (an expanding ``names`` parameter).
MYSQL_COLLATIONS = (
    "SELECT COLLATION_NAME FROM information_schema.COLLATIONS WHERE COLLATION_NAME IN :names"
)

SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


def sqlite_pragmas(*, busy_timeout: float, synchronous: str) -> tuple[str, str, str]:
    """A new SQLite connection's settings: lock wait, durability, foreign keys.

    The values are checked here, as a ``PRAGMA`` takes no bound parameters.
    """
    if synchronous not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
    return (
        f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}",
        f"PRAGMA synchronous = {synchronous}",
        "PRAGMA foreign_keys = ON",
    )


def sqlite_autocheckpoint(pages: int) -> str:
    """A connection's own WAL checkpoint threshold, in pages (a PRAGMA takes no parameter)."""
    return f"PRAGMA wal_autocheckpoint = {int(pages)}"


def add_column(table: str, column_ddl: str) -> str:
    """Add a column (compiled by Core's ``CreateColumn``) to an existing table."""
    return f"ALTER TABLE {table} ADD COLUMN {column_ddl}"
