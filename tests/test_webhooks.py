"""Job-end webhooks from the transactional outbox (issue 14), on every backend.

A real receiver (``http.server`` on loopback, in a thread) answers as each test scripts
it; signatures are checked with the Standard Webhooks reference implementation
(``standardwebhooks`` on PyPI), not only with our own code.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import http.server
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _fetchers import WAIT
from conftest import Clock
from sqlalchemy import func, select
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

import batch
import dcache
from batch._webhooks import Sender
from dcache._schema import jobs, outbox

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"o" * 32).decode()
FAST = dt.timedelta(milliseconds=50)


class Receiver:
    """A webhook receiver on 127.0.0.1 that answers with scripted statuses (then 200).

    ``on_post(headers, body)``, if given, runs for each request before it is answered.
    """

    def __init__(
        self,
        answers: list[int] | None = None,
        on_post: Callable[[dict[str, str], bytes], None] | None = None,
    ) -> None:
        self.answers = list(answers or [])
        self.seen: list[tuple[dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                if on_post is not None:
                    on_post(headers, body)
                with receiver.lock:
                    receiver.seen.append((headers, body))
                    code = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def poll(fn: Any, timeout: float = WAIT) -> Any:
    """Call ``fn`` until it returns something true; return that (fail after timeout)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        found = fn()
        if found:
            return found
        assert time.monotonic() < deadline, "timed out"
        pause.wait(0.01)


def hooks(**kw: Any) -> batch.Webhooks:
    options: dict[str, Any] = {
        "secret": SECRET,
        "allow": ["127.0.0.1"],
        "schedule": (FAST,) * 4,
        "poll": 0.05,
    }
    options.update(kw)
    return batch.Webhooks(**options)


def ok(target: batch.Target) -> batch.Result:
    return batch.Result(content="x" * 10)


def urls(n: int) -> list[dict[str, str]]:
    return [{"url": f"https://example.com/{i}"} for i in range(n)]


def settled(runner: batch.Runner, job_id: str) -> dcache.NotificationRow:
    def done() -> dcache.NotificationRow | None:
        n = runner.notification(job_id)
        return n if n is not None and n.status != "pending" else None

    found: dcache.NotificationRow = poll(done)
    return found


def test_500_twice_then_200_is_one_notification_seen_three_times(
    db: dcache.DB, receiver: Receiver
) -> None:
    receiver.answers = [500, 500]
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        job_id, _ = runner.submit("alice", "free", urls(2), notify=receiver.url)
        assert runner.wait(job_id, timeout=WAIT) is not None
        note = settled(runner, job_id)
    assert (note.status, note.attempts) == ("delivered", 3)
    assert note.last_answer.startswith("HTTP 200")
    ids = {h["webhook-id"] for h, _ in receiver.seen}
    assert len(receiver.seen) == 3 and ids == {note.id}
    doc = json.loads(receiver.seen[-1][1])
    assert doc["type"] == "job.finished"
    assert doc["job"]["id"] == job_id and doc["job"]["status"] == "done"
    assert [t["result"] for t in doc["targets"]] == [None, None]
    assert all(t["bytes"] > 10 for t in doc["targets"])  # sizes, not results


def test_the_signature_verifies_with_the_reference_implementation(
    db: dcache.DB, receiver: Receiver
) -> None:
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        settled(runner, job_id)
    [(headers, body)] = receiver.seen
    payload = Webhook(SECRET).verify(body, headers)
    assert payload["job"]["id"] == job_id
    with pytest.raises(WebhookVerificationError):
        Webhook(OTHER).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(body.replace(b"done", b"fail"), headers)


def test_a_rotation_signs_with_both_secrets_and_either_verifies(
    db: dcache.DB, receiver: Receiver
) -> None:
    with batch.Runner(db, ok, webhooks=hooks(secret=[SECRET, OTHER])) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        settled(runner, job_id)
    [(headers, body)] = receiver.seen
    assert len(headers["webhook-signature"].split()) == 2
    for secret in (SECRET, OTHER):
        Webhook(secret).verify(body, headers)


def test_a_secret_per_caller(db: dcache.DB, receiver: Receiver) -> None:
    per_caller = {"alice": SECRET, "bob": OTHER}
    with batch.Runner(db, ok, webhooks=hooks(secret=per_caller.__getitem__)) as runner:
        for caller in per_caller:
            job_id, _ = runner.submit(caller, "free", urls(1), notify=receiver.url)
            settled(runner, job_id)
    for (headers, body), secret in zip(receiver.seen, per_caller.values(), strict=True):
        Webhook(secret).verify(body, headers)


