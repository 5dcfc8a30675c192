"""The command line: ``python -m batch`` (or ``batch``) run, status [--watch], cancel, jobs,
purge, serve, completion.

Made for people on a terminal (tables cut to its width, a live redraw, errors that say what
to check) and for scripts everywhere else (piped or ``--json``: JSON lines, unchanged).

Exit statuses: 0 success (``run``: the job is done); 1 the job ended partial, failed or
cancelled, the job asked for does not exist, or the database failed in a way a retry will
not fix; 2 bad input or usage (a --db URL that is wrong, not unreachable, included); 75 busy
or the database unavailable (retry later); 130 interrupted (``run`` cancels its job first;
SIGTERM and SIGHUP do the same, exiting 143 and 129).

``run`` fetches with the library's :class:`~batch.fetchers.Fetcher` built for the
machine's own user: ``file:`` URLs and private and loopback addresses allowed (a web app
handing URLs from strangers to the default ``batch.fetchers.fetch`` gets neither). The
database password never appears in anything printed.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import datetime as dt
import importlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import dcache
from dcache import Status
from dcache._upkeep import MAX_TOMBSTONE_TTL

from . import _serve
from ._cli_show import (
    Redraw,
    check_db_url,
    explain_open_failure,
    job_lines,
    table,
    target_rows,
    terminal_width,
    when,
    write_result,
)
from ._errors import (
    BusyError,
    CallerBusyError,
    InvalidTargetsError,
    SubmitError,
    TooManyTargetsError,
)
from ._runner import _ORPHAN_BEATS, Fetch, Runner, _job, _target_status
from ._values import Checked, Job, TargetStatus
from .fetchers import Fetcher

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TEMPFAIL",
    "EXIT_USAGE",
    "StoreReader",
    "absolute_file_url",
    "local_fetch",
    "main",
    "read_targets",
    "redact_url",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TEMPFAIL = 75  # sysexits.h EX_TEMPFAIL: busy or database unavailable, retry later
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it

DEFAULT_DB = "sqlite:///batch.sqlite3"
MAX_TOMBSTONE_DAYS = MAX_TOMBSTONE_TTL.days  # DB.open's bound on tombstone_ttl
MAX_LIMIT = 1_000_000  # jobs --limit: far below the store's bound (2**63 - 1)
DEFAULT_FETCH = "batch._cli:local_fetch"
_POLL = 0.2  # seconds between progress updates while waiting
_SETTLE = 10.0  # seconds --watch waits for a terminal job's drain to report its end
# SQLAlchemy's own URL grammar: name://[user[:password]@]host...; the password is
# everything up to the last "@" before the host (it may hold ":" and "/").
_URL_CREDENTIALS = re.compile(r"^(?P<head>[\w+.-]+://[^:/@]*:)(?P<password>.*)(?P<at>@)(?=[^@]*$)")
_URL_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&]*)", re.IGNORECASE)
_secrets: set[str] = set()  # what _say never prints: the --db password, raw and unquoted

local_fetch: Fetch = Fetcher(schemes=("http", "https", "file"), allow=("0.0.0.0/0", "::/0"))
"""The CLI's default fetch: http, https and ``file:``, private and loopback addresses allowed.

The CLI's user is the machine's own: reading local files and reaching local services is
what they ask for. Web apps use :data:`batch.fetchers.fetch` (public addresses only).
"""


class InputError(Exception):
    """The targets file (or a command-line value) is unusable; the message says where."""


# -- input -------------------------------------------------------------------------------


def absolute_file_url(url: str, cwd: str) -> str:
    """``url`` unchanged, unless it is a relative ``file:`` URL (``file:notes.txt``,
    ``file:./sub/a.txt``): then the ``file:///...`` URL of that path in ``cwd``.

    The fetcher reads a relative path from the working directory, but a job's
    idempotency key is made from the URL's text: submitted as written, the same targets
    file run from another folder reused the first folder's job and its results.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "file" or parts.netloc or not parts.path:
        return url
    if parts.path.startswith("/"):
        return url
    path = os.path.normpath(os.path.join(cwd, unquote(parts.path)))
    absolute = Path(path).as_uri()
    if parts.query:
        absolute += f"?{parts.query}"
    if parts.fragment:
        absolute += f"#{parts.fragment}"
    return absolute


def read_targets(lines: Iterable[str], source: str = "<stdin>", cwd: str | None = None) -> Checked:
    """Parse targets: one URL a line, or one JSON object a line (``{"url", "options"}``).

    Blank lines and lines starting with ``#`` are skipped. Raises :class:`InputError`
    naming the line at fault (bad JSON, an invalid target, a duplicate, no targets).
    With ``cwd``, a relative ``file:`` URL is made the absolute URL of that path in
    ``cwd`` (see :func:`absolute_file_url`), so its key names the real file.
    Returns them checked and sealed, so the submit takes them as they are.
    """
    items: list[object] = []
    where: list[int] = []
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                item: object = json.loads(line)
            except ValueError as exc:
                raise InputError(f"{source}:{lineno}: not valid JSON: {exc}") from None
            except RecursionError:  # valid, but nested deeper than the parser follows
                raise InputError(f"{source}:{lineno}: JSON nested too deeply") from None
        elif any(c.isspace() for c in line):
            raise InputError(
                f"{source}:{lineno}: one URL a line, or a JSON object with options; "
                f"got {line[:80]!r}"
            )
        else:
            item = {"url": line}
        if cwd is not None and isinstance(item, dict) and isinstance(item.get("url"), str):
            item = {**item, "url": absolute_file_url(item["url"], cwd)}
        items.append(item)
        where.append(lineno)
    if not items:
        raise InputError(f"{source}: no targets (one URL a line, or JSON lines)")
    try:
        return Checked(items)
    except InvalidTargetsError as exc:
        at = f"{source}:{where[exc.index]}" if exc.index is not None else source
        raise InputError(f"{at}: {exc}") from None


