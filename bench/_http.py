"""The HTTP rows: the documented app under gunicorn on loopback, driven by wrk.

One measurement per backend (SQLite file, PostgreSQL) starts the app of
:mod:`bench._http_app` under ``gunicorn -w 2`` on 127.0.0.1 and drives it with ``wrk``
(8 connections; a Python load generator when wrk is missing), the four throughput rows
interleaved in the same run so their ratios compare like with like:

- ``http/floor``: ``GET /floor/<id>`` of an 8 x 1 KiB job (one SQL statement, ``jsonify``);
- ``http/get``: ``GET /jobs/<id>`` of the same job (the library's pass-through answer);
- ``http/304``: the same with ``If-None-Match`` carrying the current ETag;
- ``http/brief``: ``GET /jobs/<id>?results=false`` of the 32 x 1 MiB job below (sizes, no
  results), beside ``http/get``.

Then, on a fresh single-worker server each (a worker's heap only grows, so each memory row
gets a worker that has served nothing large): ``http-rss/get``, the peak RSS growth of the
worker serving ``GET /jobs/<id>`` of a 32 x 1 MiB job, and ``http-rss/content``, the peak
growth while the same 32 results are fetched one by one through ``/content``; both beside
``http-rss/payload`` (32 MiB) and ``http-rss/one-result`` (1 MiB). Peaks are the kernel's
``VmHWM`` after resetting it (``/proc/<pid>/clear_refs``) just before the requests.
"""

from __future__ import annotations

import contextlib
import http.client as httpclient
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._env import Spec, content, wipe

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
AUTH = {"Authorization": "Bearer bench-token"}
CONNECTIONS = 8
Row = dict[str, Any]


def _row(name: str, backend: str, value: float, unit: str) -> Row:
    return {"row": name, "backend": backend, "value": value, "unit": unit}


# -- the stored jobs ------------------------------------------------------------------------


def prepare(url: str, small: int, n_big: int, big_bytes: int) -> tuple[str, str]:
    """Store (untimed) a finished job of ``small`` 1 KiB results and one of ``n_big`` large."""
    import batch
    import dcache
    from bench._http_app import CALLER

    wipe(url)

    def fetch(target: batch.Target) -> batch.Result:
        size = 1024 if "/small/" in target.url else big_bytes
        return batch.Result(content(size), {"content_type": "text/plain; charset=utf-8"})

    db = dcache.DB.open(url)
    try:
        cfg = batch.Config(max_result_bytes=2 * big_bytes + 4096)
        with batch.Runner(db, fetch, cfg) as runner:
            ids = []
            for kind, n in (("small", small), ("big", n_big)):
                job_id, _ = runner.submit(
                    CALLER, "web", [{"url": f"https://bench.example/{kind}/{i}"} for i in range(n)]
                )
                job = runner.wait(job_id, timeout=600)
                if job is None or job.status != "done":
                    raise RuntimeError(f"the {kind} job did not finish done: {job}")
                ids.append(job_id)
    finally:
        db.close()
    return ids[0], ids[1]


