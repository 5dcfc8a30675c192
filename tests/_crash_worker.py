"""A child process for tests/test_crash_trials.py: drains jobs until it is SIGKILLed.

``python tests/_crash_worker.py serve URL`` starts a fork server: it imports the library and
warms it up on the store at ``URL`` once,
then for each ``spawn ARGS...`` line on stdin forks a worker, prints ``pid PID``, waits for
it and prints ``exit PID STATUS`` once it is gone (killed). Forking from an interpreter
that has imported everything but opened nothing (no thread, no connection) makes a trial
cost milliseconds instead of an interpreter start-up. Only one worker runs at a time, so
their lines on the shared stdout never interleave (each line is one ``write``).

A worker (``ARGS = URL LOG TRIAL MODE NTH HOLD SEED``; also runnable directly as
``python tests/_crash_worker.py URL LOG ...``) opens the
store, builds a runner and submits small jobs one after another, waiting for each. Every
fetch appends its target URL to the append-only file ``LOG`` and fsyncs it *before*
returning, so the parent knows exactly which targets were fetched even when the kill lands
right after. Results encode their URL (which encodes trial, job and index), so whatever
is stored can be checked exactly.

To aim the parent's kill, the child prints ``at MODE`` on stdout when it reaches the
``NTH`` occurrence of a moment (``submit``: the job insert; ``write``: a target update;
``commit``: any commit; ``prefetch``: a fetch called, nothing logged yet; ``fetch``: the
fetch logged, not returned). With ``HOLD`` set it then blocks there, so the kill lands
exactly at that moment; otherwise it goes on and the kill lands a few microseconds later.
It prints ``ready`` once the runner is built, and ``idle`` after its last job.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
from typing import Any

from sqlalchemy import event

import batch
import dcache

JOBS = 8  # jobs per child; the parent kills it long before it would run out
HOLD_FOR = 30.0  # seconds a held moment waits (the parent kills the child first)


def target_url(trial: int, job: int, idx: int) -> str:
    """The URL of one target: trial, job and index, all recoverable from it."""
    return f"https://crash.example/t{trial}/j{job}/{idx}"


def fails(url: str) -> bool:
    """Whether the fetch of ``url`` raises FetchError (every fourth index)."""
    return int(url.rsplit("/", 1)[1]) % 4 == 3


def content_for(url: str) -> str:
    """The exact content stored for a target that succeeds (non-ASCII on purpose)."""
    return f"r\N{LATIN SMALL LETTER E WITH ACUTE}sultat {url} \N{CHECK MARK}"


def meta_for(url: str) -> dict[str, Any]:
    return {"url": url, "n": len(url)}


def error_for(url: str) -> tuple[str, str]:
    """The exact (error, hint) stored for a target whose fetch fails."""
    return f"refused {url}", f"hint for {url}"


# PostgreSQL writes a target and its job in one statement, the target's compare-and-set
# in a data-modifying CTE: that statement is the write there.
_WRITES_BOTH = re.compile(r"WITH changed AS\s*\(UPDATE batch_target ")


class Moments:
    """Counts the moments the parent may aim at and announces the chosen one."""

    def __init__(self, mode: str, nth: int, hold: bool) -> None:
        self.mode = mode
        self.nth = nth
        self.hold = hold
        self.seen = 0
        self.armed = False  # moments count once the runner is built (start-up is not aimed at)
        self._lock = threading.Lock()

    def reached(self, moment: str) -> None:
        if moment != self.mode or not self.armed:
            return
        with self._lock:
            self.seen += 1
            hit = self.seen == self.nth
        if hit:
            sys.stdout.write(f"at {moment}\n")
            sys.stdout.flush()
            if self.hold:
                threading.Event().wait(HOLD_FOR)


def main(argv: list[str]) -> int:
    url, log_path, trial_s, mode, nth_s, hold_s, seed_s = argv
    trial = int(trial_s)
    moments = Moments(mode, int(nth_s), hold_s == "1")
    rng = random.Random(int(seed_s))

    db = dcache.DB.open(url)

    @event.listens_for(db.engine, "before_cursor_execute")
    def _statement(_conn: Any, _cur: Any, statement: str, *_rest: Any) -> None:
        if statement.startswith("INSERT INTO batch_job "):
            moments.reached("submit")
        elif statement.startswith("UPDATE batch_target ") or _WRITES_BOTH.match(statement):
            moments.reached("write")

    @event.listens_for(db.engine, "commit")
    def _commit(_conn: Any) -> None:
        moments.reached("commit")

    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def fetch(target: batch.Target) -> batch.Result:
        moments.reached("prefetch")
        os.write(log_fd, (target.url + "\n").encode("utf-8"))
        os.fsync(log_fd)
        moments.reached("fetch")
        if fails(target.url):
            error, hint = error_for(target.url)
            raise batch.FetchError(error, hint=hint)
        return batch.Result(content_for(target.url), meta_for(target.url))

    runner = batch.Runner(db, fetch, batch.Config(jobs_per_caller=1))
    moments.armed = True
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for job in range(JOBS):
        n = rng.randint(1, 5)
        job_id, _ = runner.submit(
            f"crash-{trial}", "test", [batch.Target(target_url(trial, job, i)) for i in range(n)]
        )
        runner.wait(job_id, timeout=60)
    sys.stdout.write("idle\n")
    sys.stdout.flush()
    threading.Event().wait(HOLD_FOR)  # stay up (a live owner) until the parent kills us
    return 0


def warm_up(url: str) -> None:
    """Pay the first-use costs (dialect imports, compiled statements) once, before forking.

    Everything opened here is closed again, so the server forks with no thread and no
    connection.
    """
    db = dcache.DB.open(url)
    try:
        runner = batch.Runner(db, lambda _t: batch.Result(""), batch.Config())
        runner.status(batch.new_job_id())
        runner.close(timeout=10)
    finally:
        db.close()


def serve(url: str) -> int:
    """The fork server loop (see the module docstring)."""
    warm_up(url)
    sys.stdout.write("serving\n")
    sys.stdout.flush()
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "spawn":
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                code = main(words[1:])
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        sys.stdout.write(f"pid {pid}\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(f"exit {pid} {status}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
