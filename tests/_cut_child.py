"""The child process of the cut-point test: it runs one scenario and dies at the cut.

:func:`run` is a ``multiprocessing`` target (started from a ``forkserver`` that imported
this module, so a trial costs a fork, not an interpreter start-up). It opens the store
under test with the cut machinery armed around the scenario's call, and at the chosen
statement ends the process with ``os._exit(EXIT_CODE)``:

- SQLite: the store's connections are :class:`CutConnection` (a ``sqlite3.Connection``
  factory) whose cursors count every statement run on a counted thread and exit before
  statement ``n`` (``before``), or after it has run (``after``; for a COMMIT, ``commit``:
  the commit is on disk, the call never returns).
- PostgreSQL and MariaDB: the store connects through a :class:`_wireproxy.WireProxy` in
  this process with ``action="exit"``.

Statements of the runner's own timers (heartbeat, purge) are not counted, so a cut point
names the same statement in every run. A child that was not cut writes what happened
(the statements seen, the return value or error) as JSON to ``spec["out"]``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import threading
from typing import Any

from _cut_scenarios import BACKGROUND, RUNNER, STORE, Ctx, Env, Fetch, SplitDB, _err
from _wireproxy import EXIT_CODE, Cut, Unit, WireProxy, upstream_of, wire_url

import batch
import dcache


class _Arm:
    """The SQLite hook's state: numbering on or off, the cut, the statements seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed = False
        self.cut: Cut | None = None
        self.count = 0
        self.units: list[Unit] = []

    def arm(self, cut: Cut | None) -> None:
        with self.lock:
            self.armed, self.cut, self.count, self.units = True, cut, 0, []

    def disarm(self) -> tuple[list[Unit], Unit | None]:
        with self.lock:
            self.armed = False
            return list(self.units), None

    def statement(self, sql: str, *, commit: bool) -> str | None:
        """Number a statement about to run; return the cut kind due at it, if any."""
        if threading.current_thread().name.startswith(BACKGROUND):
            return None
        with self.lock:
            if not self.armed:
                return None
            self.count += 1
            self.units.append(Unit(self.count, 0, " ".join(sql.split())[:120], commit))
            cut = self.cut
            if cut is None or cut.n != self.count:
                return None
            if cut.kind == "commit" and not commit:
                return None
            return cut.kind


ARM = _Arm()


def _is_commit(sql: str) -> bool:
    return sql.strip().upper().startswith(("COMMIT", "END"))


def _around(sql: str, commit: bool, run: Any) -> Any:
    kind = ARM.statement(sql, commit=commit)
    if kind == "before":
        os._exit(EXIT_CODE)
    out = run()
    if kind is not None:
        os._exit(EXIT_CODE)  # after the statement (a COMMIT: on disk, never returned)
    return out


class CutCursor(sqlite3.Cursor):
    """A cursor whose statements :data:`ARM` numbers and may cut."""

    def execute(self, sql: str, parameters: Any = (), /) -> Any:  # type: ignore[override]
        return _around(
            sql, _is_commit(sql), lambda: super(CutCursor, self).execute(sql, parameters)
        )

    def executemany(self, sql: str, seq: Any, /) -> Any:  # type: ignore[override]
        return _around(sql, False, lambda: super(CutCursor, self).executemany(sql, seq))


class CutConnection(sqlite3.Connection):
    """A ``sqlite3`` connection factory whose cursors are :class:`CutCursor`."""

    def cursor(self, factory: Any = CutCursor) -> Any:  # type: ignore[override]
        return super().cursor(factory)

    def execute(self, sql: str, parameters: Any = (), /) -> Any:  # type: ignore[override]
        return self.cursor().execute(sql, parameters)

    def commit(self) -> None:
        if not self.in_transaction:
            return super().commit()  # a no-op: no statement reaches SQLite
        return _around("COMMIT", True, super().commit)  # type: ignore[no-any-return]

    def rollback(self) -> None:
        if not self.in_transaction:
            return super().rollback()
        return _around("ROLLBACK", False, super().rollback)  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    """A JSON-able form of a scenario's outcome (exceptions become their name)."""
    if isinstance(value, BaseException):
        return _err(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def run(spec: dict[str, Any]) -> None:
    """Run ``spec["scenario"]`` on ``spec["url"]``, cut at ``spec["cut"]`` (n, kind)."""
    cut = Cut(*spec["cut"]) if spec["cut"] else None
    now = dt.datetime.fromisoformat(spec["now"])
    url = spec["url"]
    proxy: WireProxy | None = None
    if url.startswith("sqlite"):

        def open_db(cls: type[dcache.DB] = dcache.DB) -> dcache.DB:
            return cls.open(
                url,
                connect_args={
                    "factory": CutConnection,
                    "check_same_thread": False,
                    "timeout": 30.0,
                },
            )

        def arm() -> None:
            ARM.arm(cut)

        def disarm() -> list[Unit]:
            return ARM.disarm()[0]

    else:
        protocol, host, port = upstream_of(url)
        proxy = WireProxy(protocol, host, port, action="exit").start()
        cut_url = wire_url(url, proxy.port)

        def open_db(cls: type[dcache.DB] = dcache.DB) -> dcache.DB:
            return cls.open(cut_url)

        def arm() -> None:
            assert proxy is not None
            proxy.arm(cut)

        def disarm() -> list[Unit]:
            assert proxy is not None
            return proxy.disarm()[0]

    result: dict[str, Any] = {}
    units: list[Unit] = []
    name = spec["scenario"]
    if name in STORE:
        db = open_db()
        arm()
        try:
            result["value"] = _plain(STORE[name].fn(db, Ctx(now=now, open_db=open_db)))
        except Exception as exc:
            result["error"] = _err(exc)
        units = disarm()
        db.close()
    else:
        side = dcache.DB.open(url)
        db = open_db(SplitDB)
        db._side = side  # type: ignore[attr-defined]
        fetch = Fetch(log=spec["fetch_log"])
        runner = batch.Runner(db, fetch, batch.Config(heartbeat=dt.timedelta(seconds=0.2)))
        seen: list[Unit] = []

        def disarm_runner() -> None:
            seen.extend(disarm())

        env = Env(runner, fetch, spec["tag"], arm, disarm_runner, wait=spec["wait"])
        result = _plain(RUNNER[name](env))
        units = seen
        runner.close(timeout=5)
        db.close()
        side.close()
    if proxy is not None:
        proxy.close()
    with open(spec["out"], "w", encoding="utf-8") as f:
        json.dump({"result": result, "units": [[u.n, u.text, u.commit] for u in units]}, f)