def test_every_way_a_job_ends_is_announced_once(db: dcache.DB, receiver: Receiver) -> None:
    """done, partial, failed (by fail_job, as a reaper does), cancelled."""
    gate = threading.Event()

    def fetch(target: batch.Target) -> batch.Result:
        if target.url.endswith("/bad"):
            raise batch.FetchError("no")
        if target.url.endswith("/slow"):
            gate.wait(WAIT)
        return batch.Result(content="ok")

    with batch.Runner(db, fetch, webhooks=hooks()) as runner:
        done, _ = runner.submit("a", "free", [{"url": "https://e.com/1"}], notify=receiver.url)
        partial, _ = runner.submit(
            "b",
            "free",
            [{"url": "https://e.com/1"}, {"url": "https://e.com/bad"}],
            notify=receiver.url,
        )
        cancelled, _ = runner.submit(
            "c", "free", [{"url": "https://e.com/slow"}], notify=receiver.url
        )
        assert runner.cancel(cancelled)
        gate.set()
        ends = {j: settled(runner, j) for j in (done, partial, cancelled)}
    failed_db = db
    assert {j: n.job_status for j, n in ends.items()} == {
        done: "done",
        partial: "partial",
        cancelled: "cancelled",
    }
    # The reaper's path: fail_job ends a live job in the same transaction as its row.
    out = failed_db.submit(
        job_id=batch.new_job_id(),
        caller="d",
        caller_class="free",
        idem_key="k" * 64,
        targets=[dcache.NewTarget("https://e.com/x")],
        ttl=dt.timedelta(hours=1),
        jobs_per_caller=8,
        jobs_total=64,
        notify_url=receiver.url,
    )
    assert out.job is not None
    assert failed_db.fail_job(out.job.id, "restart")
    assert not failed_db.fail_job(out.job.id, "restart")  # a second end does nothing
    note = failed_db.notification(out.job.id)
    assert note is not None and (note.job_status, note.status) == ("failed", "pending")
    with failed_db.engine.connect() as conn:
        rows = conn.execute(select(outbox.c.job_id)).scalars().all()
    assert sorted(rows) == sorted([done, partial, cancelled, out.job.id])
    seen = [h["webhook-id"] for h, _ in receiver.seen]
    assert len(seen) == len(set(seen)) == 3


def test_a_job_without_notify_queues_nothing(db: dcache.DB) -> None:
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        job_id, _ = runner.submit("alice", "free", urls(2))
        runner.wait(job_id, timeout=WAIT)
        assert runner.notification(job_id) is None
    with db.engine.connect() as conn:
        assert conn.execute(select(outbox.c.id)).first() is None
        assert conn.execute(select(jobs.c.notify_url)).scalar_one() is None


