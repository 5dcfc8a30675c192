"""Child-process entry points for tests/test_processes.py.

multiprocessing's ``spawn`` start method pickles a child's target by module and name, so
every function a child runs lives here, importable on its own. Each child opens its own
``dcache.DB`` and builds its own ``batch.Runner``: nothing is inherited from the parent.
Children report on a queue and block on multiprocessing Events; they never sleep.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from typing import Any

import batch
import dcache

BLOCK_TIMEOUT = 60.0  # a blocked fetch gives up after this (the parent kills us first)
DISTINCT_BASE = 100  # race_submits: targets from here on belong to the "distinct" round


def target_url(idx: int) -> str:
    """The URL of target ``idx``; the fetches below read the index back from it."""
    return f"https://example.test/page/{idx}"


def url_index(url: str) -> int:
    """The index encoded in a :func:`target_url`."""
    return int(url.rsplit("/", 1)[1])


def content_for(idx: int) -> str:
    """The exact content a fetch stores for target ``idx`` (non-ASCII on purpose)."""
    return f"page {idx} \N{CHECK MARK} contenu n\N{DEGREE SIGN}{idx}"


def meta_for(idx: int) -> dict[str, Any]:
    """The exact metadata a fetch stores for target ``idx``."""
    return {"idx": idx, "source": "proc-worker"}


def record_fetch(log_path: str, who: str, idx: int) -> None:
    """Append one line per fetch call, so any process's fetches can be counted later."""
    with open(log_path, "a", encoding="utf-8") as fh:
        fh.write(f"{who} {idx}\n")
        fh.flush()


def read_fetches(log_path: str) -> list[tuple[str, int]]:
    """Every ``(who, idx)`` fetch recorded in ``log_path``, in call order."""
    if not os.path.exists(log_path):
        return []
    with open(log_path, encoding="utf-8") as fh:
        return [(w, int(i)) for w, i in (line.split() for line in fh if line.strip())]


def drain_one_job(
    url: str,
    n_targets: int,
    heartbeat: float,
    block_at: int,
    reached: Any,
    release: Any,
    log_path: str,
    out: Any,
) -> None:
    """Submit one job and drain it; the fetch of target ``block_at`` blocks.

    Reports ``("submitted", job_id, owner)`` once the job runs, sets ``reached`` when
    the fetch of ``block_at`` starts (every earlier target is stored by then: the drain
    is serial), waits there for ``release``, and reports ``("finished", status, error)``
    after the drain has ended. A parent that SIGKILLs us never sees the last message.
    """
    db = dcache.DB.open(url)
    pid = f"child-{os.getpid()}"

    def fetch(target: batch.Target) -> batch.Result:
        idx = url_index(target.url)
        record_fetch(log_path, pid, idx)
        if idx == block_at:
            reached.set()
            release.wait(BLOCK_TIMEOUT)
        return batch.Result(content_for(idx), meta_for(idx))

    runner = batch.Runner(db, fetch, batch.Config(heartbeat=dt.timedelta(seconds=heartbeat)))
    try:
        targets = [batch.Target(target_url(i)) for i in range(n_targets)]
        job_id, _ = runner.submit("proc-caller", "test", targets)
        out.put(("submitted", job_id, runner.owner))
        job = runner.wait(job_id, timeout=BLOCK_TIMEOUT + 30)
        assert job is not None
        out.put(("finished", job.status, job.error))
    finally:
        runner.close(timeout=10)
        db.close()


def race_submits(
    url: str,
    proc_no: int,
    n_threads: int,
    jobs_total: int,
    go_identical: Any,
    go_distinct: Any,
    release: Any,
    out: Any,
) -> None:
    """Race ``n_threads`` submits in this process against the other racing processes.

    Two rounds, each opened by the parent's ``go_*`` Event. In the ``identical`` round
    every thread of every process submits the same job as the same caller (its fetches
    return at once); in the ``distinct`` round each thread submits its own targets, the
    caller being per process, and the fetches block on ``release`` so created jobs stay
    live. Per round this reports ``("ready", proc_no, round)`` once every thread waits,
    then ``("results", proc_no, round, [(kind, job_id_or_live), ...])``.
    """
    db = dcache.DB.open(url)

    def fetch(target: batch.Target) -> batch.Result:
        if url_index(target.url) >= DISTINCT_BASE:
            release.wait(BLOCK_TIMEOUT)
        return batch.Result(target.url)

    config = batch.Config(jobs_total=jobs_total, jobs_per_caller=1000)
    runner = batch.Runner(db, fetch, config)

    def submit(go: Any, caller: str, targets: list[Any], results: list[Any], i: int) -> None:
        if not go.wait(BLOCK_TIMEOUT):
            results[i] = ("no-go", None)
            return
        try:
            job_id, reused = runner.submit(caller, "test", targets)
        except batch.BusyError as exc:
            results[i] = ("busy", exc.live)
        except Exception as exc:
            results[i] = ("error", f"{type(exc).__name__}: {exc}")
        else:
            results[i] = ("reused" if reused else "created", job_id)

    try:
        for name, go in (("identical", go_identical), ("distinct", go_distinct)):
            results: list[tuple[str, Any]] = [("missing", None)] * n_threads
            threads = []
            for i in range(n_threads):
                if name == "identical":
                    caller, targets = (
                        "same-caller",
                        [{"url": target_url(0)}, {"url": target_url(1)}],
                    )
                else:
                    idx = DISTINCT_BASE + proc_no * n_threads + i
                    caller, targets = f"caller-{proc_no}", [{"url": target_url(idx)}]
                threads.append(
                    threading.Thread(
                        target=submit,
                        args=(go, caller, targets, results, i),
                        name=f"racer-{proc_no}-{name}-{i}",
                        daemon=True,
                    )
                )
            for t in threads:
                t.start()
            out.put(("ready", proc_no, name))
            for t in threads:
                t.join(BLOCK_TIMEOUT + 30)
            out.put(("results", proc_no, name, results))
    finally:
        runner.close(timeout=BLOCK_TIMEOUT)
        db.close()
