"""Schema creation, its version row and in-place migrations.

Creating the schema from several processes at once is safe: creators are serialised
by an advisory lock (PostgreSQL), a named lock (MySQL/MariaDB, whose DDL commits
implicitly) or the write lock (SQLite).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, bindparam, func, insert, select, text, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.schema import CreateColumn

from . import _sql as sql
from ._errors import NoStoreError, SchemaVersionError, StoreError, wrap_errors
from ._schema import GLOBAL_LOCK, NOPAD_COLLATIONS, SCHEMA_VERSION, locks, meta, metadata

log = logging.getLogger("dcache")


class SchemaSetup:
    """The schema methods of :class:`DB` (run once, when the store is built)."""

    if TYPE_CHECKING:
        _engine: Engine

        def _read(self) -> AbstractContextManager[Connection]: ...

        _wengine: Engine

        dialect: str

        io_timeout: float | None

    @wrap_errors
    def _create_schema(self) -> None:
        if self.dialect in ("mysql", "mariadb"):
            # MySQL commits DDL implicitly, so serialise creators with a named lock.
            with self._engine.connect() as conn:
                self._get_schema_lock(conn)
                try:
                    self._choose_nopad_collation(conn)
                    self._tables(conn)
                    self._init_meta(conn)
                    conn.commit()
                finally:
                    conn.execute(select(func.release_lock("dcache_schema")))
                    conn.commit()
            return
        # On the pool, not the group writer's connection: the store is being built, no
        # drain writes yet, and that connection is opened only when first used.
        with self._wengine.begin() as conn:
            if self.dialect == "postgresql":
                conn.execute(select(func.pg_advisory_xact_lock(0x6463616368)))
            self._tables(conn)
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
                text(sql.MYSQL_COLLATIONS).bindparams(bindparam("names", expanding=True)),
                {"names": list(NOPAD_COLLATIONS)},
            ).scalars()
        )
        chosen = next((c for c in NOPAD_COLLATIONS if c in have), None)
        if chosen is not None:
            conn.dialect.dcache_collation = chosen  # type: ignore[attr-defined]

    @staticmethod
    def _tables(conn: Connection) -> None:
        """Create the tables that are missing, bring older ones up to date, or refuse.

        One inspection of the catalog for all the tables: one query each for the table
        names, their columns and (in a database that records an older version) their
        indexes, where the dialect batches them, as PostgreSQL's does. Reflecting each
        table twice, as before, was most of the time a ``DB.open`` took on a server.

        ``create_all`` never alters an existing table. A column that can be added to a
        populated table (one with a server default, or nullable) is added here, and so
        is a missing index (looked for only in a database that records an older
        version), so a version-1 database moves on without losing its jobs.
        Tables that lack any other column this version needs (made by an older
        development build) are refused: they would fail later, on some query, with an
        "unknown column" error.
        """
        inspector = sa_inspect(conn)
        names = [t.name for t in metadata.sorted_tables]
        existing = set(inspector.get_table_names())
        # The version first: a newer schema is refused before any change to it (on
        # MySQL/MariaDB each DDL statement commits at once, whatever fails after it).
        found = _read_version(conn) if meta.name in existing else None
        if found is not None and found > SCHEMA_VERSION:
            raise _newer(found)
        if set(names) <= existing:
            # Indexes are added by the migration to this version, which records it last.
            migrated = found == SCHEMA_VERSION
        else:
            metadata.create_all(conn)  # checkfirst: only the missing ones
            inspector = sa_inspect(conn)  # a fresh cache: it has seen no tables yet
            migrated = False
        columns = inspector.get_multi_columns(filter_names=names)
        indexes = {} if migrated else inspector.get_multi_indexes(filter_names=names)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in columns[(None, table.name)]}
            for column in table.columns:
                if column.name in have or not (column.nullable or column.server_default):
                    continue
                ddl = CreateColumn(column).compile(dialect=conn.dialect)
                log.warning("adding column %s.%s to an older schema", table.name, column.name)
                conn.execute(text(sql.add_column(table.name, str(ddl))))
                have.add(column.name)
            missing = sorted(c.name for c in table.columns if c.name not in have)
            if missing:
                raise SchemaVersionError(
                    f"table {table.name} lacks column(s) {', '.join(missing)}: it was made "
                    "by an older development build of dcache; migrate it or use a new database"
                )
            if migrated:
                continue
            indexed = {i["name"] for i in indexes[(None, table.name)]}
            for index in table.indexes:
                if index.name not in indexed:
                    log.warning("adding index %s to an older schema", index.name)
                    index.create(conn)

    @staticmethod
    def _init_meta(conn: Connection) -> None:
        found = _read_version(conn)
        if found is None:
            conn.execute(insert(meta).values(key="schema_version", value=str(SCHEMA_VERSION)))
        elif found < SCHEMA_VERSION:  # _tables brought the tables up to date
            conn.execute(
                update(meta).where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
            )
        elif found > SCHEMA_VERSION:  # a creator that raced ours recorded a newer one
            raise _newer(found)
        has_global = conn.execute(select(locks.c.name).where(locks.c.name == GLOBAL_LOCK)).first()
        if has_global is None:
            conn.execute(insert(locks).values(name=GLOBAL_LOCK))

    @wrap_errors
    def _check_schema(self) -> None:
        """(``create=False``.) Refuse a database whose schema is not exactly this
        version's, running no DDL and writing nothing.

        Raises:
            NoStoreError: the store's tables are not there (or no version is recorded).
            SchemaVersionError: the schema is older (a writer must upgrade it first) or
                newer (upgrade the library) than this dcache's.
        """
        with self._read() as conn:
            if not sa_inspect(conn).has_table(meta.name):
                raise NoStoreError(
                    f"no batch store in {_where(conn)}: table {meta.name} is missing; "
                    "check the URL (opening the store to write creates one)"
                )
            found = _read_version(conn)
        if found is None:
            raise NoStoreError(
                f"no batch store in {_where(conn)}: table {meta.name} records no schema "
                "version (its creation did not finish); opening it to write completes it"
            )
        if found > SCHEMA_VERSION:
            raise _newer(found)
        if found < SCHEMA_VERSION:
            err = SchemaVersionError(
                f"database schema version {found} is older than this dcache's "
                f"{SCHEMA_VERSION}, and this reader changes nothing: a writer of version "
                f"{SCHEMA_VERSION} (a runner, or DB.open without create=False) must "
                "upgrade it first"
            )
            err.found = found
            raise err

    @wrap_errors
    def schema_version(self) -> int:
        """The schema version recorded in the database."""
        with self._read() as conn:
            found = _read_version(conn)
        return 0 if found is None else found


def _newer(found: int) -> SchemaVersionError:
    err = SchemaVersionError(
        f"database schema version {found} is newer than this dcache's {SCHEMA_VERSION}: "
        "upgrade the library"
    )
    err.found = found
    return err


def _where(conn: Connection) -> str:
    """The database a connection is on, password hidden, for a message."""
    return repr(conn.engine.url.render_as_string(hide_password=True))


def _read_version(conn: Connection) -> int | None:
    """The version the database records, or None; a value that is not one is refused."""
    value = conn.execute(select(meta.c.value).where(meta.c.key == "schema_version")).scalar()
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SchemaVersionError(
            f"database schema version {value!r} is not a version number: "
            "this database was not made by dcache, or was edited by hand"
        ) from None