def test_a_receiver_down_at_first_is_retried_on_the_schedule(db: dcache.DB) -> None:
    """Time injected: attempts come when the schedule says, not before; then delivered."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    down = Receiver()
    port = down.server.server_address[1]
    down.close()  # nothing listens: connection refused
    url = f"http://127.0.0.1:{port}/hook"
    schedule = (dt.timedelta(seconds=5), dt.timedelta(minutes=5), dt.timedelta(minutes=30))
    with batch.Runner(db, ok, clock=clock, webhooks=hooks(schedule=schedule, poll=3600)) as runner:
        sender = runner._sender
        assert sender is not None
        job_id, _ = runner.submit("alice", "free", urls(1), notify=url)
        runner.wait(job_id, timeout=WAIT)
        first = poll(lambda: (n := runner.notification(job_id)) and n.attempts == 1 and n)
        assert first and first.status == "pending" and "Connection" in first.last_answer
        wait = first.next_attempt_at - clock.now
        assert dt.timedelta(seconds=4.5) <= wait <= dt.timedelta(seconds=5.5)
        clock.advance(seconds=4.4)
        assert sender.deliver_due() == 0  # not yet due
        clock.advance(seconds=1.2)
        assert sender.deliver_due() == 1
        second = runner.notification(job_id)
        assert second is not None and second.attempts == 2
        wait = second.next_attempt_at - clock.now
        assert dt.timedelta(minutes=4.5) <= wait <= dt.timedelta(minutes=5.5)
        up = Receiver()
        try:
            # The receiver is back, on another port: point the row at it (as a test only).
            with db.engine.begin() as conn:
                conn.execute(outbox.update().values(url=up.url))
            clock.advance(minutes=6)
            assert sender.deliver_due() == 1
            final = runner.notification(job_id)
            assert final is not None and (final.status, final.attempts) == ("delivered", 3)
            assert len(up.seen) == 1
        finally:
            up.close()


def test_the_schedule_ends_in_failed_and_redeliver_sends_again(
    db: dcache.DB, receiver: Receiver
) -> None:
    receiver.answers = [503] * 3
    seen: list[batch.events.Event] = []
    with batch.Runner(
        db, ok, webhooks=hooks(schedule=(FAST, FAST)), observers=[seen.append]
    ) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        note = settled(runner, job_id)
        assert (note.status, note.attempts) == ("failed", 3)
        assert note.last_answer.startswith("HTTP 503")
        assert runner.redeliver(job_id)
        again = settled(runner, job_id)
        assert (again.status, again.attempts) == ("delivered", 1)  # the schedule over
        assert not runner.redeliver("0" * 32)
    attempts = [e for e in seen if isinstance(e, batch.events.DeliveryAttempted)]
    assert [a.outcome for a in attempts] == ["pending", "pending", "failed", "delivered"]
    assert {a.webhook_id for a in attempts} == {note.id}


def test_a_permanent_refusal_is_not_retried(db: dcache.DB, receiver: Receiver) -> None:
    receiver.answers = [410]
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        note = settled(runner, job_id)
    assert (note.status, note.attempts) == ("failed", 1)
    assert len(receiver.seen) == 1


def test_loopback_and_private_notify_urls_are_refused_by_default(db: dcache.DB) -> None:
    with batch.Runner(db, ok, webhooks=batch.Webhooks(secret=SECRET)) as runner:
        for url in ("http://127.0.0.1:9/x", "http://10.0.0.1/x", "http://169.254.169.254/x"):
            with pytest.raises(batch.InvalidTargetsError, match="refused"):
                runner.submit("alice", "free", urls(1), notify=url)
        for bad in ("ftp://example.com/x", "not a url", ""):
            with pytest.raises(batch.InvalidTargetsError):
                runner.submit("alice", "free", urls(1), notify=bad)
        assert runner.jobs() == []


def test_a_name_that_resolves_to_loopback_is_refused_at_connect(db: dcache.DB) -> None:
    """The guard judges every resolution: ``localhost`` passes the literal check, then
    its connect is refused and the attempt fails (no request reaches anything)."""
    with batch.Runner(db, ok, webhooks=batch.Webhooks(secret=SECRET, poll=0.05)) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify="http://localhost:9/x")
        note = poll(lambda: (n := runner.notification(job_id)) and n.attempts >= 1 and n)
        assert note and "blocked address 127.0.0.1" in note.last_answer.lower()


def test_notify_needs_webhooks_configured(db: dcache.DB) -> None:
    with batch.Runner(db, ok) as runner, pytest.raises(batch.InvalidTargetsError, match="not"):
        runner.submit("alice", "free", urls(1), notify="https://example.com/hook")


def test_secrets_are_checked() -> None:
    for bad in ("plain", "whsec_***", "whsec_" + base64.b64encode(b"short").decode(), []):
        with pytest.raises(ValueError):
            batch.Webhooks(secret=bad)


def test_on_finish_runs_once_per_job_end_off_the_drain_thread(db: dcache.DB) -> None:
    got: list[tuple[str, str, str]] = []
    with batch.Runner(
        db,
        ok,
        on_finish=lambda job: got.append((job.id, job.status, threading.current_thread().name)),
    ) as runner:
        ids = [runner.submit(f"c{i}", "free", urls(2))[0] for i in range(3)]
        for job_id in ids:
            runner.wait(job_id, timeout=WAIT)
        poll(lambda: len(got) == 3)
    assert sorted(g[0] for g in got) == sorted(ids)
    assert {g[1] for g in got} == {"done"}
    assert not any(g[2].startswith("batch-job-") for g in got)


def test_sign_matches_the_specification_by_hand() -> None:
    key = secrets.token_bytes(24)
    secret = "whsec_" + base64.b64encode(key).decode()
    header = batch.sign(secret, "msg_1", 1700000000, b'{"a":1}')
    assert header.startswith("v1,")
    Webhook(secret).verify(
        b'{"a":1}',
        {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(int(dt.datetime.now().timestamp())),
            "webhook-signature": batch.sign(
                secret, "msg_1", int(dt.datetime.now().timestamp()), b'{"a":1}'
            ),
        },
    )


def test_reads_that_show_a_job_show_its_notification_with_it(
    db: dcache.DB, receiver: Receiver
) -> None:
    """Runner.poll_notified and the streamed status read (on its own connection) give the
    notification exactly as DB.notification does, and none for a job without a URL."""
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        with_url, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        assert runner.wait(with_url, timeout=WAIT) is not None
        without, _ = runner.submit("alice", "free", urls(2))
        assert runner.wait(without, timeout=WAIT) is not None
        note = settled(runner, with_url)
        assert runner.poll_notified(with_url) == (runner.poll(with_url), note)
        assert runner.poll_notified(without) == (runner.poll(without), None)
        assert runner.poll_notified("0" * 32) is None
    for job_id, expected in ((with_url, note), (without, None)):
        stream = db.get_job_with_targets_streamed(job_id, notification=True)
        assert stream is not None
        with stream:
            assert stream.notification == expected
            assert len(list(stream)) == stream.job.targets_total
        plain = db.get_job_with_targets_streamed(job_id)
        assert plain is not None
        with plain:
            assert plain.notification is None  # not asked for: no second statement


# -- the payload, the schedule and the claim (the webhook review) ---------------------------


def queued(
    db: dcache.DB,
    url: str,
    now: dt.datetime,
    *,
    caller: str = "alice",
    n: int = 1,
    owner: str = "",
) -> str:
    """A job made in the store itself (no drain), announced at ``url`` when it ends."""
    job_id = batch.new_job_id()
    out = db.submit(
        job_id=job_id,
        caller=caller,
        caller_class="free",
        idem_key=hashlib.sha256(job_id.encode()).hexdigest(),
        targets=[dcache.NewTarget(f"https://e.com/{i}") for i in range(n)],
        ttl=dt.timedelta(hours=1),
        jobs_per_caller=64,
        jobs_total=64,
        owner=owner,
        now=now,
        notify_url=url,
    )
    assert out.kind == "created", out
    return job_id


def ended(db: dcache.DB, url: str, now: dt.datetime, *, caller: str) -> str:
    """A one-target job made in the store and ended there at ``now``: its notification
    to ``url`` is due."""
    job_id = queued(db, url, now, caller=caller)
    db.write_target(job_id, 0, status="done", ttl=dt.timedelta(hours=1), now=now)
    return job_id


def body_of(seen: tuple[dict[str, str], bytes]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(seen[1])
    return doc


def test_a_retry_after_the_lease_lapsed_sends_only_the_job_id_and_status(
    db: dcache.DB, receiver: Receiver
) -> None:
    """The schedule (about 27.5 h) outlasts the default lease (24 h): once the job is
    purged, a retry can only say which job ended and how, as the docs say."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    receiver.answers = [500]
    config = batch.Config(ttl=dt.timedelta(hours=1))
    webhooks = hooks(schedule=(dt.timedelta(hours=2),), poll=3600)
    with batch.Runner(db, ok, config, clock=clock, webhooks=webhooks) as runner:
        sender = runner._sender
        assert sender is not None
        job_id, _ = runner.submit("alice", "free", urls(2), notify=receiver.url)
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and job.finished_at is not None
        poll(lambda: (n := runner.notification(job_id)) and n.attempts == 1)
        first = body_of(receiver.seen[0])
        assert first["job"]["id"] == job_id and len(first["targets"]) == 2
        clock.advance(hours=3)  # the lease (1 h) lapsed; the retry (2 h) is due
        # The runner's own purge (due by this clock) may come first; either way it is gone.
        db.purge_expired(now=clock.now)
        with db.engine.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(jobs).where(jobs.c.id == job_id))
            assert rows.scalar() == 0
        assert runner.status(job_id) is None
        assert runner.notification(job_id) is None  # purged, as the job is
        # The sender's thread may still be in the loop that made the first attempt, and
        # then makes the retry itself: one of the two sends it.
        sender.deliver_due()
        poll(lambda: len(receiver.seen) == 2)
        # Delivered, the row goes the way of its job: nothing answers for it, nothing
        # sends it again, and the outbox does not grow with purged jobs' rows.
        assert runner.notification(job_id) is None
        assert not runner.redeliver(job_id)
        assert sender.deliver_due() == 0

        def outbox_rows() -> int:
            with db.engine.connect() as conn:
                return int(conn.execute(select(func.count()).select_from(outbox)).scalar_one())

        # The sender that sent it records it after the receiver had it: wait for that.
        poll(lambda: outbox_rows() == 0)
    retry = body_of(receiver.seen[1])
    assert retry == {
        "type": "job.finished",
        "timestamp": job.finished_at.isoformat(),
        "job": {"id": job_id, "status": "done"},
        "targets": None,
    }


