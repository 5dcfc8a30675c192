"""Signed webhooks announcing each job's end, sent from the store's transactional outbox.

A job submitted with ``notify=URL`` gets one outbox row when it ends, written by the same
transaction that ends it (see ``dcache._outbox``). Every runner configured with
:class:`Webhooks` runs a sender thread (``batch-webhooks-<owner>``) that claims due rows,
POSTs the payload signed as the Standard Webhooks specification says, and records each
attempt; failures are retried on :data:`batch.WEBHOOK_SCHEDULE` with jitter, a permanent
refusal (a 4xx other than 408 and 429) or the schedule's end gives up (``failed``).
Delivery is at least once: a receiver deduplicates on the ``webhook-id`` header, the same
for every attempt. A sender delivers a claim's rows only while its claim surely holds, so
two healthy senders never send one notification at once.
"""

from __future__ import annotations

import base64
import collections
import datetime as dt
import hashlib
import hmac
import http.client
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

import dcache
from dcache._schema import DELIVERED, GIVEN_UP, UNDELIVERED

from . import fetchers
from ._errors import FetchError, InvalidTargetsError, StoreError
from .events import DeliveryAttempted

if TYPE_CHECKING:
    from ._runner import Runner

__all__ = ["SCHEDULE", "Webhooks", "sign"]

SCHEDULE: tuple[dt.timedelta, ...] = (
    dt.timedelta(seconds=5),
    dt.timedelta(minutes=5),
    dt.timedelta(minutes=30),
    dt.timedelta(hours=2),
    dt.timedelta(hours=5),
    dt.timedelta(hours=10),
    dt.timedelta(hours=10),
)
"""The waits before the retries of a failed delivery (about 27.5 hours in all, ±10%)."""

MAX_URL_LENGTH = 2048
# A claim's deliveries end within this share of its lease, measured from just before the
# claim (the rest covers recording the last attempt, and the peers' clocks); one attempt
# may take half of that at most, so a claim always fits at least one.
_LEASE_USE = 0.8
_CLAIM_MAX = 16  # rows claimed at once for each lane (Webhooks.concurrency), at most
_ANSWER_BYTES = 2000  # of the receiver's answer, read and kept at most
_log = logging.getLogger("batch.webhooks")

Secrets = str | Sequence[str]


def _key(secret: str) -> bytes:
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise ValueError("a webhook secret is 'whsec_' followed by base64 (Standard Webhooks)")
    text = secret[6:]
    try:
        # Padding may be left out, as the reference implementation reads it.
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError:
        raise ValueError("a webhook secret is 'whsec_' followed by base64") from None
    if len(key) < 16:
        raise ValueError("a webhook secret must hold at least 16 bytes")
    return key