def _read_file(path: str) -> Checked:
    if path == "-":
        # Closed (`<&-`): Python sets sys.stdin to None.
        buffer = getattr(sys.stdin, "buffer", None)
        if buffer is None:
            raise InputError("<stdin>: standard input is closed; give a FILE instead of -")
        try:
            data = buffer.read()
        except OSError as exc:
            raise InputError(f"<stdin>: cannot read: {exc.strerror or exc}") from None
        return read_targets(_text_lines(data, "<stdin>"), "<stdin>", os.getcwd())
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return read_targets(_text_lines(data, path), path, os.getcwd())


def _text_lines(data: bytes, source: str) -> list[str]:
    """The lines of a targets file as text mode reads them (``\\n``, ``\\r\\n`` or ``\\r``
    ends one); a byte that is not UTF-8 is an error naming its line and column."""
    # A byte-order mark (Windows editors write one) is not part of a URL.
    data = data.removeprefix(codecs.BOM_UTF8)
    lines = []
    for lineno, raw in enumerate(data.splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{source}:{lineno}: not UTF-8 text: byte 0x{raw[exc.start]:02x} "
                f"at column {exc.start + 1}"
            ) from None
    return lines


def _load_fetch(spec: str) -> Fetch:
    """The callable ``module:attr`` names (``run --fetch`` and ``serve --fetch``); a module
    in the working directory is found however the CLI was started."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"--fetch {spec!r}: use module:callable (e.g. {DEFAULT_FETCH})")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules are found
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"--fetch {spec!r}: cannot import {module_name}: {exc}") from None
    except Exception as exc:  # the module itself is broken: a SyntaxError, a raise
        said = str(exc).strip().splitlines()
        raise InputError(
            f"--fetch {spec!r}: cannot import {module_name}: {type(exc).__name__}"
            + (f": {said[0]}" if said else "")
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise InputError(f"--fetch {spec!r}: {module_name} has no {attr}") from None
    if not callable(obj):
        raise InputError(f"--fetch {spec!r}: {attr} is not callable")
    fetch: Fetch = obj
    return fetch


# -- output ------------------------------------------------------------------------------


def _say(message: str) -> None:
    for secret in sorted(_secrets, key=len, reverse=True):
        message = message.replace(secret, "***")
    # stderr may be gone (a hung-up terminal): saying so must not stop what follows.
    with contextlib.suppress(OSError):
        print(f"batch: {message}", file=sys.stderr, flush=True)


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***`` (as SQLAlchemy renders it)."""
    url = _URL_CREDENTIALS.sub(r"\g<head>***\g<at>", url, count=1)
    return _URL_QUERY_PASSWORD.sub(r"\g<head>***", url)


def _remember_secret(url: str) -> None:
    found = [
        m["password"]
        for m in (_URL_CREDENTIALS.match(url), *_URL_QUERY_PASSWORD.finditer(url))
        if m
    ]
    for password in found:
        _secrets.update({password, unquote(password)} - {""})


def _emit(obj: object) -> None:
    """One JSON line on stdout, UTF-8 whatever the locale says (JSON Lines is UTF-8)."""
    _write(json.dumps(obj, ensure_ascii=False) + "\n")