def test_an_attempt_whose_preparation_ate_the_claim_is_not_made(
    db: dcache.DB, receiver: Receiver
) -> None:
    """Reading the job and looking up the secret (the app's code: a cold secrets
    manager) count against the claim: a POST that would now outlast it is not sent, or
    another sender that claimed the lapsed row would send the same webhook-id at once."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    slow = [True]

    def secret(caller: str) -> str:
        if slow.pop() if slow else False:
            clock.advance(seconds=50)  # 50 s of the 60 s lease gone
        return SECRET

    webhooks = hooks(secret=secret, timeout=5.0, poll=3600)
    with batch.Runner(db, ok, clock=clock, webhooks=webhooks) as runner:
        sender = runner._sender
        assert sender is not None
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        assert runner.wait(job_id, timeout=WAIT) is not None
        # The job's end wakes the sender: it prepares the attempt, then does not send it.
        # It is recorded as an attempt not sent: the schedule moves on (a lookup that is
        # always too slow ends the row as failed, not claimed again forever), and says why.
        poll(lambda: (n := runner.notification(job_id)) and n.attempts == 1)
        assert receiver.seen == []
        note = runner.notification(job_id)
        assert note is not None and note.status == "pending"
        assert note.last_answer.startswith("not sent: ")
        clock.advance(seconds=60)  # the retry is due
        assert sender.deliver_due() == 1
        assert len(receiver.seen) == 1
        note = runner.notification(job_id)
        assert note is not None and (note.status, note.attempts) == ("delivered", 2)


def test_a_cancelled_job_is_announced_once_its_in_flight_target_is_stored(
    db: dcache.DB, receiver: Receiver
) -> None:
    """job.finished means finished: the cancel's announcement waits for the drain to stop,
    so the receiver sees finished_at and the target that was in flight, stored."""
    entered, gate = threading.Event(), threading.Event()

    def fetch(target: batch.Target) -> batch.Result:
        if target.url.endswith("/1"):
            entered.set()
            assert gate.wait(WAIT)
        return batch.Result(content="ok")

    with batch.Runner(db, fetch, webhooks=hooks()) as runner:
        sender = runner._sender
        assert sender is not None
        job_id, _ = runner.submit("alice", "free", urls(3), notify=receiver.url)
        assert entered.wait(WAIT)
        assert runner.cancel(job_id)
        note = runner.notification(job_id)  # queued by the cancel: never lost
        assert note is not None and (note.status, note.attempts) == ("pending", 0)
        assert sender.deliver_due() == 0  # the job has ended, not finished: not yet
        assert receiver.seen == []
        gate.set()
        job = runner.wait(job_id, timeout=WAIT)
        assert job is not None and job.finished_at is not None
        note = settled(runner, job_id)
    assert (note.status, note.attempts) == ("delivered", 1)
    [seen] = receiver.seen
    doc = body_of(seen)
    assert doc["job"]["status"] == "cancelled"
    assert doc["job"]["finished_at"] == job.finished_at.isoformat() == doc["timestamp"]
    assert [t["status"] for t in doc["targets"]] == ["done", "done", "pending"]


def test_a_cancelled_job_whose_owner_died_before_its_drain_stopped_is_announced(
    db: dcache.DB, receiver: Receiver
) -> None:
    """The owner died between the cancel and its drain's end: the reaper finishes the job,
    and the announcement goes out then (it is never lost)."""
    now = dt.datetime.now(dt.timezone.utc)
    job_id = queued(db, receiver.url, now, n=2, owner="gone")
    db.write_target(job_id, 0, status="done", result='{"content":""}', ttl=dt.timedelta(hours=1))
    assert db.cancel(job_id)  # ... and its owner "gone" never beats again
    config = batch.Config(heartbeat=dt.timedelta(seconds=0.05))
    with batch.Runner(db, ok, config, webhooks=hooks()) as runner:
        note = settled(runner, job_id)
        job = runner.poll(job_id)
    assert job is not None and job.finished_at is not None
    assert (note.status, note.attempts) == ("delivered", 1)
    [seen] = receiver.seen
    doc = body_of(seen)
    assert doc["job"]["status"] == "cancelled"
    assert doc["job"]["finished_at"] == job.finished_at.isoformat() == doc["timestamp"]
    assert [t["status"] for t in doc["targets"]] == ["done", "pending"]


def test_a_cancelled_job_whose_drain_never_stops_is_announced_after_finish_wait(
    db: dcache.DB, receiver: Receiver
) -> None:
    """A live owner whose drain hangs in a fetch cannot hold the announcement for ever."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    db.heartbeat("alive", now=clock.now, stale_after=dt.timedelta(days=1))
    job_id = queued(db, receiver.url, clock.now, n=2, owner="alive")
    cancelled_at = clock.now
    assert db.cancel(job_id, now=cancelled_at)
    with batch.Runner(db, ok, clock=clock) as runner:
        sender = Sender(runner, hooks(finish_wait=dt.timedelta(minutes=10)))
        assert sender.deliver_due() == 0
        clock.advance(minutes=9)
        assert sender.deliver_due() == 0
        clock.advance(minutes=2)
        assert sender.deliver_due() == 1
        note = runner.notification(job_id)
    assert note is not None and (note.status, note.attempts) == ("delivered", 1)
    doc = body_of(receiver.seen[0])
    assert doc["job"]["status"] == "cancelled" and doc["job"]["finished_at"] is None
    assert doc["timestamp"] == cancelled_at.isoformat()  # when it was queued: the job's end


