"""The jobs API under a real WSGI server: gunicorn with three worker processes on PostgreSQL.

Identical POSTs spread over the workers make one job; a cancel through one worker stops a
job drained by another; status reads the same from every worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import backend_url, wipe

import dcache

DATA = Path(__file__).parent / "data"
WORKERS = 3


def _gunicorn() -> list[str]:
    exe = Path(sys.executable).with_name("gunicorn")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gunicorn")
    if found is None:
        pytest.skip("gunicorn is not installed (pip install gunicorn)")
    return [found]


class Server:
    """A running gunicorn and the marker folder that drives its workers."""

    def __init__(self, base: str, markers: Path) -> None:
        self.base = base
        self.dir = markers

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        caller: str = "alice",
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], int]:
        """Send one request on a fresh connection: (status, JSON body, worker pid)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("X-Caller", caller)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read()), int(resp.headers["X-Worker-Pid"])
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read()), int(exc.headers["X-Worker-Pid"])

    def raw(
        self, path: str, caller: str = "alice", headers: dict[str, str] | None = None
    ) -> tuple[int, Any, bytes, int]:
        """GET on a fresh connection: (status, headers, body bytes, worker pid)."""
        req = urllib.request.Request(self.base + path, method="GET")
        req.add_header("X-Caller", caller)
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read(), int(resp.headers["X-Worker-Pid"])
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.headers, exc.read(), int(exc.headers["X-Worker-Pid"])

    def concurrently(self, n: int, *args: Any, **kw: Any) -> list[tuple[int, dict[str, Any], int]]:
        """The same request n times at once, from n threads."""
        results: list[Any] = [None] * n
        barrier = threading.Barrier(n)

        def one(i: int) -> None:
            barrier.wait(10)
            results[i] = self.request(*args, **kw)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results)
        return results

    def marker(self, name: str) -> bool:
        return (self.dir / name).exists()

    def started(self, name: str) -> list[int]:
        """The pids of the workers that started fetching the target named ``name``."""
        return [int(p.name.split("-")[1]) for p in self.dir.glob(f"started-*-{name}")]

    def go(self, name: str) -> None:
        (self.dir / f"go-{name}").touch()

    def hold(self, worker: int) -> str:
        """Keep ``worker`` busy with a held request; return the token that releases it."""
        for attempt in range(100):
            token = f"t{attempt}"
            threading.Thread(
                target=self.request, args=("GET", f"/_hold?token={token}"), daemon=True
            ).start()
            until(lambda token=token: any(self.dir.glob(f"held-{token}-*")))
            (held,) = self.dir.glob(f"held-{token}-*")
            if int(held.name.rsplit("-", 1)[1]) == worker:
                return token
            (self.dir / f"release-{token}").touch()  # the wrong worker: let it go
        raise AssertionError(f"could not hold worker {worker}")