def sign(secrets: Secrets, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,<base64 HMAC-SHA256>`` per secret, spaced.

    The signed content is ``{msg_id}.{timestamp}.{body}``; several secrets (a rotation's
    old and new) give several signatures, any of which a receiver may check.
    """
    keys = [_key(s) for s in ([secrets] if isinstance(secrets, str) else secrets)]
    if not keys:
        raise ValueError("no webhook secret to sign with")
    content = f"{msg_id}.{timestamp}.".encode() + body
    sigs = [base64.b64encode(hmac.new(k, content, hashlib.sha256).digest()).decode() for k in keys]
    return " ".join(f"v1,{s}" for s in sigs)


def _check_secrets(value: object) -> None:
    if callable(value):
        return
    if isinstance(value, str):
        _key(value)
        return
    if not isinstance(value, Sequence) or not value:
        raise ValueError("secret must be a whsec_ string, a list of them, or a callable")
    for s in value:
        _key(s)


def _secret_repr(value: object) -> str:
    """A secret as ``repr`` shows it: how many, never their text."""
    if callable(value):
        return "<per caller>"
    n = 1 if isinstance(value, str) else len(value) if isinstance(value, Sequence) else 0
    return f"<{n} secret{'' if n == 1 else 's'}>"


@attrs.frozen
class Webhooks:
    """How this runner signs and sends job-end webhooks (``Runner(webhooks=...)``).

    Args:
        secret: ``"whsec_..."`` (Standard Webhooks), a list of them (a rotation: every
            one signs, receivers accept any), or ``secret(caller) -> str | list[str]``
            for a secret per caller.
        allow: addresses a notification URL may reach beyond public ones, as for
            fetches (:class:`batch.fetchers.Guard`): networks, host names or a callable
            ``(host, address) -> bool``. Loopback, private and link-local addresses are
            refused by default, at every connect (so DNS rebinding cannot slip through).
        schemes: the URL schemes accepted.
        timeout: seconds for one delivery attempt (connect, send, answer); at most 40% of
            ``lease`` (an attempt is cut to that otherwise).
        schedule: the waits before each retry (:data:`batch.WEBHOOK_SCHEDULE`); ``jitter`` spreads
            each by that fraction either way.
        poll: seconds between looks for due notifications (a job ended in this process
            wakes the sender at once).
        lease: how long a sender's claim on a notification holds; a sender that died
            mid-delivery leaves it to the others after that. A sender delivers a claim's
            notifications only while the whole attempt surely ends within 80% of it,
            and leaves the rest to be claimed again.
        finish_wait: how long the announcement of a cancelled job waits for the job to
            finish (its drain stops once the target in flight is stored; if the owner
            died, a reaper finishes it) before it goes out anyway.
        concurrency: how many attempts one sender makes at once, so that a receiver
            that never answers holds back the others' notifications by no more than
            its share of them (an int from 1 to 64; the lanes are short-lived threads
            named ``batch-webhooks-<owner>-N``). A ``secret`` callable may be called
            from that many threads at once.
    """

    secret: Secrets | Callable[[str], Secrets] = attrs.field(repr=_secret_repr)
    allow: fetchers.Allow = ()
    schemes: tuple[str, ...] = ("https", "http")
    timeout: float = 10.0
    schedule: tuple[dt.timedelta, ...] = SCHEDULE
    jitter: float = 0.1
    poll: float = 1.0
    lease: dt.timedelta = dt.timedelta(seconds=60)
    finish_wait: dt.timedelta = dt.timedelta(minutes=10)
    concurrency: int = 4

    @secret.validator
    def _check(self, _a: object, value: object) -> None:
        _check_secrets(value)
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or not 1 <= self.concurrency <= 64
        ):
            raise ValueError(f"concurrency must be an int from 1 to 64, not {self.concurrency!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be from 0 to less than 1")
        if self.timeout <= 0 or self.poll <= 0 or self.lease <= dt.timedelta(0):
            raise ValueError("timeout, poll and lease must be positive")
        if self.finish_wait < dt.timedelta(0):
            raise ValueError("finish_wait must not be negative")

    def secrets_for(self, caller: str) -> Secrets:
        """The secret(s) that sign a notification of ``caller``'s job."""
        found = self.secret(caller) if callable(self.secret) else self.secret
        _check_secrets(found)
        return found

    def check_url(self, url: object) -> str:
        """Refuse a notification URL that could never be delivered (raise 422's error).

        The scheme, the length, the port, the host name's spelling (after IDNA, as the
        connect sees it), and a host spelled as an address the guard refuses; names are
        judged on what they resolve to at every connect.
        """
        if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
            raise InvalidTargetsError(
                f"notify url must be a string of 1 to {MAX_URL_LENGTH} characters",
                field="notify.url",
            )
        try:
            parts = fetchers._split(url)
            if parts.scheme.lower() not in self.schemes or not parts.hostname:
                raise InvalidTargetsError(
                    f"notify url must be an absolute {' or '.join(self.schemes)} URL",
                    field="notify.url",
                )
            if parts.port == 0:
                raise FetchError(f"invalid URL {url[:200]!r}: port 0", hint="check the URL")
            fetchers.Guard(self.allow).check_literal(fetchers._hostname(parts, url))
        except fetchers.BlockedAddressError as exc:
            raise InvalidTargetsError(f"notify url refused: {exc}", field="notify.url") from None
        except FetchError as exc:
            raise InvalidTargetsError(f"notify url: {exc}", field="notify.url") from None
        return url

    def next_attempt(self, attempts: int, now: dt.datetime) -> dt.datetime | None:
        """When to try again after ``attempts`` failed attempts, or None to give up."""
        if attempts > len(self.schedule):
            return None
        wait = self.schedule[attempts - 1].total_seconds()
        wait *= 1 + random.uniform(-self.jitter, self.jitter)
        return now + dt.timedelta(seconds=wait)


def _post(
    url: str, body: bytes, headers: dict[str, str], hooks: Webhooks, timeout: float | None = None
) -> tuple[int, str]:
    """POST through the address guard within ``timeout`` seconds (``hooks.timeout``);
    (HTTP status, the start of the answer).

    Once the status has come it decides the attempt: a body that then fails to arrive
    only cuts the answer's text short.
    """
    deadline = time.monotonic() + (hooks.timeout if timeout is None else timeout)
    parts = fetchers._split(url)
    scheme = parts.scheme.lower()
    host = fetchers._hostname(parts, url)
    port = parts.port if parts.port is not None else 443 if scheme == "https" else 80
    budget = max(deadline - time.monotonic(), 0.001)
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=budget)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=budget)
    fetchers._guarded(
        conn, fetchers.Guard(hooks.allow), deadline, fetchers._wire_cap(_ANSWER_BYTES)
    )
    try:
        conn.request("POST", fetchers._request_target(parts), body=body, headers=headers)
        resp = conn.getresponse()
        read = bytearray()
        cut = ""
        try:
            while len(read) < _ANSWER_BYTES:
                part = resp.read1(_ANSWER_BYTES - len(read))
                if not part:
                    break
                read += part
        except Exception as exc:  # the status came: the attempt has its answer
            cut = f" [answer cut short: {type(exc).__name__}: {exc}]"[:100]
        text = read.decode("utf-8", "replace")
        return resp.status, text[:400] + cut if cut else text
    finally:
        conn.close()