def test_every_attempt_carries_the_time_the_job_finished(db: dcache.DB, receiver: Receiver) -> None:
    """Standard Webhooks: the payload's timestamp is when the event happened, the same on
    every attempt; the signed header's is when the attempt was signed."""
    receiver.answers = [500]
    with batch.Runner(db, ok, webhooks=hooks()) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        job = runner.wait(job_id, timeout=WAIT)
        note = settled(runner, job_id)
    assert job is not None and job.finished_at is not None
    assert (note.status, note.attempts) == ("delivered", 2)
    stamps = [body_of(seen)["timestamp"] for seen in receiver.seen]
    assert stamps == [job.finished_at.isoformat()] * 2
    for headers, body in receiver.seen:
        Webhook(SECRET).verify(body, headers)  # the header's time is current


def test_redeliver_starts_the_schedule_over(db: dcache.DB, receiver: Receiver) -> None:
    """A redelivery gets every attempt of the schedule, whatever the earlier ones did."""
    with batch.Runner(db, ok, webhooks=hooks(schedule=(FAST, FAST))) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        assert (settled(runner, job_id).status, len(receiver.seen)) == ("delivered", 1)
        receiver.answers = [503] * 3
        assert runner.redeliver(job_id)
        note = settled(runner, job_id)
        assert (note.status, note.attempts, len(receiver.seen)) == ("failed", 3, 4)
        receiver.answers = [503]
        assert runner.redeliver(job_id)  # after giving up: the whole schedule again
        note = settled(runner, job_id)
        assert (note.status, note.attempts, len(receiver.seen)) == ("delivered", 2, 6)


