"""What the command line shows people: tables fitted to the terminal, the live redraw,
result files, and errors that say what to check.

Scripts never see any of this: piped (or with ``--json``) the CLI prints JSON lines.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import os
import re
import shutil
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import IO, NamedTuple

from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import registry
from sqlalchemy.engine import make_url

from dcache import SCHEMA_VERSION, NoStoreError, SchemaVersionError, StoreError

from ._values import Job, Result, TargetStatus

__all__ = [
    "OpenFailure",
    "Redraw",
    "check_db_url",
    "display_width",
    "explain_open_failure",
    "fit",
    "job_lines",
    "result_file_name",
    "table",
    "target_rows",
    "terminal_width",
    "when",
    "write_result",
]

_ELLIPSIS = "…"
_MIN_URL = 12  # never squeeze a URL column below this, even on a narrow terminal
_WRAPPED_CAUSE = re.compile(r"^\w+: \([\w.]+\)\s*")  # "OperationalError: (psycopg.X) "
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_URL_SHAPE = re.compile(r"^[A-Za-z][\w+.-]*://")
# libpq refusing a connection string (psycopg reports it as a connection failure):
# ?sslmode=bogus, ?foo=1, a port out of range. The URL is wrong, not the server.
_BAD_CONNINFO = re.compile(r"\binvalid (?:connection option|port number|\w+ value)\b")
_EXAMPLES = "e.g. sqlite:///batch.sqlite3 or postgresql+psycopg://user@host/db"
_SUPPORTED = (
    "batch runs on SQLite, PostgreSQL or MySQL/MariaDB: sqlite:///FILE, "
    "postgresql+psycopg://USER@HOST/DB or mysql+pymysql://USER@HOST/DB"
)
# The drivers the extras install, and the URL scheme that names each.
_DRIVERS = {
    "postgresql": ("psycopg", "postgresql+psycopg://", "postgres"),
    "mysql": ("pymysql", "mysql+pymysql://", "mysql"),
    "mariadb": ("pymysql", "mariadb+pymysql://", "mysql"),
}


def when(value: dt.datetime | None) -> str:
    """A UTC time as ``2030-01-01 12:00:00Z``, or ``-``."""
    if value is None:
        return "-"
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def terminal_width(stream: IO[str] | None = None) -> int:
    """The columns of the terminal behind ``stream`` (80 when it cannot tell)."""
    stream = stream or sys.stdout
    try:
        return max(os.get_terminal_size(stream.fileno()).columns, 20)
    except (OSError, ValueError, AttributeError):
        return shutil.get_terminal_size((80, 24)).columns


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def display_width(text: str) -> int:
    """Columns ``text`` takes on a terminal (wide East Asian characters count two)."""
    return sum(_char_width(ch) for ch in text)


def _printable(text: str) -> str:
    # Stored text comes from strangers (URLs, fetch errors): an escape sequence in it must
    # not move the cursor or retitle the terminal, so every control character is shown
    # escaped and every run of white space becomes one space.
    out = []
    for ch in " ".join(text.split()):
        if ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def fit(text: str, width: int) -> str:
    """``text`` made printable and cut to ``width`` columns, ending in ``…`` when cut."""
    text = _printable(text)
    if display_width(text) <= width:
        return text
    if width <= 0:
        return ""
    out: list[str] = []
    used = 0
    for ch in text:
        w = _char_width(ch)
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + _ELLIPSIS


def _pad(text: str, width: int) -> str:
    return text + " " * max(width - display_width(text), 0)


def table(
    rows: Sequence[Sequence[str]], width: int | None = None, shrink: Sequence[int] = (-1,)
) -> list[str]:
    """Lay out rows (the first is the header) in columns two spaces apart.

    With ``width``, no line is wider: the columns in ``shrink`` (the last by default)
    are cut with ``…``, in that order, down to their header's width; the others never
    are (an id is no use cut). Cells are made printable (no control characters).
    """
    rows = [[_printable(c) for c in row] for row in rows]
    ncols = len(rows[0])
    widths = [max(display_width(r[i]) for r in rows) for i in range(ncols)]
    if width is not None:
        over = sum(widths) + 2 * (ncols - 1) - width
        for i in (j % ncols for j in shrink):
            if over <= 0:
                break
            give = min(over, widths[i] - max(display_width(rows[0][i]), 1))
            if give > 0:
                widths[i] -= give
                over -= give
    lines = []
    for row in rows:
        cells = [fit(c, widths[i]) for i, c in enumerate(row)]
        line = "  ".join(_pad(c, widths[i]) for i, c in enumerate(cells))
        lines.append(line.rstrip())
    return lines


def target_rows(targets: Sequence[TargetStatus], width: int | None) -> list[str]:
    """The outcome table: index, status, stored bytes, URL, error (and hint)."""
    rows = [["IDX", "STATUS", "BYTES", "URL", "ERROR"]]
    for t in targets:
        if t.result_bytes is not None:
            size = str(t.result_bytes)
        elif t.result is not None:
            size = str(len(t.result.content.encode("utf-8", "surrogatepass")))
        else:
            size = "-"
        problem = t.error + (f" (hint: {t.hint})" if t.hint else "")
        rows.append([str(t.idx), t.status, size, t.url, problem])
    if width is not None and all(not r[4] for r in rows[1:]):
        rows = [r[:4] for r in rows]  # no errors: the URL may take the whole line
        return table(rows, width, shrink=(3,))
    if width is not None:
        # Share what is left between URL and ERROR: the URL gets up to half, at least
        # _MIN_URL columns; the error takes the rest.
        fixed = sum(max(display_width(r[i]) for r in rows) for i in range(3)) + 8
        room = max(width - fixed, 2 * _MIN_URL)
        url_w = max(min(max(display_width(_printable(r[3])) for r in rows), room // 2), _MIN_URL)
        rows = [[*r[:3], fit(r[3], url_w), r[4]] for r in rows]
    return table(rows, width, shrink=(4, 3))


def job_lines(job: Job, targets: Sequence[TargetStatus], width: int | None) -> list[str]:
    """A job's header (status, counts, caller, times) and its target table."""
    failed = f", {job.targets_failed} failed" if job.targets_failed else ""
    error = f" ({job.error})" if job.error else ""
    head = [
        f"job {job.id}: {job.status}{error}, {job.targets_done}/{job.targets_total} "
        f"target(s) stored{failed}",
        f"caller {job.caller} ({job.caller_class}); created {when(job.created_at)}; "
        f"finished {when(job.finished_at)}; expires {when(job.expires_at)}",
    ]
    # Escaped piped too: the caller and the job's error are stored text like any other.
    head = [_printable(h) if width is None else fit(h, width) for h in head]
    return [*head, *target_rows(targets, width)]