def until(predicate: Any, timeout: float = 30.0) -> None:
    """Poll a condition the workers will make true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def pg_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Skips (or, in CI, fails) without a PostgreSQL server.
    url = backend_url("postgresql", tmp_path_factory.mktemp("pg"))
    with dcache.DB.open(url) as db:
        wipe(db)
    return url


@contextlib.contextmanager
def _gunicorn_serving(pg_url: str, tmp_path: Path, workers: int, *args: str) -> Iterator[Server]:
    """gunicorn on a free port with the tests' config, ``workers`` workers and ``args``."""
    markers = tmp_path / "markers"
    markers.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    env = {
        **os.environ,
        "BATCH_WSGI_DB": pg_url,
        "BATCH_WSGI_DIR": str(markers),
        "PYTHONPATH": str(DATA),
    }
    proc = subprocess.Popen(
        [
            *_gunicorn(),
            "--config",
            str(DATA / "gunicorn_conf.py"),
            "--workers",
            str(workers),
            *args,
            "--bind",
            f"fd://{listener.fileno()}",
            "wsgi_app:app",
        ],
        env=env,
        pass_fds=[listener.fileno()],
        cwd=tmp_path,
    )
    listener.close()
    try:
        until(lambda: len(list(markers.glob("ready-*"))) == workers or proc.poll() is not None)
        assert proc.poll() is None, "gunicorn exited"
        yield Server(f"http://127.0.0.1:{port}", markers)
    finally:
        (markers / "go-all").touch()
        proc.send_signal(signal.SIGINT)  # gunicorn's quick shutdown
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def server(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One gunicorn for the module (start-up is the slow part); tests use their own callers."""
    with _gunicorn_serving(pg_url, tmp_path_factory.mktemp("wsgi"), WORKERS) as served:
        yield served


def _jobs(url: str) -> list[dcache.JobRow]:
    with dcache.DB.open(url) as db:
        return db.list_jobs()


def test_identical_posts_over_all_workers_make_one_job(server: Server, pg_url: str) -> None:
    """Nine identical POSTs at once, served by several processes, create exactly one job."""
    body = {"targets": [{"url": "test://w/a"}, {"url": "test://w/b"}]}
    results = server.concurrently(
        9, "POST", "/jobs", body, caller="racer", headers={"X-Test-Delay": "0.2"}
    )
    assert {status for status, _, _ in results} == {202}
    assert len({b["job"]["id"] for _, b, _ in results}) == 1
    assert sorted(b["reused"] for _, b, _ in results) == [False] + [True] * 8
    assert len({pid for _, _, pid in results}) >= 2, "the POSTs did not spread over workers"
    assert [j.caller for j in _jobs(pg_url)].count("racer") == 1
    # Only the worker that created the job drains it.
    drainer = next(pid for _, b, pid in results if not b["reused"])
    until(lambda: server.started("a") != [])
    assert server.started("a") == [drainer]
    server.go("a")
    server.go("b")


def test_idempotency_key_holds_across_workers(server: Server, pg_url: str) -> None:
    """One Idempotency-Key sent to several workers at once makes one job; reusing it for
    another payload is refused by whichever worker gets it."""
    body = {"targets": [{"url": "test://w/k"}]}
    key = {"Idempotency-Key": "order-42", "X-Test-Delay": "0.2"}
    results = server.concurrently(6, "POST", "/jobs", body, caller="keyed", headers=key)
    assert {status for status, _, _ in results} == {202}
    assert len({b["job"]["id"] for _, b, _ in results}) == 1
    assert len({pid for _, _, pid in results}) >= 2
    other = {"targets": [{"url": "test://w/other"}]}
    results = server.concurrently(3, "POST", "/jobs", other, caller="keyed", headers=key)
    assert {(s, b["error"]["type"]) for s, b, _ in results} == {(422, "idempotency_key_reused")}
    assert [j.caller for j in _jobs(pg_url)].count("keyed") == 1
    server.go("k")


def test_status_reads_the_same_from_every_worker(server: Server) -> None:
    """Any worker reports the live progress of a job drained by one of them, and its end."""
    status, body, drainer = server.request(
        "POST", "/jobs", {"targets": [{"url": "test://w/s"}]}, caller="reader"
    )
    assert status == 202
    job_id = body["job"]["id"]
    until(lambda: server.started("s") == [drainer])
    results = server.concurrently(
        9, "GET", f"/jobs/{job_id}", caller="reader", headers={"X-Test-Delay": "0.2"}
    )
    assert {s for s, _, _ in results} == {200}
    assert {(b["job"]["status"], b["targets"][0]["status"]) for _, b, _ in results} == {
        ("running", "running")
    }
    assert {pid for _, _, pid in results} - {drainer}, "no other worker answered"
    # Bob sees nothing of it, from any worker.
    assert {s for s, _, _ in server.concurrently(3, "GET", f"/jobs/{job_id}", caller="bob")} == {
        404
    }
    server.go("s")
    status, body, _ = server.request("GET", f"/jobs/{job_id}?wait=20", caller="reader")
    assert status == 200
    assert body["job"]["status"] == "done"
    assert body["targets"][0]["result"]["meta"] == {"pid": drainer}


def test_cancel_through_one_worker_stops_a_job_drained_by_another(server: Server) -> None:
    """DELETE served by worker B stops the drain in worker A after its in-flight target."""
    targets = [{"url": f"test://w/{name}"} for name in ("c1", "c2", "c3")]
    status, body, drainer = server.request("POST", "/jobs", {"targets": targets})
    assert status == 202
    job_id = body["job"]["id"]
    until(lambda: server.started("c1") == [drainer])

    token = server.hold(drainer)  # the drainer cannot serve the DELETE now
    status, body, canceller = server.request("DELETE", f"/jobs/{job_id}")
    assert canceller != drainer
    assert status == 200
    assert body["job"]["status"] == "cancelled"
    (server.dir / f"release-{token}").touch()

    server.go("c1")  # the target in flight finishes, is stored, and the drain stops
    status, body, _ = server.request("GET", f"/jobs/{job_id}?wait=20")
    assert status == 200
    assert body["job"]["status"] == "cancelled"
    assert body["job"]["finished_at"] is not None
    assert [t["status"] for t in body["targets"]] == ["done", "pending", "pending"]
    server.go("c2")
    server.go("c3")
    assert server.started("c2") == []
    status, body, _ = server.request("DELETE", f"/jobs/{job_id}")
    assert status == 409
    assert body["error"]["type"] == "job_finished"


def test_conditional_reads_and_content_agree_across_workers(server: Server) -> None:
    """A finished job's ETag from one worker answers 304 from every other; results=false
    gives each stored result's size, and /content its bytes, whoever serves the request."""
    status, body, _ = server.request("POST", "/jobs", {"targets": [{"url": "test://w/e"}]})
    assert status == 202
    job_id = body["job"]["id"]
    server.go("e")
    status, headers, full, _ = server.raw(f"/jobs/{job_id}?wait=20")
    assert status == 200 and json.loads(full)["job"]["status"] == "done"
    etag = headers["ETag"]
    assert etag
    answers: list[Any] = [None] * 6
    barrier = threading.Barrier(len(answers))

    def poll(i: int) -> None:
        barrier.wait(10)
        answers[i] = server.raw(
            f"/jobs/{job_id}", headers={"If-None-Match": etag, "X-Test-Delay": "0.2"}
        )

    threads = [threading.Thread(target=poll, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {(a[0], a[2]) for a in answers} == {(304, b"")}
    assert len({a[3] for a in answers}) > 1, "one worker answered every poll"
    assert {a[1]["ETag"] for a in answers} == {etag}

    status, _, brief, _ = server.raw(f"/jobs/{job_id}?results=false")
    assert status == 200
    [target] = json.loads(brief)["targets"]
    stored = json.loads(full)["targets"][0]["result"]
    assert target["result"] is None
    assert target["bytes"] == len(json.dumps(stored, ensure_ascii=False).encode())
    status, headers, content, _ = server.raw(f"/jobs/{job_id}/targets/0/content")
    assert status == 200
    assert content == b"content of test://w/e"
    assert headers["Content-Type"].startswith("text/plain")
    assert server.raw(f"/jobs/{job_id}/targets/0/content", caller="bob")[0] == 404


def test_long_polls_hold_threads_not_the_workers_under_gthread(pg_url: str, tmp_path: Path) -> None:
    """The documented config (gthread workers): a caller's long polls each hold one of a
    worker's threads, so others are still served meanwhile. (Under sync workers, as many
    long polls as workers froze every other request for the whole wait.)"""
    with _gunicorn_serving(
        pg_url, tmp_path, 1, "--worker-class", "gthread", "--threads", "4"
    ) as srv:
        status, body, _ = srv.request(
            "POST", "/jobs", {"targets": [{"url": "test://w/lp"}]}, "poller"
        )
        assert status == 202
        job_id = body["job"]["id"]
        until(lambda: srv.started("lp") != [])
        polls: list[Any] = []
        threads = [
            threading.Thread(
                target=lambda: polls.append(
                    srv.request("GET", f"/jobs/{job_id}?wait=20", caller="poller")
                )
            )
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the polls are in and waiting
        started = time.monotonic()
        status, body, _ = srv.request(
            "POST", "/jobs", {"targets": [{"url": "test://w/other"}]}, "other"
        )
        assert status == 202
        assert time.monotonic() - started < 10, "a request waited behind the long polls"
        assert polls == []  # still held
        srv.go("lp")
        srv.go("other")
        for t in threads:
            t.join(30)
        assert [(s, b["job"]["status"]) for s, b, _ in polls] == [(200, "done")] * 3
