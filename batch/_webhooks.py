"""Signed webhooks announcing each job's end, sent from the store's transactional outbox.

A job submitted with ``notify=URL`` gets one outbox row when it ends, written by the same
transaction that ends it (see ``dcache._outbox``). Every runner configured with
:class:`Webhooks` runs a sender thread (``batch-webhooks-<owner>``) that claims due rows,
POSTs the payload signed as the Standard Webhooks specification says, and records each
attempt; failures are retried on :data:`batch.WEBHOOK_SCHEDULE` with jitter, a permanent
refusal (a 4xx other than 408 and 429) or the schedule's end gives up (``failed``).
Delivery is at least once: a receiver deduplicates on the ``webhook-id`` header, the same
for every attempt.
"""

from __future__ import annotations

import base64
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
from urllib.parse import urlsplit

import attrs

import dcache
from dcache._schema import DELIVERED, GIVEN_UP, UNDELIVERED

from . import fetchers
from ._errors import InvalidTargetsError, StoreError
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
_log = logging.getLogger("batch.webhooks")

Secrets = str | Sequence[str]


def _key(secret: str) -> bytes:
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise ValueError("a webhook secret is 'whsec_' followed by base64 (Standard Webhooks)")
    try:
        key = base64.b64decode(secret[6:], validate=True)
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
        timeout: seconds for one delivery attempt (connect, send, answer).
        schedule: the waits before each retry (:data:`batch.WEBHOOK_SCHEDULE`); ``jitter`` spreads
            each by that fraction either way.
        poll: seconds between looks for due notifications (a job ended in this process
            wakes the sender at once).
        lease: how long a sender's claim on a notification holds; a sender that died
            mid-delivery leaves it to the others after that.
    """

    secret: Secrets | Callable[[str], Secrets] = attrs.field()
    allow: fetchers.Allow = ()
    schemes: tuple[str, ...] = ("https", "http")
    timeout: float = 10.0
    schedule: tuple[dt.timedelta, ...] = SCHEDULE
    jitter: float = 0.1
    poll: float = 1.0
    lease: dt.timedelta = dt.timedelta(seconds=60)

    @secret.validator
    def _check(self, _a: object, value: object) -> None:
        _check_secrets(value)
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be from 0 to less than 1")
        if self.timeout <= 0 or self.poll <= 0:
            raise ValueError("timeout and poll must be positive")

    def secrets_for(self, caller: str) -> Secrets:
        """The secret(s) that sign a notification of ``caller``'s job."""
        found = self.secret(caller) if callable(self.secret) else self.secret
        _check_secrets(found)
        return found

    def check_url(self, url: object) -> str:
        """Refuse a notification URL that could never be delivered (raise 422's error).

        The scheme, the length, and a host spelled as an address the guard refuses;
        names are judged at every connect.
        """
        if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
            raise InvalidTargetsError(
                f"notify url must be a string of 1 to {MAX_URL_LENGTH} characters",
                field="notify.url",
            )
        parts = urlsplit(url)
        if parts.scheme.lower() not in self.schemes or not parts.hostname:
            raise InvalidTargetsError(
                f"notify url must be an absolute {' or '.join(self.schemes)} URL",
                field="notify.url",
            )
        try:
            fetchers.Guard(self.allow).check_literal(parts.hostname)
        except fetchers.BlockedAddressError as exc:
            raise InvalidTargetsError(f"notify url refused: {exc}", field="notify.url") from None
        return url

    def next_attempt(self, attempts: int, now: dt.datetime) -> dt.datetime | None:
        """When to try again after ``attempts`` failed attempts, or None to give up."""
        if attempts > len(self.schedule):
            return None
        wait = self.schedule[attempts - 1].total_seconds()
        wait *= 1 + random.uniform(-self.jitter, self.jitter)
        return now + dt.timedelta(seconds=wait)


def _post(url: str, body: bytes, headers: dict[str, str], hooks: Webhooks) -> tuple[int, str]:
    """POST through the address guard; (HTTP status, the start of the answer)."""
    deadline = time.monotonic() + hooks.timeout
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = fetchers._idna(parts.hostname or "")
    port = parts.port or (443 if scheme == "https" else 80)
    budget = max(deadline - time.monotonic(), 0.001)
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=budget)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=budget)
    fetchers._guarded(conn, fetchers.Guard(hooks.allow), deadline)
    try:
        conn.request("POST", fetchers._request_target(parts), body=body, headers=headers)
        resp = conn.getresponse()
        answer = resp.read(2000).decode("utf-8", "replace")
        return resp.status, answer
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
        """Claim and deliver what is due now; how many were attempted."""
        db = self.runner.db
        rows = db.claim_notifications(
            self.runner.owner, now=self.runner._clock(), lease=self.hooks.lease
        )
        for row in rows:
            if self._stop.is_set():
                break  # the claim lapses; another sender (or this one, later) takes it
            self._deliver(row)
        return len(rows)

    def payload(self, row: dcache.NotificationRow) -> bytes:
        """The job as ``GET /jobs/<id>?results=false`` shows it, with its type."""
        found = self.runner.status(row.job_id, results=False)
        doc: dict[str, Any] = {
            "type": "job.finished",
            "timestamp": self.runner._clock().isoformat(),
        }
        if found is None:  # purged meanwhile: what the row itself knows
            doc["job"] = {"id": row.job_id, "status": row.job_status}
            doc["targets"] = None
        else:
            job, targets = found
            doc["job"] = {k: v for k, v in job.to_json().items() if k != "owner"}
            doc["targets"] = [t.to_json() for t in targets]
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()

    def _deliver(self, row: dcache.NotificationRow) -> None:
        runner = self.runner
        started = time.monotonic()
        status = 0
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
            status, text = _post(row.url, body, headers, self.hooks)
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