def test_redeliver_waits_the_schedules_first_step_first(db: dcache.DB, receiver: Receiver) -> None:
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    schedule = (dt.timedelta(seconds=5), dt.timedelta(minutes=5))
    with batch.Runner(db, ok, clock=clock, webhooks=hooks(schedule=schedule)) as runner:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        assert settled(runner, job_id).attempts == 1
        receiver.answers = [500]
        assert runner.redeliver(job_id)
        note = poll(
            lambda: (n := runner.notification(job_id)) and n.last_answer[5:8] == "500" and n
        )
        assert (note.status, note.attempts) == ("pending", 1)
        wait = note.next_attempt_at - clock.now
        assert dt.timedelta(seconds=4.5) <= wait <= dt.timedelta(seconds=5.5)


class StallingReceiver:
    """Answers each request's status line and headers, then never sends the body."""

    def __init__(self, status: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/hook"
        self.requests = 0
        self.release = threading.Event()
        self.line = f"HTTP/1.1 {status} Whatever\r\nContent-Length: 100\r\n\r\nabc".encode()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(WAIT)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.requests += 1
            conn.sendall(self.line)
            self.release.wait(WAIT)  # 97 bytes promised, none sent

    def close(self) -> None:
        self.release.set()
        self.listener.close()


@pytest.mark.parametrize(("status", "outcome"), [(200, "delivered"), (410, "failed")])
def test_a_status_whose_body_never_comes_still_decides(
    db: dcache.DB, status: int, outcome: str
) -> None:
    """A 200 whose body stalls was delivered (retrying would send it twice); a 410 whose
    body stalls is permanent (retrying would knock on a gone door all schedule long)."""
    stalling = StallingReceiver(status)
    try:
        with batch.Runner(db, ok, webhooks=hooks(timeout=0.5)) as runner:
            job_id, _ = runner.submit("alice", "free", urls(1), notify=stalling.url)
            note = settled(runner, job_id)
    finally:
        stalling.close()
    assert (note.status, note.attempts, stalling.requests) == (outcome, 1, 1)
    assert note.last_answer.startswith(f"HTTP {status}")


def test_a_sender_stops_before_a_row_whose_claim_could_lapse_mid_delivery(
    db: dcache.DB,
) -> None:
    """Otherwise a second sender takes over a row whose claim lapsed while the first was
    still working through its batch, and both send it."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    taken: set[str] = set()  # what a second sender claimed, at each answer's end

    def slow(headers: dict[str, str], body: bytes) -> None:
        clock.advance(seconds=15)  # each answer takes 15 s (the timeout is 10 s)
        taken.update(r.id for r in db.claim_notifications("other", now=clock.now))

    receiver = Receiver(on_post=slow)
    try:
        for i in range(8):
            ended(db, receiver.url, clock.now, caller=f"c{i}")
        with batch.Runner(db, ok, clock=clock) as runner:
            lease = dt.timedelta(seconds=60)
            # One lane: each answer moves the test's clock as if the attempts came one
            # after the other (lanes side by side each check their own start the same way).
            sender = Sender(runner, hooks(lease=lease, timeout=10.0, concurrency=1))
            attempted = sender.deliver_due()
            sent = [h["webhook-id"] for h, _ in receiver.seen]
            assert not set(sent) & taken  # nothing both sent here and claimed there
            assert len(set(sent)) == len(sent) == attempted and 0 < attempted < 8
            for msg_id in sent:
                note = runner.notification(msg_id.removeprefix("msg_"))
                assert note is not None and note.status == "delivered"
            # What was left unsent is anyone's once the claims on it lapse.
            clock.advance(seconds=61)
            rest = {r.id for r in db.claim_notifications("third", now=clock.now)}
            assert rest == {f"msg_{j}" for j in jobs_of(db)} - set(sent)
    finally:
        receiver.close()


def test_a_sender_that_stops_mid_batch_gives_back_the_rows_it_did_not_attempt(
    db: dcache.DB,
) -> None:
    """A clean stop (a runner's close, a worker recycled) must not leave the rest of its
    claim to lapse: the next runner would wait a lease (a minute) before sending them."""
    clock = Clock(dt.datetime.now(dt.timezone.utc))
    sender: Sender | None = None

    def stop_now(headers: dict[str, str], body: bytes) -> None:
        assert sender is not None
        sender.stop()  # as close() does while an attempt is under way

    receiver = Receiver(on_post=stop_now)
    try:
        for i in range(5):
            ended(db, receiver.url, clock.now, caller=f"c{i}")
        with batch.Runner(db, ok, clock=clock) as runner:
            sender = Sender(runner, hooks())
            attempted = sender.deliver_due()  # one per lane, started before the stop
            sent = {h["webhook-id"] for h, _ in receiver.seen}
            assert 1 <= attempted == len(sent) < 5
            # At the same instant, another sender takes every row not attempted.
            rest = {r.id for r in db.claim_notifications("next", now=clock.now)}
            assert rest == {f"msg_{j}" for j in jobs_of(db)} - sent
            assert len(rest) == 5 - attempted
    finally:
        receiver.close()


def test_close_waits_for_an_attempt_under_way_and_records_it(db: dcache.DB) -> None:
    """close(timeout) takes up to twice its timeout, plus an attempt under way (at most
    Webhooks.timeout): the attempt is recorded before close returns, so the store may be
    closed next without the delivered notification being sent again a lease later."""
    entered = threading.Event()

    def slow(headers: dict[str, str], body: bytes) -> None:
        entered.set()
        time.sleep(1.5)

    receiver = Receiver(on_post=slow)
    runner = batch.Runner(db, ok, webhooks=hooks(timeout=8.0, lease=dt.timedelta(seconds=30)))
    try:
        job_id, _ = runner.submit("alice", "free", urls(1), notify=receiver.url)
        assert runner.wait(job_id, timeout=WAIT) is not None
        assert entered.wait(WAIT), "the attempt never started"
        t0 = time.monotonic()
        runner.close(timeout=0.5)
        took = time.monotonic() - t0
        assert took < 2 * 0.5 + 1.0 + 8.0, f"close(timeout=0.5) took {took:.1f} s"
        assert runner._sender is not None and not runner._sender.thread.is_alive()
        note = db.notification(job_id)
        assert note is not None and (note.status, note.attempts) == ("delivered", 1), note
    finally:
        runner.close()
        receiver.close()


def test_a_receiver_that_never_answers_does_not_hold_back_the_others(db: dcache.DB) -> None:
    """A sender makes up to ``concurrency`` attempts at once: three notifications to a
    dead endpoint, queued first, do not hold back another caller's by their timeouts."""
    hang = threading.Event()
    dead, alive = Receiver(on_post=lambda h, b: hang.wait(WAIT)), Receiver()
    try:
        now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=2)
        for i in range(3):
            ended(db, dead.url, now, caller=f"d{i}")
        good = ended(db, alive.url, now + dt.timedelta(seconds=1), caller="good")
        with batch.Runner(db, ok) as runner:
            sender = Sender(runner, hooks(timeout=8.0, lease=dt.timedelta(seconds=30)))
            assert sender.hooks.concurrency >= 4
            t = threading.Thread(target=sender.deliver_due)
            t.start()
            poll(lambda: alive.seen, timeout=4.0)  # well before any dead attempt ends
            assert not hang.is_set()
            hang.set()
            t.join(WAIT)
            assert not t.is_alive()
            note = runner.notification(good)
            assert note is not None and note.status == "delivered"
    finally:
        hang.set()
        dead.close()
        alive.close()


def test_webhooks_concurrency_is_checked() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="concurrency"):
            batch.Webhooks(secret=SECRET, concurrency=bad)


