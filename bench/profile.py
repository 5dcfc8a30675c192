"""Where does a per-target write spend its time over the raw floor?

``python -m bench.profile [--backend sqlite|sqlite-full|postgresql|mariadb] [--tool ...]``

1. Times the per-target write alone (no submit, no reads: jobs are submitted untimed)
   for the raw floor, naive Core, ``DB.write_target`` and ``DB.writer()``, in one process,
   interleaved over several rounds, and prints the median µs per write of each.
2. Profiles one variant's writes (``--variant``, default ``writer``) with pyinstrument
   (``--tool pyinstrument``, if installed) or cProfile (``--tool cprofile``), and prints
   the functions where the time goes. For a sampling profile of the real thing, run
   ``py-spy record --rate 2000 -o out.svg -- python -m bench.profile --tool none``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _floors
from bench._env import BACKENDS, new_id, payload_json, server_urls, target_urls, wipe

VARIANTS = ["raw", "core", "store", "writer"]


def _job(impl: Any, per_job: int) -> str:
    jid = new_id()
    items = impl.prepare(target_urls(f"p{jid[:8]}", per_job))
    if impl.submit(jid, "bench", new_id() + new_id(), items) != "created":
        raise RuntimeError("submit failed")
    return jid


def write_loop(
    impl: Any, n_jobs: int, per_job: int, payload: str, prof: Any = None
) -> tuple[int, int]:
    """Submit jobs one by one (untimed), write their targets; return (wall ns, CPU ns).

    CPU time is this process's: on a busy machine it is the steadier measure of our own
    overhead; wall time adds the database's work and the waits.
    """
    wall = cpu = 0
    for _ in range(n_jobs):
        jid = _job(impl, per_job)
        if prof is not None:
            prof.enable()
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        for i in range(per_job):
            impl.write_target(jid, i, "done", payload)
        wall += time.perf_counter_ns() - t0
        cpu += time.process_time_ns() - c0
        if prof is not None:
            prof.disable()
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    ap.add_argument("--backend", default="sqlite", choices=list(BACKENDS))
    ap.add_argument("--jobs", type=int, default=10, help="jobs of 32 targets per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variant", default="writer", choices=VARIANTS, help="what to profile")
    ap.add_argument("--tool", default="cprofile", choices=["cprofile", "pyinstrument", "none"])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    be = BACKENDS[args.backend]
    tmp = tempfile.mkdtemp(prefix="dcache-bench-profile-")
    url = server_urls()[be.name] if be.server else f"sqlite:///{Path(tmp) / 'profile.sqlite3'}"
    wipe(url)
    payload = payload_json(1024)
    per_job = 32
    variants = [v for v in VARIANTS if v != "writer" or _floors.has_writer()]
    impls = {v: _floors.make(v, be, url) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for impl in impls.values():  # warm-up
            write_loop(impl, 1, per_job, payload)
        for _ in range(args.rounds):
            for v, impl in impls.items():
                gc.collect()
                wall, cpu = write_loop(impl, args.jobs, per_job, payload)
                times[v].append(wall / 1e3 / (args.jobs * per_job))
                cpus[v].append(cpu / 1e3 / (args.jobs * per_job))
        raw = statistics.median(times["raw"])
        raw_cpu = statistics.median(cpus["raw"])
        print(f"per-target write alone on {be.name}, median of {args.rounds} interleaved rounds:")
        print("  variant      wall µs  (vs raw)            client CPU µs  (vs raw)")
        for v in variants:
            med, c = statistics.median(times[v]), statistics.median(cpus[v])
            print(
                f"  {v:7s} {med:12.1f}  ({med / raw:5.2f}x, {med - raw:+8.1f})"
                f"  {c:12.1f}  ({c / raw_cpu:5.2f}x, {c - raw_cpu:+8.1f})"
            )
        if args.tool != "none":
            impl = impls[args.variant]
            n = args.jobs * 2
            gc.collect()
            print(f"\nprofile of {args.variant} ({args.tool}), {n * per_job} writes:")
            if args.tool == "pyinstrument":
                from pyinstrument import Profiler

                pi = Profiler(interval=0.0002)
                pi.start()
                write_loop(impl, n, per_job, payload)
                pi.stop()
                print(pi.output_text(unicode=False, color=False))
            else:
                cp = cProfile.Profile()
                write_loop(impl, n, per_job, payload, prof=cp)
                out = io.StringIO()
                pstats.Stats(cp, stream=out).sort_stats("tottime").print_stats(args.top)
                print(out.getvalue())
    finally:
        for impl in impls.values():
            impl.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
