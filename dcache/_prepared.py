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

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import CursorResult, Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.types import TypeEngine

__all__ = ["Binder", "Prepared"]

_Processor = Callable[[Any], Any] | None
_CACHE: dict[tuple[Any, ...], Prepared] = {}
_CACHE_MAX = 1024
_TOKENS = itertools.count()  # each Prepared's own key for an unhashable fixed value


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
        self._types: dict[str, str] = {}  # each given value's SQL type (see Binder)
        for name in dict.fromkeys(self._order):
            bind = by_name[name]
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if bind.required:
                self._given[name] = process
                self._types[name] = repr(bind.type)
            else:
                value = bind.effective_value
                self._fixed[name] = process(value) if process is not None else value
        # Bound values (Binder.bind) hold each fixed value under a key made of the value
        # itself (anonymous names such as "param_1" mean another value in each statement;
        # the value's type is in the key, as 1 == True).
        token = next(_TOKENS)
        fixed_keys = {name: _fixed_key(token, name, value) for name, value in self._fixed.items()}
        self._fixed_keyed = {fixed_keys[name]: value for name, value in self._fixed.items()}
        keys = [name if name in self._given else fixed_keys[name] for name in self._order]
        self._pick: Callable[[Mapping[Any, Any]], Any] = (
            operator.itemgetter(*keys) if len(keys) > 1 else _one(keys[0] if keys else None)
        )
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

    def params_many(
        self, common: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Any, ...]] | list[dict[str, Any]]:
        """The driver's parameters for each of ``rows`` (an ``executemany``), the values
        in ``common`` shared by every row: those are converted once, not once a row.

        Each row gives the names ``common`` does not. As ``[params({**common, **row})
        for row in rows]``: the submit inserts a job's 32 targets, which differ in three
        values of ten.
        """
        shared = {
            name: process(common[name]) if process is not None else common[name]
            for name, process in self._processes
            if name in common
        }
        if not self._positional:
            varying = [(n, process) for n, process in self._processes if n not in common]
            base = {**shared, **self._fixed}
            out_named = []
            for row in rows:
                given = base.copy()
                for name, process in varying:
                    value = row[name]
                    given[name] = process(value) if process is not None else value
                out_named.append(given)
            return out_named
        template = self._template.copy()
        slots = []
        for i, name in self._slots:
            if name in shared:
                template[i] = shared[name]
            else:
                slots.append((i, name, self._given[name]))
        out = []
        for row in rows:
            params = template.copy()
            for i, name, process in slots:
                value = row[name]
                params[i] = process(value) if process is not None else value
            out.append(tuple(params))
        return out

    def bound(self, values: Mapping[Any, Any]) -> tuple[Any, ...] | dict[str, Any]:
        """The driver's parameters from values a :class:`Binder` of this statement bound
        (converted already): for a positional driver one C-level pick, in SQL order."""
        if self._positional:
            return self._pick(values)  # type: ignore[no-any-return]
        out = {name: values[name] for name in self._given}
        if self._fixed:
            out.update(self._fixed)
        return out

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


def _fixed_key(token: int, name: str, value: Any) -> tuple[Any, ...]:
    """The key of a fixed value among bound values: the value and its type (shared by
    every statement that fixes the same value), or the statement's own if unhashable."""
    try:
        hash(value)
    except TypeError:
        return (token, name)
    return (type(value), value)


def _one(key: Any) -> Callable[[Mapping[Any, Any]], tuple[Any, ...]]:
    """A pick of one key as a 1-tuple (``itemgetter`` of one key returns the item)."""
    if key is None:
        return lambda _values: ()
    return lambda values: (values[key],)


class Binder:
    """Values converted once for several :class:`Prepared` statements of one dialect.

    A transaction that runs several statements on the same values (the per-target write:
    the target's update, then the job's, with the same ``now`` and ``job_id``) converts
    each value by its type's bind processor once, in :meth:`bind`, instead of once per
    statement; each statement then takes its parameters from the bound values with
    :meth:`Prepared.bound` (for a positional driver, one ``itemgetter``). A name must have
    the same SQL type in every statement that takes it.
    """

    def __init__(self, statements: Iterable[Prepared]) -> None:
        self._fixed: dict[Any, Any] = {}
        processes: dict[str, _Processor] = {}
        types: dict[str, str] = {}
        for statement in statements:
            self._fixed.update(statement._fixed_keyed)
            for name, process in statement._given.items():
                kind = statement._types[name]
                if types.setdefault(name, kind) != kind:
                    raise ValueError(f"{name!r} is {types[name]} and {kind} in one Binder")
                processes[name] = process
        self._processes = [(name, p) for name, p in processes.items() if p is not None]

    def bind(self, values: Mapping[str, Any]) -> dict[Any, Any]:
        """``values`` converted (each name once) with every statement's fixed values."""
        bound = {**values, **self._fixed}
        for name, process in self._processes:
            bound[name] = process(bound[name])
        return bound