def _write(text: str) -> None:
    """``text`` on stdout as UTF-8, flushed."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        sys.stdout.flush()
        buffer.write(text.encode("utf-8"))
        buffer.flush()
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _summary(job: Job) -> str:
    failed = f", {job.targets_failed} failed" if job.targets_failed else ""
    error = f" ({job.error})" if job.error else ""
    return (
        f"job {job.id}: {job.status}{error}, {job.targets_done}/{job.targets_total} "
        f"target(s) stored{failed}"
    )


class _Bar(Protocol):
    def update(self, job: Job) -> None: ...
    def close(self) -> None: ...


class _NoBar:
    def update(self, job: Job) -> None:
        pass

    def close(self) -> None:
        pass


class _TqdmBar:
    """A tqdm progress bar on stderr (tqdm is optional: ``pip install batch-dcache[cli]``)."""

    def __init__(self, tqdm: Any, job: Job) -> None:
        self._bar = tqdm(
            total=job.targets_total,
            initial=job.targets_done,
            desc=f"job {job.id[:8]}",
            unit="target",
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
        )
        self._done = job.targets_done

    def update(self, job: Job) -> None:
        if job.targets_done > self._done:
            self._bar.update(job.targets_done - self._done)
            self._done = job.targets_done
        self._bar.set_postfix_str(job.status, refresh=True)

    def close(self) -> None:
        self._bar.close()


class _LineBar:
    """The fallback without tqdm: one self-rewriting status line on stderr."""

    def __init__(self, job: Job) -> None:
        self._width = 0
        self.update(job)

    def update(self, job: Job) -> None:
        total = max(job.targets_total, 1)
        filled = 24 * job.targets_done // total
        text = (
            f"job {job.id[:8]} [{'#' * filled}{'.' * (24 - filled)}] "
            f"{job.targets_done}/{job.targets_total} {job.status}"
        )
        self._width = max(self._width, len(text))
        sys.stderr.write("\r" + text.ljust(self._width))
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * self._width + "\r")
        sys.stderr.flush()


def _progress(job: Job, enabled: bool) -> _Bar:
    if not enabled:
        return _NoBar()
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return _LineBar(job)
    return _TqdmBar(tqdm, job)


# -- Ctrl-C, SIGTERM, SIGHUP ---------------------------------------------------------------


class _Interrupts:
    """SIGINT, SIGTERM and SIGHUP handling for ``run``: the handler counts, the main loop
    acts.

    The first signal cancels the job (the target in flight is stored); a second one,
    however quick, still cancels it and then leaves without waiting. The handler itself
    never raises, so a signal cannot cut the cancel's own transaction short; only a
    third one, for a main thread stuck elsewhere, raises ``KeyboardInterrupt``. SIGTERM
    (a service manager's stop, ``kill``) and SIGHUP (the terminal closed) act as Ctrl-C
    does: dying on them left the job ``running`` with nobody draining it, and its caller
    refused as busy on every retry. A SIGHUP ignored when the CLI started (``nohup``)
    stays ignored. The exit status is 128 plus the first signal's number, as shells
    report a death by it.

    Python runs a handler once for signals that arrive before it gets to run (two quick
    Ctrl-Cs while the main thread waits on a lock look like one), so the count comes
    from the wakeup fd, where the C-level handler writes one byte per delivery.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, args: argparse.Namespace) -> None:
        self.asked = threading.Event()
        self.count = 0
        self.signum: int | None = None
        """The first signal received (it sets the exit status)."""
        self._args = args
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None

    @property
    def exit_status(self) -> int:
        """128 + the first signal's number (130 for Ctrl-C)."""
        return 128 + (self.signum if self.signum is not None else signal.SIGINT)

    @property
    def what(self) -> str:
        """What happened, in words: ``interrupted`` for Ctrl-C, else the signal's name."""
        if self.signum is None or self.signum == signal.SIGINT:
            return "interrupted"
        return f"got {signal.Signals(self.signum).name}"

    @property
    def again(self) -> str:
        """How to leave without waiting for the target in flight."""
        if self.signum is None or self.signum == signal.SIGINT:
            return "Ctrl-C again to leave now"
        return f"send {signal.Signals(self.signum).name} again to leave now"

    def _delivered(self) -> int:
        if self._pipe is None:
            return 1
        n = 0
        while True:
            try:
                data = os.read(self._pipe[0], 512)
            except BlockingIOError:
                return n
            if not data:
                return n
            n += sum(data.count(sig) for sig in self._previous)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        delivered = self._delivered()
        if delivered == 0:
            return  # its byte was counted by the call before this one
        self.count += delivered
        self.asked.set()
        if self.count >= 3:
            self._args.close_timeout = 0  # closing must not wait for the drain either
            raise KeyboardInterrupt

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
            self._pipe = (read_end, write_end)
            self._previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            for sig in self.SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # nohup: the user asked to outlive the terminal
                self._previous[sig] = signal.signal(sig, self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None


# -- the store, opened -----------------------------------------------------------------------


def _db_url(args: argparse.Namespace) -> str:
    url: str | None = getattr(args, "db", None)
    return url or os.environ.get("BATCH_DB") or DEFAULT_DB


def _open_db(args: argparse.Namespace, **options: Any) -> dcache.DB | int:
    """The store named by --db / $BATCH_DB (``options`` to ``DB.open``), or the exit
    status after saying why not."""
    url = _db_url(args)
    _remember_secret(url)
    shown = redact_url(url)
    problem = check_db_url(url, shown)
    if problem is not None:
        _say(problem)
        return EXIT_USAGE
    try:
        return dcache.DB.open(url, **options)
    except Exception as exc:  # any parse or driver failure: one line, never a traceback
        failure = explain_open_failure(url, shown, exc)
        _say(failure.message)
        if failure.bad_url:
            return EXIT_USAGE
        return EXIT_TEMPFAIL if isinstance(exc, dcache.StoreUnavailableError) else EXIT_FAILED


def _store_failed(args: argparse.Namespace, exc: dcache.StoreError) -> int:
    shown = redact_url(_db_url(args))
    if isinstance(exc, dcache.StoreUnavailableError):
        _say(f"the database {shown} is unavailable: {exc}; retry later")
        return EXIT_TEMPFAIL
    _say(f"database error on {shown}: {exc}")
    return EXIT_FAILED


def _with_runner(args: argparse.Namespace, fetch: Fetch, body: Callable[[Runner], int]) -> int:
    """Open the store and a runner, run ``body``, close both; map store failures."""
    db = _open_db(args)
    if isinstance(db, int):
        return db
    try:
        runner = Runner(db, fetch)
        try:
            return body(runner)
        finally:
            runner.close(timeout=getattr(args, "close_timeout", None))
    except dcache.StoreError as exc:
        return _store_failed(args, exc)
    finally:
        db.close()


class StoreReader:
    """Reads and cancels on the store alone, for the commands that drain nothing.

    A :class:`Runner` registers an owner row, starts heartbeat and maintenance threads
    and reaps other processes' jobs when it starts: none of that belongs in ``batch
    status``. These reads convert rows exactly as the runner does.
    """

    def __init__(self, db: dcache.DB) -> None:
        self.db = db

    def status(self, job_id: str, *, results: bool = True) -> tuple[Job, list[TargetStatus]] | None:
        """The job and its targets (see :meth:`Runner.status`)."""
        found = self.db.get_job_with_targets(job_id, results=results)
        if found is None:
            return None
        row, rows = found
        return _job(row), [_target_status(t, row) for t in rows]

    def result(self, job_id: str, idx: int) -> TargetStatus | None:
        """One target with its result (see :meth:`Runner.result`)."""
        found = self.db.get_target(job_id, idx)
        if found is None:
            return None
        row, target = found
        return _target_status(target, row)

    def job(self, job_id: str) -> Job | None:
        """The job without its targets."""
        row = self.db.get_job(job_id)
        return _job(row) if row is not None else None

    def jobs(self, *, caller: str | None, live_only: bool, limit: int) -> list[Job]:
        """Visible jobs, newest first."""
        return [_job(r) for r in self.db.list_jobs(caller=caller, live_only=live_only, limit=limit)]

    def cancel(self, job_id: str) -> bool:
        """Flip a live job to cancelled; its draining process stops after the target in
        flight (it sees the status at its next write)."""
        return self.db.cancel(job_id)


def _with_store(args: argparse.Namespace, body: Callable[[StoreReader], int]) -> int:
    """Open the store (not a runner), run ``body``, close it; map store failures.

    The store is opened without creating or upgrading anything (``create=False``): a
    database with no store, or a store of another version, is refused as it is.
    """
    db = _open_db(args, create=False)
    if isinstance(db, int):
        return db
    try:
        return body(StoreReader(db))
    except dcache.StoreError as exc:
        return _store_failed(args, exc)
    finally:
        db.close()


# -- run -------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        items = _read_file(args.file)
        fetch = local_fetch if args.fetch is None else _load_fetch(args.fetch)
        if args.output is not None:
            Path(args.output).mkdir(parents=True, exist_ok=True)
    except InputError as exc:
        _say(str(exc))
        return EXIT_USAGE
    except OSError as exc:
        _say(f"--output {args.output}: cannot create the folder: {exc.strerror or exc}")
        return EXIT_USAGE
    show = not args.no_progress and sys.stderr.isatty()
    with _Interrupts(args) as interrupts:
        try:
            return _with_runner(args, fetch, lambda r: _run_job(r, args, items, interrupts, show))
        except KeyboardInterrupt:
            _say(f"{interrupts.what} three times: leaving at once")
            return interrupts.exit_status


def _stopped_owners(runner: Runner, owners: set[str]) -> dict[str, str]:
    """Which of ``owners`` have stopped beating, each with how it shows (a few words).

    A runner that is gone left no row (or its row was removed); one killed (SIGKILL, a
    crash, a lost machine) left a row whose last beat is older than the window it
    declared. That second judgement compares its beat's time with this machine's wall
    clock, which runners never do before failing a peer's jobs; here it only chooses
    what advice to give a person, who decides.
    """
    try:
        rows = {r.owner: r for r in runner.db.owners()}
    except dcache.StoreError:
        return {}  # only advice: the busy message is said without it
    now = dcache.utcnow()
    stopped: dict[str, str] = {}
    for owner in owners:
        row = rows.get(owner)
        if row is None or not row.present or row.heartbeat_at is None:
            stopped[owner] = "it is gone"
            continue
        window = row.stale_after or runner.config.heartbeat * _ORPHAN_BEATS
        if now - row.heartbeat_at > window:
            stopped[owner] = f"last beat {when(row.heartbeat_at)} by this machine's clock"
    return stopped


def _busy(runner: Runner, args: argparse.Namespace, exc: SubmitError) -> None:
    """Say who holds the cap, until when, and what the user can do about it."""
    if isinstance(exc, CallerBusyError):
        holders = runner.jobs(caller=args.caller, live_only=True, limit=3)
        if not holders:  # it ended in between: a retry will go through
            _say(f"{exc}; retry now")
            return
        stopped = _stopped_owners(runner, {j.owner for j in holders})
        held = "; ".join(
            f"job {j.id} is {j.status} ({j.targets_done}/{j.targets_total} target(s) "
            + (
                f"stored), but its runner stopped beating ({stopped[j.owner]}): nothing drains it"
                if j.owner in stopped
                else f"stored, lease until {when(j.expires_at)} unless it stores another)"
            )
            for j in holders
        )
        dead = [j.id for j in holders if j.owner in stopped]
        if dead:
            _say(
                f"caller {args.caller!r} is busy: {held}. Stop it with `batch cancel "
                f"{dead[0]}` and run again, or submit as another --caller"
            )
            return
        first = holders[0].id
        _say(
            f"caller {args.caller!r} is busy: {held}. Follow it with `batch status --watch "
            f"{first}`, stop it with `batch cancel {first}`, or submit as another --caller"
        )
        return
    live = runner.jobs(live_only=True, limit=1)
    oldest = f"; the newest live one is job {live[0].id}" if live else ""
    _say(f"{exc} (Config.jobs_total){oldest}; `batch jobs --live` lists them")


def _run_job(
    runner: Runner,
    args: argparse.Namespace,
    items: Checked,
    interrupts: _Interrupts,
    show: bool,
) -> int:
    try:
        job_id, reused = runner.submit(args.caller, "cli", items)
    except InvalidTargetsError as exc:
        at_fault = f"--caller {args.caller!r}" if exc.field == "caller" else args.file
        _say(f"{at_fault}: {exc}")
        return EXIT_USAGE
    except TooManyTargetsError as exc:
        _say(f"{args.file}: {exc}")
        return EXIT_USAGE
    except (CallerBusyError, BusyError) as exc:
        _busy(runner, args, exc)
        return EXIT_TEMPFAIL
    except SubmitError as exc:
        _say(str(exc))
        return EXIT_FAILED
    job = runner.job(job_id)
    if job is None:
        _say(f"job {job_id} vanished (its lease lapsed); run again")
        return EXIT_FAILED
    if reused:
        _say(
            f"job {job_id} reused: the same targets were submitted within its lease "
            f"(until {when(job.expires_at)}); printing its stored results without "
            "fetching again"
        )
        if not job.terminal:
            _say(f"job {job_id} is still {job.status} elsewhere; waiting for it")
        elif job.status == Status.CANCELLED:
            _say("it was cancelled; to run these targets again now, pass another --caller")
        elif job.status in (Status.FAILED, Status.PARTIAL):
            _say(f"it ended {job.status}; to fetch these targets again now, pass another --caller")
    else:
        _say(f"job {job_id}: {job.targets_total} target(s) on {redact_url(_db_url(args))}")
    args.close_timeout = None
    bar = _progress(job, show and job.finished_at is None)
    finished: Job | None = job if job.finished_at is not None else None
    try:
        while finished is None and not interrupts.asked.is_set():
            try:
                finished = runner.wait(job_id, timeout=_POLL)
            except TimeoutError:
                now = runner.job(job_id)
                if now is not None:
                    bar.update(now)
            else:
                if finished is None:
                    break
    finally:
        bar.close()
    if finished is None and interrupts.asked.is_set():
        return _interrupted(runner, args, job_id, interrupts)
    final = _report(runner, args, job_id)
    if final is None:
        return EXIT_FAILED
    return EXIT_OK if final.status == Status.DONE else EXIT_FAILED


def _json_out(args: argparse.Namespace) -> bool:
    """JSON lines for scripts: asked for, or stdout is not a terminal."""
    return bool(getattr(args, "json", False)) or not sys.stdout.isatty()


def _report(runner: Runner, args: argparse.Namespace, job_id: str) -> Job | None:
    """Print the job's outcomes (JSON lines, or a table on a terminal), write --output
    files, and say the summary on stderr; ``None`` if the job lapsed meanwhile."""
    as_json = _json_out(args)
    found = runner.status(job_id, results=as_json)
    if found is None:
        _say(f"job {job_id} lapsed before its results could be read")
        return None
    final, targets = found
    if as_json:
        for t in targets:
            _emit(t.to_json())
    else:
        for line in target_rows(targets, terminal_width()):
            print(line)
        sys.stdout.flush()
    if args.output is not None:
        _write_outputs(runner, args, job_id, targets)
    _say(_summary(final))
    return final


def _write_outputs(
    runner: Runner, args: argparse.Namespace, job_id: str, targets: list[TargetStatus]
) -> None:
    directory = Path(args.output)
    written = 0
    for t in targets:
        if t.status != Status.DONE:
            continue
        # One result in memory at a time, however large the job's results are.
        full = t if t.result is not None else runner.result(job_id, t.idx)
        if full is None:
            continue
        try:
            if write_result(directory, full) is not None:
                written += 1
        except OSError as exc:
            _say(f"--output: cannot write target {t.idx}: {exc.strerror or exc}")
    _say(f"{written} result file(s) in {directory}")


def _interrupted(
    runner: Runner, args: argparse.Namespace, job_id: str, interrupts: _Interrupts
) -> int:
    args.close_timeout = 0  # the drain is stopping; do not wait for more
    # Cancel first, however many signals came: leaving must never leave the job running.
    cancelled = runner.cancel(job_id)
    state = f"job {job_id} cancelled" if cancelled else f"job {job_id} had already ended"
    what = interrupts.what
    if interrupts.count >= 2:
        _say(f"{what} twice: {state}; leaving without waiting for the target in flight")
        return interrupts.exit_status
    if cancelled:
        _say(f"{what}: {state}; storing the target in flight ({interrupts.again})")
    else:
        _say(f"{what}: {state}")
    job: Job | None = None
    while job is None:
        if interrupts.count >= 2:
            _say(f"{what} again: {state}; leaving without waiting for the target in flight")
            return interrupts.exit_status
        try:
            job = runner.wait(job_id, timeout=_POLL)
        except TimeoutError:
            continue
        if job is None:
            break
    try:
        _report(runner, args, job_id)
    except BrokenPipeError:
        raise  # the reader went away: main() stops quietly
    except OSError:
        pass  # after a SIGHUP the terminal may be gone; the job's state is stored

    return interrupts.exit_status


# -- status, cancel, jobs, purge ---------------------------------------------------------------


def _cmd_status(args: argparse.Namespace) -> int:
    def body(store: StoreReader) -> int:
        if args.watch:
            return _watch(store, args)
        # The table shows each result's stored size: no result needs reading for it.
        found = store.status(args.id, results=False)
        if found is None:
            _say(f"no job {args.id!r} (unknown, or its lease lapsed)")
            return EXIT_FAILED
        job, targets = found
        if args.json:
            return _emit_status(store, job, targets)
        width = terminal_width() if sys.stdout.isatty() else None
        for line in job_lines(job, targets, width):
            print(line)
        return EXIT_OK

    return _with_store(args, body)


def _emit_status(store: StoreReader, job: Job, targets: list[TargetStatus]) -> int:
    """``status --json``: the job and every target with its result, as one JSON line,
    written a target at a time with each result read alone (32 results of 8 MiB are
    never in memory together).

    ``targets`` is the read without results; a target it shows with a stored result
    has that result for good, so each one read after it is the one it showed. If the
    job lapses meanwhile, or a read fails, the line is ended unfinished (not valid JSON)
    and the exit status says so.
    """
    head = json.dumps({"job": job.to_json(), "targets": []}, ensure_ascii=False)
    _write(head[: -len("]}")])
    try:
        for n, brief in enumerate(targets):
            shown = brief if brief.result_bytes is None else store.result(job.id, brief.idx)
            if shown is None:
                _write("\n")
                _say(f"job {job.id!r} lapsed while its results were read")
                return EXIT_FAILED
            _write((", " if n else "") + json.dumps(shown.to_json(), ensure_ascii=False))
    except BaseException:
        # A store error (mapped to its exit status by the caller) or an interrupt: end
        # the line so that whatever reads the output by lines sees where it stopped.
        _write("\n")
        raise
    _write("]}\n")
    return EXIT_OK


def _watch(store: StoreReader, args: argparse.Namespace) -> int:
    """Follow a job until it has finished: redraw on a terminal, a line per change when
    piped, a JSON object per change with --json. Exit as ``run`` does."""
    tty = sys.stdout.isatty() and not args.json
    redraw = Redraw(sys.stdout) if tty else None
    pause = threading.Event()  # never set: an Event-based, interruptible sleep
    seen: tuple[object, ...] | None = None
    ended_at: float | None = None
    while True:
        found = store.status(args.id, results=False)
        if found is None:
            _say(f"no job {args.id!r} (unknown, or its lease lapsed)")
            return EXIT_FAILED
        job, targets = found
        state = (job.status, job.targets_done, job.finished_at, *(t.status for t in targets))
        if state != seen:
            seen = state
            if args.json:
                _emit({"job": job.to_json(), "targets": [t.to_json() for t in targets]})
            elif redraw is not None:
                redraw.show(job_lines(job, targets, terminal_width()))
            else:
                print(_summary(job), flush=True)
        if job.finished_at is not None:
            break
        if job.terminal:
            # Terminal, but its drain has not said it stopped (the target in flight is
            # being stored, or its process died): give it a little while, then leave.
            ended_at = ended_at if ended_at is not None else time.monotonic()
            if time.monotonic() - ended_at > _SETTLE:
                _say(f"job {job.id} is {job.status}; its drain has not reported its end")
                break
        pause.wait(args.interval)
    if redraw is None and not args.json:
        for line in job_lines(job, targets, None):
            print(line)
    return EXIT_OK if job.status == Status.DONE else EXIT_FAILED


def _cmd_cancel(args: argparse.Namespace) -> int:
    def body(store: StoreReader) -> int:
        if store.cancel(args.id):
            print(f"job {args.id} cancelled; its drain stops after the target in flight")
            return EXIT_OK
        job = store.job(args.id)
        if job is None:
            _say(f"no job {args.id!r} (unknown, or its lease lapsed)")
        else:
            _say(f"job {args.id} is already {job.status}: nothing to cancel")
        return EXIT_FAILED

    return _with_store(args, body)


def _cmd_jobs(args: argparse.Namespace) -> int:
    def body(store: StoreReader) -> int:
        jobs = store.jobs(caller=args.caller, live_only=args.live, limit=args.limit)
        if args.json:
            for job in jobs:
                _emit(job.to_json())
            return EXIT_OK
        if not jobs:
            _say("no live jobs" if args.live else "no jobs")
            return EXIT_OK
        rows = [["ID", "STATUS", "DONE", "FAILED", "CALLER", "CREATED", "EXPIRES"]]
        rows += [
            [
                j.id,
                j.status,
                f"{j.targets_done}/{j.targets_total}",
                str(j.targets_failed),
                j.caller,
                when(j.created_at),
                when(j.expires_at),
            ]
            for j in jobs
        ]
        width = terminal_width() if sys.stdout.isatty() else None
        if width is not None:
            # Never cut an id: leave out the times, then cut the caller.
            need = sum(max(len(r[i]) for r in rows) + 2 for i in range(4)) + 8
            rows = [r[:5] for r in rows] if need + 2 * 22 > width else rows
        for line in table(rows, width, shrink=(4,)):
            print(line)
        return EXIT_OK

    return _with_store(args, body)


def _cmd_purge(args: argparse.Namespace) -> int:
    db = _open_db(args, tombstone_ttl=dt.timedelta(days=args.tombstone_days))
    if isinstance(db, int):
        return db
    try:
        with db:
            # One call stops after 100 transactions (each a few MiB of results): an
            # operator's purge goes on until nothing lapsed is left. The tombstones of
            # this run's jobs are left to the next run, as one call leaves them.
            n = got = db.purge_expired()
            while got:
                got = db.purge_expired(tombstone_ttl=MAX_TOMBSTONE_TTL)
                n += got
    except dcache.StoreUnavailableError as exc:
        _say(f"the database is unavailable: {exc}; retry later")
        return EXIT_TEMPFAIL
    except dcache.StoreError as exc:
        _say(f"cannot purge {redact_url(_db_url(args))!r}: {exc}")
        return EXIT_FAILED
    if args.json:
        _emit({"purged": n})
    else:
        print(f"purged {n} lapsed job(s)")
    return EXIT_OK


def _cmd_completion(args: argparse.Namespace) -> int:
    try:
        shtab = importlib.import_module("shtab")
    except ImportError:
        _say("shell completion needs shtab: pip install 'batch-dcache[cli]'")
        return EXIT_USAGE
    script: str = shtab.complete(_parser(), shell=args.shell)
    sys.stdout.write(script if script.endswith("\n") else script + "\n")
    return EXIT_OK


# -- the parser ----------------------------------------------------------------------------

_FILE = {"bash": "_shtab_compgen_files", "zsh": "_files"}  # shtab.FILE, without importing it
_DIR = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/"}  # shtab.DIRECTORY

_MAIN_EPILOG = """\
commands:
  run FILE          submit the targets in FILE as one job, wait, show each outcome
  status ID         show a job and its targets (--watch: follow it until it ends)
  cancel ID         cancel a live job
  jobs              list jobs, newest first
  purge             delete jobs whose lease lapsed
  serve             the dashboard and the JSON API on 127.0.0.1 (local use)
  completion SHELL  print a bash or zsh completion script

environment:
  BATCH_DB          the database URL when --db is not given (default {db})

exit statuses:
  0    success (run, status --watch: the job is done)
  1    the job ended partial, failed or cancelled, there is no such job, or the
       database failed in a way a retry will not fix
  2    bad input or usage (a --db URL that is wrong, not unreachable, included)
  75   busy, or the database is unavailable: retry later
  130  interrupted (run cancels its job first); 143 for SIGTERM, 129 for SIGHUP

examples:
  batch run urls.txt                       a table on a terminal, JSON lines when piped
  batch run urls.txt | jq -r .status       scripts read one JSON object per target
  BATCH_DB=postgresql+psycopg://app@db/batch batch jobs --live
  batch completion bash > ~/.local/share/bash-completion/completions/batch

`batch COMMAND --help` shows each command's options and examples.
"""

_RUN_DESCRIPTION = """\
Submit the targets in FILE as one job, wait for it, and show each target's outcome.

FILE holds one URL a line, or one JSON object a line ({"url": ..., "options": {...}});
blank lines and lines starting with # are skipped; - reads standard input. A relative
file: URL (file:notes.txt) is submitted as the file:/// URL of that path in the working
directory, so the same FILE run from another folder is another job.

On a terminal, a progress bar runs on stderr and the outcomes come as a table (index,
status, stored bytes, URL, error) cut to the terminal's width. Piped, or with --json,
each outcome is one JSON line on stdout with the full result, for scripts. --output DIR
also writes each result's content to a file per target (NN-name; .bin for binary).

Running the same file again while the job's lease holds reuses the job: its stored
results are shown without fetching again. Ctrl-C cancels the job (the target in flight
is stored) and exits 130; a second Ctrl-C, however quick, cancels it too and exits
without waiting for the target in flight. SIGTERM and SIGHUP do the same (exit 143,
129); a SIGHUP ignored at the start (nohup) stays ignored.

The default fetcher reads file: URLs and reaches private and loopback addresses (this
machine's user is trusted); a web app's default (batch.fetchers:fetch) allows neither.
"""

_RUN_EPILOG = """\
examples:
  batch run urls.txt                          fetch, show a table, exit 0 if all done
  batch run urls.txt --json > outcomes.jsonl  JSON lines even on a terminal
  batch run urls.txt --output pages/          also one file per result in pages/
  printf 'https://example.org/\\n' | batch run -
  batch run urls.txt --fetch myapp.fetching:fetch --caller nightly
  batch run urls.txt --db postgresql+psycopg://app@db.internal/batch
"""

_STATUS_EPILOG = """\
examples:
  batch status 3f2a...                one job: a header and a table of its targets
  batch status 3f2a... --json         one JSON object with every result
  batch status 3f2a... --watch        follow it live until it ends (exit 0 if done)
  batch status 3f2a... --watch --json a JSON object per change (results left out,
                                      their sizes in "bytes")
"""

_CANCEL_EPILOG = """\
The job's draining process, wherever it runs, stores the target in flight and stops
before the next. Exit 1 when the job is unknown, lapsed, or already ended.

examples:
  batch cancel 3f2a...
  batch jobs --live --json | jq -r .id | xargs -n1 batch cancel
"""

_JOBS_EPILOG = """\
examples:
  batch jobs                      the 100 newest jobs as a table
  batch jobs --live               only queued or running jobs
  batch jobs --caller alice --limit 5 --json
"""

_PURGE_EPILOG = """\
Runners purge lapsed jobs on their own (Config.purge_interval); this is for a database
no runner is attached to.

Each purged job leaves a tombstone, so that its id answers "expired" (HTTP 410) rather
than "unknown" (404) for a while; purge deletes the tombstones older than that period.
Give the period your app opens the store with (DB.open(url, tombstone_ttl=...)).

examples:
  batch purge
  batch purge --json              prints {"purged": N}
  batch purge --tombstone-days 30 keeps purged ids answering "expired" for 30 days
"""

_SERVE_EPILOG = """\
examples:
  batch serve                               http://127.0.0.1:8000/batch/
  batch serve --port 0 --db sqlite:///other.sqlite3
"""

_COMPLETION_DESCRIPTION = """\
Print a completion script for bash or zsh, generated from this command's own options
(needs shtab: pip install 'batch-dcache[cli]').
"""

_COMPLETION_EPILOG = """\
examples:
  batch completion bash > ~/.local/share/bash-completion/completions/batch
  batch completion zsh > ~/.zfunc/_batch    (with fpath+=~/.zfunc before compinit)
  eval "$(batch completion bash)"           this shell only
"""


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    if value > MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"at most {MAX_LIMIT:,}, not {text}")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not 0 <= value <= MAX_TOMBSTONE_DAYS:  # false for nan too
        raise argparse.ArgumentTypeError(f"between 0 and {MAX_TOMBSTONE_DAYS:,} days, not {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"between 0.05 and 3600 seconds, not {text}")
    return value


def _command(sub: Any, name: str, help: str, **kw: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, formatter_class=argparse.RawDescriptionHelpFormatter, **kw
    )
    return parser


def _parser() -> argparse.ArgumentParser:
    db_help = f"the database URL (default: $BATCH_DB, else {DEFAULT_DB})"
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: --db given before the command is not reset by the command's own default.
    common.add_argument("--db", metavar="URL", default=argparse.SUPPRESS, help=db_help)

    parser = argparse.ArgumentParser(
        prog="batch",
        description="Persistent, serial batch jobs: run a file of targets, follow, inspect "
        "and cancel jobs, purge lapsed ones.",
        epilog=_MAIN_EPILOG.format(db=DEFAULT_DB),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--db", metavar="URL", default=None, help=db_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = _command(
        sub,
        "run",
        "submit the targets in FILE, wait, show each outcome",
        parents=[common],
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
    )
    run.add_argument(
        "file", metavar="FILE", help="the targets file, or - for stdin"
    ).complete = _FILE  # type: ignore[attr-defined]
    run.add_argument(
        "--fetch",
        metavar="MODULE:CALLABLE",
        default=None,
        help="the fetch function (default: the library's Fetcher for http, https and file "
        "URLs, with private and loopback addresses allowed)",
    )
    run.add_argument(
        "--caller",
        metavar="NAME",
        default="cli",
        help="who submits (idempotency and the per-caller cap are per caller; default: cli)",
    )
    run.add_argument("--json", action="store_true", help="JSON lines on stdout even on a terminal")
    run.add_argument(
        "--output",
        metavar="DIR",
        default=None,
        help="also write each result's content to a file per target in DIR",
    ).complete = _DIR  # type: ignore[attr-defined]
    run.add_argument(
        "--no-progress", action="store_true", help="no progress bar, even on a terminal"
    )
    run.set_defaults(func=_cmd_run)

    status = _command(
        sub,
        "status",
        "show a job and its targets; --watch follows it until it ends",
        parents=[common],
        description="Show a job (status, counts, caller, times) and a table of its targets.",
        epilog=_STATUS_EPILOG,
    )
    status.add_argument("id", metavar="ID")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.add_argument(
        "--watch", action="store_true", help="follow the job live until it has finished"
    )
    status.add_argument(
        "--interval",
        metavar="SECONDS",
        type=_seconds,
        default=0.5,
        help="with --watch: seconds between reads (default 0.5)",
    )
    status.set_defaults(func=_cmd_status)

    cancel = _command(
        sub,
        "cancel",
        "cancel a live job",
        parents=[common],
        description="Cancel a live job.",
        epilog=_CANCEL_EPILOG,
    )
    cancel.add_argument("id", metavar="ID")
    cancel.set_defaults(func=_cmd_cancel)

    jobs = _command(
        sub,
        "jobs",
        "list jobs, newest first",
        parents=[common],
        description="List the jobs whose lease holds, newest first.",
        epilog=_JOBS_EPILOG,
    )
    jobs.add_argument("--live", action="store_true", help="only queued or running jobs")
    jobs.add_argument("--caller", metavar="NAME", default=None, help="only this caller's")
    jobs.add_argument(
        "--limit",
        metavar="N",
        type=_limit,
        default=100,
        help=f"at most N (default 100, at most {MAX_LIMIT:,})",
    )
    jobs.add_argument("--json", action="store_true", help="one JSON object a line")
    jobs.set_defaults(func=_cmd_jobs)

    purge = _command(
        sub,
        "purge",
        "delete jobs whose lease lapsed",
        parents=[common],
        description="Delete the jobs whose lease lapsed, with their targets.",
        epilog=_PURGE_EPILOG,
    )
    purge.add_argument("--json", action="store_true", help='print {"purged": N}')
    purge.add_argument(
        "--tombstone-days",
        metavar="DAYS",
        type=_days,
        default=dcache.TOMBSTONE_TTL.total_seconds() / 86400,
        help="delete the tombstones of jobs that lapsed more than DAYS days ago "
        f"(default {dcache.TOMBSTONE_TTL.days}, as DB.open's tombstone_ttl)",
    )
    purge.set_defaults(func=_cmd_purge)

    serve = _serve.add_parser(sub)
    serve.formatter_class = argparse.RawDescriptionHelpFormatter
    serve.epilog = _SERVE_EPILOG

    completion = _command(
        sub,
        "completion",
        "print a bash or zsh completion script",
        description=_COMPLETION_DESCRIPTION,
        epilog=_COMPLETION_EPILOG,
    )
    completion.add_argument("shell", metavar="SHELL", choices=("bash", "zsh"), help="bash or zsh")
    completion.set_defaults(func=_cmd_completion)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse says what)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`batch jobs | head`): stop quietly, as Unix tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