def jobs_of(db: dcache.DB) -> list[str]:
    with db.engine.connect() as conn:
        return list(conn.execute(select(jobs.c.id)).scalars())


def test_the_repr_of_webhooks_hides_the_secrets() -> None:
    for secret, shown in (
        (SECRET, "secret=<1 secret>"),
        ([SECRET, OTHER], "secret=<2 secrets>"),
        ({"alice": SECRET}.__getitem__, "secret=<per caller>"),
    ):
        text = repr(batch.Webhooks(secret=secret))
        assert shown in text, text
        for s in (SECRET, OTHER):
            assert s[6:16] not in text


UNDELIVERABLE = [
    "http://example.com:99999/x",
    "http://example.com:abc/x",
    "http://example.com:0/x",
    "http://a..b/x",
    "http://" + "a" * 70 + ".example.com/x",
    "http://ex ample.com/x",
    "https://[::1/",
]


def test_a_notify_url_that_could_never_be_delivered_is_refused_at_submit() -> None:
    """422 at submit (an InvalidTargetsError), not a job whose announcement fails for
    27.5 hours, nor a 500 (a bare ValueError)."""
    db = dcache.DB.memory()
    try:
        with batch.Runner(db, ok, webhooks=hooks()) as runner:
            for url in UNDELIVERABLE:
                with pytest.raises(batch.InvalidTargetsError) as caught:
                    runner.submit("alice", "free", urls(1), notify=url)
                assert caught.value.field == "notify.url", url
                assert caught.value.http_status == 422
            assert runner.jobs() == []
            # The same checks pass what can be delivered: a name with a port, IDNA.
            for url in ("https://example.com:8443/x", "https://b\u00fccher.example/x"):
                assert hooks().check_url(url) == url
    finally:
        db.close()


def test_an_unpadded_secret_is_read_as_the_reference_implementation_reads_it() -> None:
    for key in (b"k" * 32, secrets.token_bytes(16), secrets.token_bytes(24)):
        unpadded = "whsec_" + base64.b64encode(key).decode().rstrip("=")
        batch.Webhooks(secret=unpadded)
        stamp = int(time.time())
        headers = {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(stamp),
            "webhook-signature": batch.sign(unpadded, "msg_1", stamp, b'{"a":1}'),
        }
        assert Webhook(unpadded).verify(b'{"a":1}', headers) == {"a": 1}
    short = "whsec_" + base64.b64encode(b"s" * 15).decode().rstrip("=")
    with pytest.raises(ValueError, match="16 bytes"):
        batch.Webhooks(secret=short)
    with pytest.raises(ValueError, match="base64"):
        batch.Webhooks(secret="whsec_" + "a" * 21)  # 21 characters: no base64 length