def _permanent(status: int) -> bool:
    return 400 <= status < 500 and status not in (408, 429)


class Sender:
    """A runner's sender thread: claims due notifications, delivers, records."""

    def __init__(self, runner: Runner, hooks: Webhooks) -> None:
        self.runner = runner
        self.hooks = hooks
        self.wake = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, name=f"batch-webhooks-{runner.owner}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                while self.deliver_due() and not self._stop.is_set():
                    pass
            except StoreError:
                _log.warning("webhook sender: the store failed; retrying", exc_info=True)
            except Exception:
                _log.exception("webhook sender: unexpected error")
            self.wake.wait(self.hooks.poll)
            self.wake.clear()

    def deliver_due(self) -> int:
        """Claim and deliver what is due now; how many were attempted.

        No attempt may outlast the claim: another sender would take the row when it
        lapses and send it too. So a claim takes only as many rows as fit in it, in
        ``concurrency`` lanes of attempts one after the other at the longest attempt
        each, and before each row a lane checks that the attempt still fits (by both its
        monotonic clock and the clock the claim was stamped with). The rows no lane
        attempted (the claim ran short, or the sender is stopping) are given back at
        once for the next claim, this sender's or another's.
        """
        runner = self.runner
        usable = self.hooks.lease.total_seconds() * _LEASE_USE
        attempt = min(self.hooks.timeout, usable / 2)
        lanes = self.hooks.concurrency
        limit = max(1, min(_CLAIM_MAX * lanes, lanes * int(usable // attempt)))
        started, claimed_at = time.monotonic(), runner._clock()
        rows = runner.db.claim_notifications(
            runner.owner,
            now=claimed_at,
            lease=self.hooks.lease,
            limit=limit,
            finish_wait=self.hooks.finish_wait,
        )

        def fits() -> bool:
            elapsed = max(
                time.monotonic() - started, (runner._clock() - claimed_at).total_seconds()
            )
            return elapsed + attempt <= usable

        left = collections.deque(rows)
        taking = threading.Lock()
        attempted = [0]
        failed: list[BaseException] = []

        def lane() -> None:
            """Attempt the claim's rows one after the other, beside the other lanes."""
            try:
                while True:
                    # Asked before the attempt is prepared and again before it is sent:
                    # reading the job and the app's secret lookup take time of the claim.
                    with taking:
                        if failed or not left or self._stop.is_set() or not fits():
                            return
                        row = left.popleft()
                    if not self._deliver(row, attempt, fits):
                        return
                    with taking:
                        attempted[0] += 1
            except BaseException as exc:
                with taking:
                    failed.append(exc)

        lanes_used = min(lanes, len(rows))
        if lanes_used <= 1:
            lane()
        else:
            threads = [
                threading.Thread(target=lane, name=f"{self.thread.name}-{n}", daemon=True)
                for n in range(lanes_used)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if left:
            # Stopping, or the claim could lapse mid-attempt: the rows not attempted are
            # given back now rather than left claimed for a lease, so that the next claim
            # (a peer's, this sender's, or the next runner's after a restart) takes them.
            try:
                runner.db.release_notifications(runner.owner, [r.id for r in left])
            except StoreError:
                if not failed:
                    raise  # else the lane's error is the one to tell; the claim lapses
        if failed:
            raise failed[0]
        return attempted[0]

    def payload(self, row: dcache.NotificationRow) -> bytes:
        """The job as ``GET /jobs/<id>?results=false`` shows it, with its type.

        ``timestamp`` is when the job finished (the event's time, the same for every
        attempt); once the job is gone, when its end was queued.
        """
        found = self.runner.status(row.job_id, results=False)
        doc: dict[str, Any] = {"type": "job.finished", "timestamp": ""}
        when = row.created_at
        if found is None:  # its lease lapsed (purged): what the row itself knows
            doc["job"] = {"id": row.job_id, "status": row.job_status}
            doc["targets"] = None
        else:
            job, targets = found
            when = job.finished_at or when
            doc["job"] = {k: v for k, v in job.to_json().items() if k != "owner"}
            doc["targets"] = [t.to_json() for t in targets]
        doc["timestamp"] = when.isoformat()
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()

    def _deliver(
        self,
        row: dcache.NotificationRow,
        timeout: float | None = None,
        fits: Callable[[], bool] | None = None,
    ) -> bool:
        """One attempt, recorded. False when ``fits`` said, once the request was ready,
        that sending it would no longer end within the claim: it is recorded as an
        attempt not sent (so the schedule moves on, and a row whose preparation never
        fits ends as failed instead of being claimed forever) and logged."""
        runner = self.runner
        started = time.monotonic()
        status = 0
        sent = True
        try:
            body = self.payload(row)
            stamp = int(runner._clock().timestamp())
            headers = {
                "Content-Type": "application/json",
                "User-Agent": "batch-dcache-webhooks/0.1",
                "webhook-id": row.id,
                "webhook-timestamp": str(stamp),
                "webhook-signature": sign(self.hooks.secrets_for(row.caller), row.id, stamp, body),
            }
            if fits is not None and not fits():
                sent = False
                answer = (
                    "not sent: reading the job and signing it left too little of the "
                    "claim for the attempt (raise Webhooks(lease=...), or make the "
                    "secret lookup faster)"
                )
                _log.warning("notification %s %s", row.id, answer)
            else:
                status, text = _post(row.url, body, headers, self.hooks, timeout)
                answer = f"HTTP {status}: {text[:500]}"
        except StoreError:
            raise
        except Exception as exc:
            answer = f"{type(exc).__name__}: {exc}"[:500]
        attempts = row.attempts + 1
        now = runner._clock()
        retry_at = None
        if 200 <= status < 300:
            outcome = DELIVERED
        elif status and _permanent(status):
            outcome = GIVEN_UP
        else:
            retry_at = self.hooks.next_attempt(attempts, now)
            outcome = UNDELIVERED if retry_at is not None else GIVEN_UP
        recorded = runner.db.record_attempt(
            row.id,
            runner.owner,
            outcome=outcome,
            answer=answer,
            next_attempt_at=retry_at,
            now=now,
        )
        runner._emit(
            DeliveryAttempted(
                now,
                row.job_id,
                row.id,
                attempts,
                outcome,
                status,
                time.monotonic() - started,
                recorded,
            )
        )
        return sent
