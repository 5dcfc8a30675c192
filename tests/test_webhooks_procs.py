"""Webhook senders in several processes sharing one outbox (issue 14), with real kills.

Jobs that ended with a notification URL are queued in the store; runner processes (only
their sender threads have work) claim and deliver them. Each notification goes to one
sender at a time; a sender killed mid-delivery leaves its claim to lapse and a survivor
delivers (so the receiver may see that id twice: at least once, deduplicated by id).
"""

from __future__ import annotations

import datetime as dt
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _fetchers import WAIT
from standardwebhooks.webhooks import Webhook

import batch
import dcache
from dcache._outbox import message_id

pytestmark = pytest.mark.slow  # real processes, a few seconds each

HERE = Path(__file__).parent
SECRET = "whsec_a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s="
TTL = dt.timedelta(hours=1)


class SlowReceiver:
    """Answers 200 after ``delay`` seconds; ``hold`` makes the first request wait for it."""

    def __init__(self, delay: float = 0.02) -> None:
        self.seen: list[str] = []
        self.bodies: list[tuple[dict[str, str], bytes]] = []
        self.first = threading.Event()  # set when the first request arrived
        self.hold = threading.Event()
        self.hold.set()
        self.lock = threading.Lock()
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with me.lock:
                    first = not me.first.is_set()
                    me.first.set()
                if first:
                    me.hold.wait(WAIT)
                time.sleep(delay)
                with me.lock:
                    me.seen.append(headers["webhook-id"])
                    me.bodies.append((headers, body))
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender died while we waited

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[SlowReceiver]:
    r = SlowReceiver()
    yield r
    r.close()


def ended_jobs(url: str, n: int, notify: str) -> list[str]:
    """``n`` jobs ended (done) in the store, each with its notification queued."""
    db = dcache.DB.open(url)
    ids = []
    try:
        for i in range(n):
            job_id = batch.new_job_id()
            out = db.submit(
                job_id=job_id,
                caller=f"c{i}",
                caller_class="free",
                idem_key=f"{i:064x}",
                targets=[dcache.NewTarget(f"https://e.com/{i}")],
                ttl=TTL,
                jobs_per_caller=8,
                jobs_total=n,
                notify_url=notify,
            )
            assert out.kind == "created"
            db.write_target(job_id, 0, status="done", result='{"content":""}', ttl=TTL)
            ids.append(job_id)
    finally:
        db.close()
    return ids


def sender(url: str, seconds: float, lease: float = 60.0) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_webhook_child.py"), url, str(seconds), str(lease)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def statuses(url: str, ids: list[str]) -> dict[str, tuple[str, int]]:
    db = dcache.DB.open(url)
    try:
        out = {}
        for job_id in ids:
            note = db.notification(job_id)
            assert note is not None
            out[job_id] = (note.status, note.attempts)
        return out
    finally:
        db.close()


def test_two_sender_processes_share_the_outbox_and_deliver_each_once(
    shared_url: str, receiver: SlowReceiver
) -> None:
    ids = ended_jobs(shared_url, 24, receiver.url)
    procs = [sender(shared_url, 3.0), sender(shared_url, 3.0)]
    for p in procs:
        assert p.wait(WAIT) == 0
    assert sorted(receiver.seen) == sorted(message_id(j) for j in ids)  # each exactly once
    assert set(statuses(shared_url, ids).values()) == {("delivered", 1)}
    headers, body = receiver.bodies[0]
    Webhook(SECRET).verify(body, headers)


def test_a_sender_killed_mid_delivery_leaves_it_to_a_survivor(
    shared_url: str, receiver: SlowReceiver
) -> None:
    [job_id] = ended_jobs(shared_url, 1, receiver.url)
    receiver.hold.clear()  # the first delivery hangs until the sender is dead
    first = sender(shared_url, 30.0, lease=1.0)
    assert receiver.first.wait(WAIT)
    first.send_signal(signal.SIGKILL)
    first.wait(WAIT)
    receiver.hold.set()
    survivor = sender(shared_url, 3.0, lease=1.0)
    assert survivor.wait(WAIT) == 0
    assert statuses(shared_url, [job_id]) == {job_id: ("delivered", 1)}
    # The killed sender's request may have reached the receiver before it died: the id is
    # the same, so the receiver deduplicates.
    assert set(receiver.seen) == {message_id(job_id)}
    assert 1 <= len(receiver.seen) <= 2
