"""Core statements compiled once per dialect, for the paths that run on every target.

SQLAlchemy's ``Connection.execute(statement)`` looks the statement up in its compiled
cache, builds an execution context and processes every parameter on each call: for the
per-target write that costs as much as SQLite's own work. A :class:`Prepared` is the same
Core statement, built from the same ``Table`` objects, compiled once for the engine's
dialect; each call only converts its values with the columns' own bind processors and
runs the SQL with ``Connection.exec_driver_sql``, so engine events (``echo``, tracing),
error wrapping and connection invalidation still apply. Rows coming back are converted
with the result processors of the column types the caller names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import CursorResult, Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.types import TypeEngine

__all__ = ["Prepared"]

_Processor = Callable[[Any], Any] | None
_CACHE: dict[tuple[Any, ...], Prepared] = {}
_CACHE_MAX = 1024


def _dialect_key(dialect: Dialect) -> tuple[Any, ...]:
    """What a dialect's compilation can depend on: its class and every plain setting it
    holds (server version, paramstyle, MariaDB or not, escapes, ...), as they are now.

    Two dialects with the same key compile a statement alike; one that changes a setting
    (its first connection reads the server's) gets a key of its own.
    """
    settings = []
    kind = type(dialect)
    for name, value in sorted(vars(dialect).items()):
        if hasattr(getattr(kind, name, None), "__get__"):
            continue  # a memoized property: derived from the rest, and cached when first read
        if isinstance(value, (bool, int, float, str, tuple, type(None))):
            try:
                hash(value)
            except TypeError:
                continue
            settings.append((name, value))
    return (kind, tuple(settings))


class Prepared:
    """One Core statement compiled for one dialect (see the module docstring).

    Args:
        statement: the Core statement; its values to be given per call are
            ``bindparam(name)`` without a value, everything else is fixed at compile.
        dialect: the dialect to compile for.
        result_types: the SQL types of the columns the statement returns, in order, whose
            result processors :meth:`convert` applies.
    """

    def __new__(
        cls,
        statement: ClauseElement,
        dialect: Dialect,
        result_types: Sequence[TypeEngine[Any]] = (),
    ) -> Prepared:
        # Compiling was half of the time a store took to open: one compiled form is kept
        # per statement object and dialect configuration (nothing in a Prepared changes
        # once built). The statements are module-level objects, so the cache stays as
        # small as the code; past _CACHE_MAX (statements built per call) it stops growing.
        key = (statement, _dialect_key(dialect), tuple(repr(t) for t in result_types))
        found = _CACHE.get(key)
        if found is None:
            found = super().__new__(cls)
            found._build(statement, dialect, result_types)
            if len(_CACHE) < _CACHE_MAX:
                _CACHE[key] = found
        return found

    def _build(
        self,
        statement: ClauseElement,
        dialect: Dialect,
        result_types: Sequence[TypeEngine[Any]],
    ) -> None:
        compiled = statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        self.sql: str = compiled.string
        self._positional = bool(compiled.positional)
        by_name = {name: bind for bind, name in compiled.bind_names.items()}
        if self._positional:
            self._order: list[str] = list(compiled.positiontup or ())
        else:
            self._order = sorted(by_name)
        self._fixed: dict[str, Any] = {}
        self._given: dict[str, _Processor] = {}
        for name in dict.fromkeys(self._order):
            bind = by_name[name]
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._given[name] = process
            else:
                value = bind.effective_value
                self._fixed[name] = process(value) if process is not None else value
        # Positional: a template of the fixed values, and the slots each given value fills.
        self._template = [self._fixed.get(name) for name in self._order]
        self._slots = [(i, name) for i, name in enumerate(self._order) if name in self._given]
        self._processes = list(self._given.items())
        processors = [t.dialect_impl(dialect).result_processor(dialect, None) for t in result_types]
        self._results: list[tuple[int, Callable[[Any], Any]]] = [
            (i, p) for i, p in enumerate(processors) if p is not None
        ]

    def params(self, values: Mapping[str, Any]) -> tuple[Any, ...] | dict[str, Any]:
        """The driver's parameters for ``values`` (one per ``bindparam`` name)."""
        given = {}
        for name, process in self._processes:
            value = values[name]
            given[name] = process(value) if process is not None else value
        if self._positional:
            out = self._template.copy()
            for i, name in self._slots:
                out[i] = given[name]
            return tuple(out)
        if self._fixed:
            given.update(self._fixed)
        return given

    def execute(self, conn: Connection, **values: Any) -> CursorResult[Any]:
        """Run the statement on ``conn`` with ``values``."""
        return conn.exec_driver_sql(self.sql, self.params(values))

    def convert(self, row: Sequence[Any], start: int = 0) -> tuple[Any, ...]:
        """A returned row, each column from ``start`` on converted by its type's processor.

        Columns before ``start`` are left as the driver returned them.
        """
        out = list(row)
        for i, process in self._results:
            if i >= start:
                out[i] = process(out[i])
        return tuple(out)