class Redraw:
    """Redraws a block of lines in place on a terminal (cursor up, clear to the end).

    Every line is cut to the terminal's width beforehand, so one line is one row and
    moving up by the number of lines printed lands on the block's first row.
    """

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._shown = 0

    def show(self, lines: Sequence[str]) -> None:
        """Replace the block shown last with ``lines``."""
        prefix = f"\x1b[{self._shown}F" if self._shown else "\r"
        self._out.write(prefix + "\x1b[J" + "".join(line + "\n" for line in lines))
        self._out.flush()
        self._shown = len(lines)


# -- result files --------------------------------------------------------------------------


def result_file_name(target: TargetStatus) -> str:
    """``<idx>-<last path segment or host>``, made safe as a file name (``.bin`` for
    base64 results, which are written decoded)."""
    url = target.url.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    # file:todo.txt has no "/": its name is what follows the scheme, not the whole URL.
    tail = url.rsplit("/", 1)[-1] if "/" in url else _SCHEME.sub("", url, count=1)
    if "://" in target.url and url.count("/") <= 2:  # scheme://host: name it after the host
        tail = url.split("://", 1)[1]
    slug = _SLUG.sub("_", tail).strip("._")[:60] or "result"
    binary = target.result is not None and target.result.meta.get("encoding") == "base64"
    return f"{target.idx:02d}-{slug}" + (".bin" if binary else "")


def write_result(directory: Path, target: TargetStatus) -> Path | None:
    """Write one target's result content into ``directory``; ``None`` when it has none."""
    result: Result | None = target.result
    if result is None:
        return None
    path = directory / result_file_name(target)
    if result.meta.get("encoding") == "base64":
        try:
            path.write_bytes(base64.b64decode(result.content, validate=True))
            return path
        except (binascii.Error, ValueError):
            pass  # not valid base64 after all: keep the text as stored
    path.write_text(result.content, encoding="utf-8", errors="surrogatepass")
    return path