# -- gunicorn ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(url: str, workers: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """The app under gunicorn on 127.0.0.1; yields (port, the master process)."""
    port = _free_port()
    env = {**os.environ, "BATCH_DB": url, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "gunicorn",
        "-w",
        str(workers),
        "-b",
        f"127.0.0.1:{port}",
        "--log-level",
        "warning",
        "bench._http_app:create_app()",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {proc.returncode}")
            with contextlib.suppress(OSError):
                if _get(port, "/jobs/openapi.json")[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not answer within 60 s")
            time.sleep(0.1)
        while len(_workers(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _workers(master: int) -> list[int]:
    try:
        text = Path(f"/proc/{master}/task/{master}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("GET", path, headers={**AUTH, **(headers or {})})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, body, resp.headers
    finally:
        conn.close()


def _drain(port: int, path: str) -> int:
    """GET ``path`` and read the answer in 64 KiB pieces, keeping none (a bounded client)."""
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("GET", path, headers=AUTH)
        resp = conn.getresponse()
        n = 0
        while chunk := resp.read(64 * 1024):
            n += len(chunk)
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: {resp.status}")
        return n
    finally:
        conn.close()


# -- load ---------------------------------------------------------------------------------------


def load(
    port: int,
    path: str,
    seconds: float,
    headers: dict[str, str] | None = None,
    *,
    loader: str = "wrk",
) -> float:
    """Requests per second over ``seconds`` with CONNECTIONS keep-alive connections."""
    all_headers = {**AUTH, **(headers or {})}
    if loader == "wrk" and shutil.which("wrk"):
        # wrk takes whole seconds. One wrk thread keeps the connections busy at these
        # rates with CPU to spare; a second one would take CPU from the server it measures.
        cmd = ["wrk", "-t", "1", "-c", str(CONNECTIONS), "-d", f"{max(1, round(seconds))}s"]
        for k, v in all_headers.items():
            cmd += ["-H", f"{k}: {v}"]
        cmd.append(f"http://127.0.0.1:{port}{path}")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
        if "Non-2xx or 3xx responses" in out.stdout:
            raise RuntimeError(f"wrk saw errors on {path}:\n{out.stdout}")
        m = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
        if m is None:
            raise RuntimeError(f"unexpected wrk output:\n{out.stdout}")
        return float(m.group(1))
    return _py_load(port, path, seconds, all_headers)


def _py_load(port: int, path: str, seconds: float, headers: dict[str, str]) -> float:
    """The fallback load generator: CONNECTIONS threads, each one keep-alive connection."""
    stop = time.monotonic() + seconds
    counts = [0] * CONNECTIONS
    errors: list[str] = []

    def client(i: int) -> None:
        conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            while time.monotonic() < stop:
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status not in (200, 304):
                    errors.append(f"{resp.status}")
                    return
                counts[i] += 1
        finally:
            conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    if errors:
        raise RuntimeError(f"load on {path}: status {errors[0]}")
    return sum(counts) / (time.monotonic() - t0)


# -- memory -------------------------------------------------------------------------------------


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def peak_growth(pid: int, work: Any) -> float:
    """Peak RSS growth of process ``pid`` (bytes) while ``work()`` runs."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak restarts at the current RSS
    base = _kib(pid, "VmRSS")
    work()
    return float(max(0, _kib(pid, "VmHWM") - base) * 1024)


# -- the measurement ----------------------------------------------------------------------------


def http(spec: Spec, variant: str) -> list[Row]:
    """Every HTTP row on one backend (see the module docstring)."""
    p = spec.params
    quick = bool(spec.extra.get("quick"))
    n_big = p.mem_targets
    big = p.mem_result_bytes
    seconds = float(spec.extra.get("seconds", 2.0 if quick else 4.0))
    rounds = int(spec.extra.get("rounds", 1 if quick else 2))
    loader = str(spec.extra.get("loader", "wrk"))  # "python": the fallback, even with wrk
    small_id, big_id = prepare(spec.url, 8, n_big, big)
    be = spec.backend
    rows: list[Row] = []
    with serve(spec.url, workers=2) as (port, _proc):
        status, _, headers = _get(port, f"/jobs/{small_id}")
        if status != 200:
            raise RuntimeError(f"GET /jobs/{small_id}: {status}")
        etag = headers["ETag"]
        if _get(port, f"/jobs/{small_id}", {"If-None-Match": etag})[0] != 304:
            raise RuntimeError("If-None-Match with the current tag did not answer 304")
        cases = [
            ("http/floor", f"/floor/{small_id}", None),
            ("http/get", f"/jobs/{small_id}", None),
            ("http/304", f"/jobs/{small_id}", {"If-None-Match": etag}),
            # A poll that leaves the results out: the 32 x 1 MiB job's sizes are stored
            # with its results, so it costs about what the small job's full GET costs.
            ("http/brief", f"/jobs/{big_id}?results=false", None),
        ]
        for _name, path, extra in cases:  # warm every worker and connection
            load(port, path, 1.0, extra, loader=loader)
        for _ in range(rounds):
            for name, path, extra in cases:
                rate = load(port, path, seconds, extra, loader=loader)
                rows.append(_row(name, be, rate, "req/s"))
    payload = float(n_big * big)
    rows.append(_row("http-rss/payload", be, payload / MIB, "MiB"))
    rows.append(_row("http-rss/one-result", be, big / MIB, "MiB"))
    for name, work in (
        ("http-rss/get", lambda port: _drain(port, f"/jobs/{big_id}")),
        (
            "http-rss/content",
            lambda port: [
                _drain(port, f"/jobs/{big_id}/targets/{i}/content") for i in range(n_big)
            ],
        ),
    ):
        with serve(spec.url, workers=1) as (port, proc):
            (pid,) = _workers(proc.pid)
            for _ in range(3):  # imports, pools, the small answer's path: not the growth
                _get(port, f"/jobs/{small_id}")
                _get(port, f"/jobs/{small_id}/targets/0/content")
            grown = peak_growth(pid, lambda port=port, work=work: work(port))
        rows.append(_row(name, be, grown / MIB, "MiB"))
    return rows