# -- errors in the user's words ------------------------------------------------------------


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    while True:
        stripped = _WRAPPED_CAUSE.sub("", text)
        if stripped == text:
            break
        text = stripped
    text = re.sub(r"^cannot open .*?: ", "", text)
    return text.removeprefix("connection failed: ").strip()


class OpenFailure(NamedTuple):
    """Why the store did not open: one line to show, and whether the URL is at fault."""

    message: str
    bad_url: bool
    """The URL (its dialect, driver, port or options) is wrong: bad input, not the server."""


def check_db_url(url: str, shown_url: str) -> str | None:
    """What is wrong with a database URL before anything connects (one line), or ``None``.

    ``shown_url`` is ``url`` with its password hidden: the only form ever printed.
    """
    if not _URL_SHAPE.match(url):
        return f"--db {shown_url!r} is not a database URL ({_EXAMPLES})"
    try:
        u = make_url(url)
    except sa_exc.ArgumentError:
        return f"--db {shown_url!r} is not a database URL ({_EXAMPLES})"
    except ValueError:  # SQLAlchemy's int() of the port
        return f"--db {shown_url!r}: its port is not a number (1 to 65535)"
    if u.port is not None and not 0 < u.port <= 65535:
        return f"--db {shown_url!r}: its port {u.port} is not a port number (1 to 65535)"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (the store wraps the driver's)."""
    out: list[BaseException] = []
    at: BaseException | None = exc
    while at is not None and at not in out:
        out.append(at)
        at = at.__cause__ or at.__context__
    return out


def _no_such_dialect(url: str, shown_url: str) -> str:
    """SQLAlchemy knows no dialect or no driver by the URL's name."""
    drivername = make_url(url).drivername
    backend, _, driver = drivername.partition("+")
    try:
        registry.load(backend)
    except sa_exc.NoSuchModuleError:
        return f"--db {shown_url!r}: no database {backend!r} is known; {_SUPPORTED}"
    what = f"--db {shown_url!r}: no driver {driver!r} for {backend}"
    if backend == "sqlite":
        return f"{what}; use sqlite:///FILE"
    if backend in _DRIVERS:
        return f"{what}; use {_DRIVERS[backend][1]}"
    return f"{what}; {_SUPPORTED}"


def _driver_missing(url: str, shown_url: str, exc: ImportError) -> str:
    """The dialect is known but its driver does not import here."""
    u = make_url(url)
    backend = u.get_backend_name()
    try:
        driver = u.get_dialect().driver  # the default one when the URL names none
    except Exception:
        driver = u.drivername.partition("+")[2]
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        what = f"cannot open the database {shown_url}: its driver {exc.name!r} is not installed"
    else:
        what = f"cannot open the database {shown_url}: its driver does not import ({_cause(exc)})"
    if backend not in _DRIVERS:
        return f"{what}; {_SUPPORTED}"
    ours, scheme, extra = _DRIVERS[backend]
    install = f"pip install 'batch-dcache[{extra}]'"
    if driver == ours:
        return f"{what}; install it: {install}"
    return f"{what}; install it, or use {scheme} ({install})"


def _not_a_database(exc: BaseException) -> bool:
    """SQLite's SQLITE_NOTADB: the file is there and readable, but not a database."""
    return getattr(
        exc, "sqlite_errorname", ""
    ) == "SQLITE_NOTADB" or "file is not a database" in str(exc)


def _schema_mismatch(shown_url: str, exc: SchemaVersionError, cause: str) -> str:
    """A store of another schema version: which one, and who can do what about it."""
    found, ours = exc.found, SCHEMA_VERSION
    if found is not None and found > ours:
        return (
            f"the batch store in {shown_url} has schema version {found}, newer than this "
            f"batch-dcache's {ours}: upgrade batch-dcache here (pip install -U "
            "batch-dcache) to the version that created it"
        )
    if found is not None:
        return (
            f"the batch store in {shown_url} has schema version {found}, older than this "
            f"batch-dcache's {ours}; this command changes nothing: a writer of this version "
            "(`batch run`, `batch purge`, or the upgraded workers) upgrades it, after "
            "which older workers refuse it"
        )
    return f"the database {shown_url} holds a schema batch-dcache cannot use: {cause}"


def explain_open_failure(url: str, shown_url: str, exc: BaseException) -> OpenFailure:
    """One line: which database could not be opened, why, and what to check; and whether
    the URL itself is at fault (an unknown dialect or driver, a driver not installed, an
    option the driver refuses, a place that holds no store) rather than the server or the
    file it names."""
    cause = _cause(exc)
    low = cause.lower()
    try:
        u = make_url(url)
        backend = u.get_backend_name()
        host = u.host or "localhost"
        port = u.port
        database = u.database or ""
    except Exception:
        return OpenFailure(f"cannot open the database {shown_url}: {cause}", True)
    chain = _chain(exc)
    if any(isinstance(e, sa_exc.NoSuchModuleError) for e in chain):
        return OpenFailure(_no_such_dialect(url, shown_url), True)
    missing = next((e for e in chain if isinstance(e, ImportError)), None)
    if missing is not None:
        return OpenFailure(_driver_missing(url, shown_url, missing), True)
    if any(isinstance(e, NoStoreError) for e in chain):
        folder = str(Path(database).parent) if database else "."
        if backend == "sqlite" and database and not Path(folder).is_dir():
            detail = f"the folder {folder!r} does not exist (nothing was created)"
        elif backend == "sqlite" and database and not Path(database).exists():
            detail = f"the file {database!r} does not exist (nothing was created)"
        else:
            detail = "the database holds none of its tables (nothing was created)"
        return OpenFailure(
            f"no batch store at {shown_url}: {detail}; check --db or $BATCH_DB "
            "(`batch run` and `batch purge` create the store)",
            True,
        )
    schema = next((e for e in chain if isinstance(e, SchemaVersionError)), None)
    if schema is not None:
        return OpenFailure(_schema_mismatch(shown_url, schema, cause), False)
    options = "check the options after '?' in the URL" if u.query else "check the URL"
    if not isinstance(exc, StoreError):
        # Not a database failure (the store translates every one of those): the URL's
        # options were refused while building the engine (?pgbouncer=maybe, a keyword
        # PyMySQL does not take).
        return OpenFailure(f"cannot open the database {shown_url}: {cause}; {options}", True)
    if _BAD_CONNINFO.search(low):
        return OpenFailure(f"cannot open the database {shown_url}: {cause}; {options}", True)
    if backend == "sqlite" and database and Path(database).is_dir():
        example = f"sqlite:///{os.path.join(database, 'batch.sqlite3')}"
        return OpenFailure(
            f"--db {shown_url}: {database!r} is a folder, not a database file; name a "
            f"file in it (e.g. {example})",
            True,
        )
    if backend == "sqlite" and any(_not_a_database(e) for e in chain):
        return OpenFailure(
            f"--db {shown_url}: the file {database!r} is not a SQLite database (nothing was "
            "changed in it); check that --db or $BATCH_DB names the store's file",
            True,
        )
    if backend == "sqlite":
        where = Path(database).parent if database else Path()
        check = f"check that the folder {str(where) or '.'!r} exists and that you may write there"
        return OpenFailure(f"cannot open the SQLite database {shown_url}: {cause}; {check}", False)
    name = {"postgresql": "PostgreSQL", "mysql": "MySQL/MariaDB", "mariadb": "MariaDB"}.get(
        backend, backend
    )
    at = f"{host}:{port}" if port else host
    user = u.username or "the URL's user"
    if "permission denied for schema" in low or "create command denied" in low:
        return OpenFailure(
            f"cannot open the database {shown_url}: {cause}; {user} may not create the "
            f"store's tables in {database!r}: make it the database's owner "
            f"(createdb -O {user} ...) or GRANT it CREATE on the schema",
            False,
        )
    if "permission denied" in low or "command denied" in low:
        return OpenFailure(
            f"cannot open the database {shown_url}: {cause}; {user} lacks a privilege "
            "the store needs: GRANT it CONNECT on the database and SELECT, INSERT, "
            "UPDATE, DELETE on the store's tables (or use the role that created them)",
            False,
        )
    if re.search(r'role "[^"]*" does not exist|no such user', low):
        check = "check the user name and password in the URL"
    elif "does not exist" in low or "unknown database" in low or "no such database" in low:
        check = f"check the database name {database!r} (create it first)"
    elif "password" in low or "access denied" in low or "authentication" in low:
        check = "check the user name and password in the URL"
    else:
        check = (
            f"check that a {name} server is running and accepts connections on {at}, "
            "and that --db or $BATCH_DB names the right one"
        )
    return OpenFailure(f"cannot reach the database {shown_url}: {cause}; {check}", False)
