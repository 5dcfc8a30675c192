"""The Flask integration: a JSON API over a :class:`batch.Runner` (extra ``[flask]``).

Build the runner once per process, at app start, and mount the API::

    app = Flask(__name__)
    runner = batch.Runner(dcache.DB.open(os.environ["BATCH_DB"]), fetch)
    batch.flask.init_app(app, runner, identify)

Routes (under ``/jobs`` by default; the OpenAPI 3.1 document is ``/jobs/openapi.json``):

- ``POST /jobs`` ``{"targets": [...]}`` → 202 ``{"job": {...}, "reused": bool}``
- ``GET /jobs/<id>[?wait=N]`` → 200 ``{"job": {...}, "targets": [...]}``
- ``DELETE /jobs/<id>`` → 200 ``{"job": {...}}`` (cancelled), 409 if already finished

Every error is ``{"error": {"type": ..., "message": ..., ...context}}``. A caller only
ever sees its own jobs: another caller's job answers 404, exactly as an unknown id does.
This layer never fetches anything itself: the runner's ``fetch`` does. When that is the
library's :class:`batch.fetchers.Fetcher` (public addresses only, by default), a target
it would surely refuse (its scheme, or a host spelled as a refused address) answers 422
``refused_target`` before any job is made; names are judged when connected.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import attrs
from flask import Blueprint, Flask, Request, Response, request, url_for
from werkzeug.exceptions import HTTPException
from werkzeug.http import dump_options_header, parse_options_header

import dcache

from . import _json as jsonenc
from ._dashboard import dashboard
from ._errors import (
    BusyError,
    CallerBusyError,
    FetchError,
    IdempotencyKeyMismatchError,
    InvalidTargetsError,
    RunnerClosedError,
    SubmitError,
    TooManyTargetsError,
)
from ._metrics import metrics
from ._openapi import CONTENT_CSP, document
from ._routing import ANY, PLAIN, answer_other_methods
from ._runner import RawStatus, Runner
from ._values import MAX_KEY_LENGTH, Checked, Job
from .fetchers import Fetcher

__all__ = [
    "DEFAULT_MAX_BODY",
    "EXTENSION_KEY",
    "MAX_WAIT",
    "APIError",
    "BatchAPI",
    "Identify",
    "blueprint",
    "dashboard",
    "init_app",
    "metrics",
]

Identify = Callable[[Request], "tuple[str, str] | None"]
"""``identify(request) -> (caller, caller_class) | None``; ``None`` answers 401."""

EXTENSION_KEY = "batch"
MAX_WAIT = 30
"""The longest long-poll, in seconds (``GET /jobs/<id>?wait=N``)."""
DEFAULT_MAX_BODY = 1024 * 1024
"""The largest ``POST`` body accepted by default, in bytes (32 targets fit easily)."""
MAX_IDEMPOTENCY_KEY = MAX_KEY_LENGTH

log = logging.getLogger("batch.flask")

_JSON = "application/json"
_HTTP_TYPES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
    503: "unavailable",
}


class APIError(Exception):
    """An error answer in the API's one JSON shape; views raise it, a handler renders it."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        context: Mapping[str, Any] | None = None,
        top: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.headers = dict(headers or {})
        self.context = dict(context or {})
        self.top = dict(top or {})

    def response(self) -> Response:
        """The error as a JSON response."""
        body = {"error": {"type": self.type, "message": self.message, **self.context}}
        body.update(self.top)  # e.g. 410's "expired_at", beside "error"
        resp = _json(_utf8_safe(body), self.status)
        resp.headers.update(self.headers)
        return resp


def _utf8_safe(value: Any) -> Any:
    """``value`` with every string in it UTF-8 encodable: an error may echo the request's
    own text (a field's name), and JSON may spell a lone surrogate (``"\\ud800"``) that
    no UTF-8 answer can carry; it is named escaped (``\\ud800``), as the error is."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8_safe(k): _utf8_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_utf8_safe(v) for v in value]
    return value


def _json(obj: object, status: int = 200) -> Response:
    return Response(jsonenc.dumps(obj), status=status, mimetype=_JSON)


def _job_json(job: Job) -> dict[str, Any]:
    out = job.to_json()
    out.pop("owner", None)  # which process drains a job is the server's business
    return out


@attrs.define(eq=False)
class BatchAPI:
    """The state of one mounted API: what ``init_app`` keeps in ``app.extensions``.

    Attributes:
        runner: the process's runner (built once, at app start; never per request).
        identify: ``identify(request) -> (caller, caller_class) | None``.
        blueprint: the blueprint serving the routes.
        max_body: the largest ``POST`` body accepted, in bytes.
        retry_after: seconds sent in ``Retry-After`` with 429 and 503 answers.
        www_authenticate: the ``WWW-Authenticate`` header sent with 401, if any.
    """

    runner: Runner
    identify: Identify
    blueprint: Blueprint
    max_body: int = DEFAULT_MAX_BODY
    retry_after: int = 5
    www_authenticate: str | None = None

    # -- helpers ------------------------------------------------------------------------

    def _caller(self) -> tuple[str, str]:
        who = self.identify(request)
        if who is None:
            headers = {"WWW-Authenticate": self.www_authenticate} if self.www_authenticate else {}
            raise APIError(401, "unauthorized", "authentication required", headers=headers)
        caller, caller_class = who
        return caller, caller_class

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}

    def _own_job(self, job_id: str, caller: str) -> Job:
        job = self.runner.job(job_id)
        if job is None or job.caller != caller:
            raise self._missing(job_id, caller)
        return job

    def _read_payload(self) -> object:
        mimetype = request.mimetype
        if mimetype != _JSON and not (
            mimetype.startswith("application/") and mimetype.endswith("+json")
        ):
            raise APIError(
                415,
                "unsupported_media_type",
                f"send the body as {_JSON}, not {mimetype or 'no content type'}",
            )
        length = request.content_length
        if length is not None and length > self.max_body:
            raise _too_large(self.max_body)
        data = request.stream.read(self.max_body + 1)
        if len(data) > self.max_body:
            raise _too_large(self.max_body)
        try:
            return json.loads(data, parse_constant=_no_constants)
        except (ValueError, RecursionError) as exc:
            # ValueError covers JSONDecodeError, bad UTF-8 and over-long integers.
            raise APIError(400, "bad_request", f"the body is not valid JSON: {exc}") from None

    def _idempotency_key(self) -> str | None:
        raw = request.headers.get("Idempotency-Key")
        if raw is None:
            return None
        key = raw.strip()
        if len(key) >= 2 and key[0] == key[-1] == '"':
            key = key[1:-1]  # the draft's sf-string form; bare keys are common too
        if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY or not (key.isascii() and key.isprintable()):
            raise APIError(
                400,
                "invalid_idempotency_key",
                f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
            )
        return key

    def _submit(
        self, caller: str, caller_class: str, targets: Any, key: str | None, notify: str | None
    ) -> tuple[Job, bool]:
        try:
            return self.runner.submit_job(
                caller, caller_class, targets, idempotency_key=key, notify=notify
            )
        except IdempotencyKeyMismatchError:
            raise APIError(
                422,
                "idempotency_key_reused",
                "this Idempotency-Key was already used with a different payload; "
                "use a new key for a new request",
            ) from None
        except InvalidTargetsError as exc:
            ctx = {k: v for k, v in (("index", exc.index), ("field", exc.field)) if v is not None}
            raise APIError(422, "invalid_targets", str(exc), context=ctx) from None
        except TooManyTargetsError as exc:
            raise APIError(
                422,
                "too_many_targets",
                f"too many targets: {exc.count} given, at most {exc.limit} per job; split them",
                context={"count": exc.count, "limit": exc.limit},
            ) from None
        except CallerBusyError as exc:
            raise APIError(
                429,
                "caller_busy",
                f"you have {exc.live} live job(s), at most {exc.limit}; "
                "wait for one to finish or cancel it",
                headers=self._retry(),
                context={"live": exc.live, "limit": exc.limit, "retry_after": self.retry_after},
            ) from None
        except BusyError:
            raise APIError(
                429,
                "busy",
                "the service is running as many jobs as it may; retry later",
                headers=self._retry(),
                context={"retry_after": self.retry_after},
            ) from None
        except RunnerClosedError:
            raise self._unavailable("the service is shutting down; retry later") from None
        except SubmitError as exc:  # a future kind: keep its status, stay in one shape
            raise APIError(exc.http_status, "invalid_request", str(exc)) from None

    def _checked(self, targets: Any) -> Any:
        """The request's targets, checked once here for the submit to use as they are;
        422 for one the runner's :class:`Fetcher` would surely refuse.

        Malformed targets are passed on unchecked: the submit refuses them with the same
        words and context, after the checks it makes first (caller, notification URL).
        """
        try:
            items = Checked(targets)
        except InvalidTargetsError:
            return targets
        fetcher = self.runner.fetch
        if not isinstance(fetcher, Fetcher):
            return items  # an app's own fetch: only it knows what it refuses
        for index, target in enumerate(items):
            try:
                fetcher.check_url(target.url)
            except FetchError as exc:
                raise APIError(
                    422,
                    "refused_target",
                    f"targets[{index}].url: {exc.message}",
                    context={"index": index, "field": "url", "hint": exc.hint},
                ) from None
        return items

    def _unavailable(self, message: str) -> APIError:
        return APIError(
            503,
            "unavailable",
            message,
            headers=self._retry(),
            context={"retry_after": self.retry_after},
        )

    # -- views --------------------------------------------------------------------------

    def _post_job(self) -> Response:
        caller, caller_class = self._caller()
        payload = self._read_payload()
        if not isinstance(payload, dict):
            raise APIError(
                422,
                "invalid_request",
                'the body must be a JSON object {"targets": [...]}',
                context={"field": ""},
            )
        unknown = sorted(str(k) for k in payload if k not in ("targets", "notify"))
        if unknown:
            raise APIError(
                422,
                "invalid_request",
                f"unknown field {unknown[0]!r} (known: targets, notify)",
                context={"field": unknown[0]},
            )
        notify = _notify_url(payload.get("notify"))
        if "targets" not in payload:
            raise APIError(
                422, "invalid_request", "the body has no targets", context={"field": "targets"}
            )
        key = self._idempotency_key()
        targets = self._checked(payload["targets"])
        # The answer is the job row the submit transaction already has: no second read.
        job, reused = self._submit(caller, caller_class, targets, key, notify)
        resp = _json({"job": _job_json(job), "reused": bool(reused)}, 202)
        resp.headers["Location"] = url_for(".job", job_id=job.id)
        return resp

    def _missing(self, job_id: str, caller: str) -> APIError:
        """404, or 410 when the caller's own job has expired (its tombstone says so)."""
        found = self.runner.lookup_detail(job_id)
        if found.state == "expired" and found.caller == caller:
            at = found.expired_at.isoformat() if found.expired_at is not None else None
            return APIError(
                410,
                "expired",
                f"job {job_id} has expired: its lease lapsed and its results are gone",
                context={"expired_at": at},
                top={"expired_at": at},
            )
        return _not_found(job_id)

    def _get_job(self, job_id: str) -> Response:
        caller, _ = self._caller()
        # A poll usually has no query string: not parsing an empty one saves 5 µs of the
        # 80 µs a 304 spends in Python (Flask's own included), beside its read.
        args = request.args if request.query_string else _NO_ARGS
        wait = _wait_arg(args.get("wait"))
        results = _bool_arg("results", args.get("results"), default=True)
        tags = request.if_none_match
        if tags:
            # A conditional poll: one indexed read of the job row (and of its notification
            # once it has ended with one), no target, no result.
            found = self.runner.poll_notified(job_id)
            if found is None or found[0].caller != caller:
                raise self._missing(job_id, caller)
            tag = _etag(*found, results)
            if tags.contains_weak(tag):
                if wait > 0:
                    seen = tag
                    found = self.runner.wait_change_notified(
                        job_id, lambda f: _etag(*f, results) == seen, timeout=wait
                    )
                    if found is None or found[0].caller != caller:
                        raise self._missing(job_id, caller)
                    tag = _etag(*found, results)
                if tags.contains_weak(tag):
                    return _not_modified(tag)
        elif wait > 0:
            job = self._own_job(job_id, caller)
            if job.finished_at is None:
                with contextlib.suppress(TimeoutError):
                    self.runner.wait(job_id, timeout=wait)
        status = self.runner.status_raw(job_id, results=results)
        if status is None:
            raise self._missing(job_id, caller)
        if status.job.caller != caller:  # ownership, judged on the same read
            status.close()
            raise self._missing(job_id, caller)
        note = status.notification
        notification = b',"notification":' + jsonenc.dumps(note.to_json()) if note else b""
        return _status_response(status, _etag(status.job, note, results), notification)

    def _get_target(self, job_id: str, idx: str) -> Response:
        caller, _ = self._caller()
        found = self._target(job_id, idx, caller)
        _job, target = found
        head, result, tail = _target_parts(target, brief=False)
        body = b"".join((head, result, tail))
        return Response(body, mimetype=_JSON)

    def _get_content(self, job_id: str, idx: str) -> Response:
        caller, _ = self._caller()
        _job, target = self._target(job_id, idx, caller, results=False)
        if target.result_bytes is None:
            raise APIError(
                404,
                "no_result",
                f"target {target.idx} has no result ({target.status}"
                + (f": {target.error}" if target.error else "")
                + ")",
                context={"status": target.status},
            )
        index = target.idx

        def read(offset: int, size: int) -> bytes:
            data = self.runner.read_result(job_id, index, offset, size)
            if data is None:
                raise _ResultGone(f"the result of target {index} of job {job_id} is gone")
            return data

        try:
            parts = _content_parts(read)
            if parts is None:  # not the runner's own layout: decode it whole
                whole = json.loads(_read_to_end(read, 0))
                parts = whole.get("meta") or {}, iter([whole.get("content", "")])
                del whole
        except _ResultGone:
            # Purged since its row was read, before a byte was sent: answer as a request a
            # moment later would (410 to its caller).
            raise self._missing(job_id, caller) from None
        meta, pieces = parts
        ctype = _media_type(meta.get("content_type")) if isinstance(meta, dict) else None
        if isinstance(meta, dict) and meta.get("encoding") == "base64":
            body = _base64_body(pieces)
            mimetype = ctype or "application/octet-stream"
        else:
            body = (piece.encode("utf-8") for piece in pieces)
            mimetype = _as_utf8(ctype or "text/plain")
        # Read from the store, decoded and written a slice at a time: neither the stored
        # text nor the content is ever held whole (in the driver, in Python or in the
        # answer). A result purged while it streams ends the answer early (no last chunk).
        resp = Response(body, content_type=mimetype)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        # A stranger's page (HTML, SVG) opened from here must not run on the app's origin
        # with the user's cookies: sandboxed, it is shown in an opaque origin of its own,
        # its scripts off and nothing loaded on its behalf.
        resp.headers["Content-Security-Policy"] = CONTENT_CSP
        return resp

    def _target(
        self, job_id: str, idx: str, caller: str, *, results: bool = True
    ) -> tuple[Job, dcache.TargetRow]:
        index = _index_arg(idx)
        found = (
            self.runner.result_raw(job_id, index, results=results) if index is not None else None
        )
        if found is None or found[0].caller != caller:
            job = self.runner.job(job_id) if found is None else found[0]
            if job is None or job.caller != caller:
                raise self._missing(job_id, caller)
            raise APIError(
                404,
                "not_found",
                f"job {job_id} has no target {idx} (it has {job.targets_total}, from 0)",
            )
        return found

    def _delete_job(self, job_id: str) -> Response:
        caller, _ = self._caller()
        # One compare-and-set, which also answers with the job as it decided it.
        cancelled, job = self.runner.cancel_job(job_id, caller=caller)
        if job is None:
            raise self._missing(job_id, caller)
        if not cancelled:
            raise APIError(
                409,
                "job_finished",
                f"job {job_id} is already {job.status}; only a live job can be cancelled",
                context={"status": job.status},
            )
        return _json({"job": _job_json(job)})

    def _openapi(self) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "/openapi.json"
        prefix = rule[: -len("/openapi.json")]
        return _json(document(prefix, server=request.script_root or "/"))

    # -- errors -------------------------------------------------------------------------

    def _handle_store_error(self, exc: dcache.StoreError) -> Response:
        if isinstance(exc, dcache.StoreUnavailableError):
            log.warning("job store unavailable: %s", exc)
            return self._unavailable("the job store is unavailable; retry later").response()
        log.error("job store failed", exc_info=exc)
        return APIError(500, "internal", "the job store failed").response()


# -- the pass-through status answer ---------------------------------------------------------

# A status answer up to this size is sent whole (one write, with a Content-Length); a
# larger one is streamed target by target, each stored result written as it is read.
_WHOLE = 256 * 1024
_STATUSES = {s: s.encode() for s in dcache.TARGET_STATUSES}


def _etag(job: Job, note: dcache.NotificationRow | None, results: bool) -> str:
    """A tag that changes exactly when the job, any target or its notification does
    (strong; unquoted).

    Every target write moves ``targets_done`` (and ``updated_at``); every status change
    moves ``status`` and ``updated_at``; a drain's end sets ``finished_at``; every delivery
    attempt moves the notification's ``updated_at`` (and its status, attempts, next
    attempt): the job row and the notification row decide, so a conditional poll reads
    those two (the second only for an ended job that has one) and nothing else.
    """
    parts = (
        job.id,
        job.status,
        job.error,
        str(job.targets_done),
        str(job.targets_failed),
        _iso(job.updated_at),
        _iso(job.expires_at),
        _iso(job.finished_at),
        "r" if results else "b",
        *(
            (note.status, str(note.attempts), _iso(note.next_attempt_at), _iso(note.updated_at))
            if note is not None
            else ()
        ),
    )
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=12).hexdigest()
    return digest


def _iso(value: Any) -> str:
    return value.isoformat() if value is not None else ""


def _not_modified(tag: str) -> Response:
    resp = Response(status=304)
    resp.set_etag(tag)
    return resp


def _target_parts(target: dcache.TargetRow, *, brief: bool) -> tuple[bytes, bytes, bytes]:
    """One target's JSON in three pieces: before its result, the result, after it.

    The result and the options are the stored JSON texts, spliced in untouched (the
    runner wrote both with ``json``, so they are valid JSON already).
    """
    dumps = jsonenc.dumps
    head = b"".join(
        (
            b'{"idx":',
            str(target.idx).encode(),
            b',"url":',
            dumps(target.url),
            b',"options":',
            target.options.encode(),
            b',"status":"',
            _STATUSES.get(target.status) or target.status.encode(),
            b'","result":',
        )
    )
    result = target.result.encode() if target.result is not None else b"null"
    tail = [b',"error":', dumps(target.error), b',"hint":', dumps(target.hint)]
    if brief and target.result_bytes is not None:
        tail += [b',"bytes":', str(target.result_bytes).encode()]
    tail.append(b"}")
    return head, result, b"".join(tail)


def _notify_url(value: object) -> str | None:
    """The body's ``"notify": {"url": ...}`` (checked further by the runner), or None."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"url"} or not isinstance(value["url"], str):
        raise APIError(
            422,
            "invalid_request",
            'notify must be an object {"url": "https://..."}',
            context={"field": "notify"},
        )
    return value["url"]


def _status_chunks(status: RawStatus, brief: bool, notification: bytes = b"") -> Iterator[bytes]:
    """The status document, a few pieces per target, reading targets as it goes."""
    with status:
        job = jsonenc.dumps(_job_json(status.job))
        yield b'{"job":' + job + b',"targets":['
        sep = b""
        for target in status:
            head, result, tail = _target_parts(target, brief=brief)
            del target  # the row's result text: one copy of each result at a time
            yield sep + head
            yield result
            del result
            yield tail
            sep = b","
    yield b"]" + notification + b"}"


def _status_response(status: RawStatus, tag: str, notification: bytes = b"") -> Response:
    """The status answer: whole when small, else streamed target by target."""
    chunks = _status_chunks(status, brief=_brief(status), notification=notification)
    head: list[bytes] = []
    size = 0
    for chunk in chunks:
        head.append(chunk)
        size += len(chunk)
        if size > _WHOLE:
            resp = Response(_chain(head, chunks), mimetype=_JSON)
            break
    else:
        resp = Response(b"".join(head), mimetype=_JSON)
    resp.set_etag(tag)
    return resp


def _brief(status: RawStatus) -> bool:
    return not status.results


def _chain(first: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    try:
        while first:
            yield first.pop(0)
        yield from rest
    finally:
        close = getattr(rest, "close", None)
        if close is not None:
            close()  # a client gone mid-answer: end the read, give the connection back


def _bool_arg(name: str, raw: str | None, *, default: bool) -> bool:
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise APIError(
        400,
        "invalid_parameter",
        f"{name} must be true or false",
        context={"parameter": name},
    )


def _index_arg(raw: str) -> int | None:
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        return None
    return int(raw)


# -- raw content, read and decoded a slice at a time ------------------------------------------

_CONTENT_PREFIX = b'{"content": "'  # how the runner stores a result (json.dumps defaults)
_META_PREFIX = ', "meta": '
# Bytes of the stored text (UTF-8) per read. Each read holds about four copies of a slice
# at once (the driver's, the bytes, the decoded and the encoded piece).
_SLICE = 128 * 1024

_Read = Callable[[int, int], bytes]  # (offset, size) -> those bytes of the stored text


class _ResultGone(dcache.StoreError):
    """The result being read was purged (or replaced) meanwhile."""


def _content_parts(read: _Read) -> tuple[Any, Iterator[str]] | None:
    """``(meta, pieces)`` of a stored result, its content read and decoded a slice at a
    time. ``None`` when the text is not laid out as the runner writes it.

    Two passes over the content: the first finds where its JSON string ends (the meta,
    which gives the content type, comes after it), the second decodes it. Both scan
    UTF-8 bytes cut anywhere: a quote or a backslash is never part of a longer character.
    """
    start = len(_CONTENT_PREFIX)
    if read(0, start) != _CONTENT_PREFIX:
        return None
    end = _content_end(read, start)
    if end < 0:
        return None
    try:
        rest = _read_to_end(read, end + 1).decode("utf-8")
    except UnicodeDecodeError:
        return None
    meta: Any = {}
    if rest.startswith(_META_PREFIX) and rest.endswith("}"):
        try:
            meta = json.loads(rest[len(_META_PREFIX) : -1])
        except ValueError:
            return None
    elif rest != "}":
        return None
    return meta, _decoded(_slices(read, start, end))


def _content_end(read: _Read, start: int) -> int:
    """Where the JSON string whose body starts at ``start`` ends (its closing quote), or -1."""
    pos, escaped = start, False
    while True:
        chunk = read(pos, _SLICE)
        if not chunk:
            return -1
        i = 1 if escaped else 0  # the byte after a slice's last backslash is escaped
        q = _string_end(chunk, i)
        if q >= 0:
            return pos + q
        run = len(chunk) - len(chunk.rstrip(b"\\"))
        escaped = min(run, max(len(chunk) - i, 0)) % 2 == 1
        pos += len(chunk)


def _string_end(text: bytes, i: int) -> int:
    """Where a JSON string body that goes on at ``i`` of ``text`` ends (its closing quote,
    not escaped), or -1 when it goes past the end of ``text``."""
    while True:
        q = text.find(b'"', i)
        if q < 0:
            return -1
        b = q
        while b > i and text[b - 1] == _BACKSLASH:
            b -= 1
        if (q - b) % 2 == 0:  # not itself escaped
            return q
        i = q + 1


_BACKSLASH = ord("\\")


def _read_to_end(read: _Read, pos: int) -> bytes:
    """The stored text from ``pos`` to its end."""
    parts = []
    while True:
        chunk = read(pos, _SLICE)
        parts.append(chunk)
        if len(chunk) < _SLICE:
            return b"".join(parts)
        pos += len(chunk)


def _slices(read: _Read, start: int, end: int) -> Iterator[bytes]:
    """The stored text from ``start`` to ``end``, a slice at a time."""
    pos = start
    while pos < end:
        chunk = read(pos, min(_SLICE, end - pos))
        if not chunk:  # the text changed under us: the result was replaced or purged
            raise dcache.StoreError("the stored result changed while it was read")
        yield chunk
        pos += len(chunk)


def _decoded(escaped: Iterator[bytes]) -> Iterator[str]:
    """The body of a JSON string decoded, given as slices of its UTF-8 bytes cut anywhere."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    carry = ""
    for raw in escaped:
        text = carry + utf8.decode(raw)
        # An escape is at most 6 characters (\\uXXXX) and a surrogate pair 12: a cut inside
        # one does not decode (or leaves half a pair), so try a few cuts before the end.
        for j in range(len(text), max(len(text) - 12, 0) - 1, -1):
            try:
                piece = json.loads('"' + text[:j] + '"')
            except ValueError:
                continue
            if not (piece and "\ud800" <= piece[-1] <= "\udbff"):
                break
        else:
            raise ValueError("the stored result's content is not a JSON string")
        carry = text[j:]
        if piece:
            yield piece
    carry += utf8.decode(b"", final=True)
    if carry:
        yield json.loads('"' + carry + '"')


_NO_SPACE = str.maketrans("", "", " \t\n\r\f\v")
"""Deletes ASCII whitespace: base64 from an app's fetch may come in MIME lines."""


def _base64_body(pieces: Iterator[str]) -> Iterator[bytes]:
    """Base64 pieces decoded as they come (each cut at a multiple of 4 characters),
    whitespace (MIME's line breaks) left out."""
    carry = ""
    for piece in pieces:
        text = carry + piece.translate(_NO_SPACE)
        cut = len(text) - len(text) % 4
        carry = text[cut:]
        if cut:
            try:
                yield base64.b64decode(text[:cut], validate=True)
            except (binascii.Error, ValueError):
                yield text[:cut].encode("utf-8")  # not base64 after all: as stored
    if carry:
        yield carry.encode("utf-8")


def _not_found(job_id: str) -> APIError:
    # Unknown, lapsed and another caller's job answer alike, so ids cannot be probed.
    return APIError(404, "not_found", "no such job (unknown, expired, or not yours)")


def _too_large(limit: int) -> APIError:
    return APIError(
        413, "payload_too_large", f"the body is over {limit} bytes", context={"limit": limit}
    )


def _no_constants(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


_NO_ARGS: dict[str, str] = {}


def _wait_arg(raw: str | None) -> float:
    if raw is None:
        return 0.0
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not (math.isfinite(wait) and 0 <= wait <= MAX_WAIT):
        raise APIError(
            400,
            "invalid_parameter",
            f"wait must be a number of seconds from 0 to {MAX_WAIT}",
            context={"parameter": "wait"},
        )
    return wait


def _http_error(exc: HTTPException) -> Response:
    code = exc.code or 500
    err = APIError(code, _HTTP_TYPES.get(code, "http_error"), exc.description or exc.name)
    resp = err.response()
    if exc.response is None:
        for name, value in exc.get_headers():
            if name.lower() not in ("content-type", "content-length"):
                resp.headers[name] = value
    return resp


def _internal_error(_exc: Exception) -> Response:
    # Flask has logged the exception already; the client gets the one JSON shape.
    return APIError(500, "internal", "internal server error").response()


def blueprint(
    runner: Runner,
    identify: Identify,
    url_prefix: str = "/jobs",
    *,
    name: str = "batch",
    max_body: int = DEFAULT_MAX_BODY,
    retry_after: int = 5,
    www_authenticate: str | None = None,
) -> Blueprint:
    """A blueprint serving the jobs API on ``runner``, for apps that mount it themselves.

    Args:
        runner: the process's runner, built once at app start (never per request).
        identify: ``identify(request) -> (caller, caller_class) | None``; ``None``
            answers 401. It may also raise an ``HTTPException`` (rendered as JSON).
        url_prefix: where the routes live.
        name: the blueprint's name (to mount the API twice, under two names).
        max_body: the largest ``POST`` body accepted, in bytes (413 beyond).
        retry_after: the ``Retry-After`` seconds sent with 429 and 503.
        www_authenticate: the ``WWW-Authenticate`` header sent with 401, if any
            (e.g. ``'Bearer realm="jobs"'``).
    """
    return _build(
        runner,
        identify,
        url_prefix,
        name=name,
        max_body=max_body,
        retry_after=retry_after,
        www_authenticate=www_authenticate,
    ).blueprint


def _build(
    runner: Runner,
    identify: Identify,
    url_prefix: str,
    *,
    name: str = "batch",
    max_body: int = DEFAULT_MAX_BODY,
    retry_after: int = 5,
    www_authenticate: str | None = None,
) -> BatchAPI:
    if max_body <= 0 or retry_after < 0:
        raise ValueError("max_body must be positive and retry_after not negative")
    bp = Blueprint(name, __name__, url_prefix=url_prefix)
    api = BatchAPI(
        runner,
        identify,
        bp,
        max_body=max_body,
        retry_after=retry_after,
        www_authenticate=www_authenticate,
    )
    bp.add_url_rule("", "submit", api._post_job, methods=["POST"], **PLAIN)
    bp.add_url_rule("/openapi.json", "openapi", api._openapi, methods=["GET"], **PLAIN)
    bp.add_url_rule("/<job_id>", "job", api._get_job, methods=["GET"], **PLAIN)
    bp.add_url_rule("/<job_id>", "cancel", api._delete_job, methods=["DELETE"], **PLAIN)
    bp.add_url_rule("/<job_id>/targets/<idx>", "target", api._get_target, methods=["GET"], **PLAIN)
    bp.add_url_rule(
        "/<job_id>/targets/<idx>/content", "content", api._get_content, methods=["GET"], **PLAIN
    )
    # Wrong methods, OPTIONS and unknown paths in the one JSON shape (batch._routing).
    answer_other_methods(bp, _ROUTES, _method_not_allowed)
    # "<prefix>/" (an empty job id) matches no rule above; without this it fell through
    # to the app's HTML 404.
    bp.add_url_rule(
        "/",
        "no_job_id",
        _no_job_id,
        methods=ANY,
    )
    bp.add_url_rule(
        "/<path:rest>",
        "unknown",
        _unknown_path,
        methods=ANY,
    )
    bp.register_error_handler(APIError, lambda exc: exc.response())
    bp.register_error_handler(dcache.StoreError, api._handle_store_error)
    bp.register_error_handler(HTTPException, _http_error)
    bp.register_error_handler(500, _internal_error)
    bp.after_request(_no_store)
    return api


def _no_store(resp: Response) -> Response:
    resp.headers.setdefault("Cache-Control", "no-store")  # per-caller data: never cache
    return resp


_MEDIA_TYPE = re.compile(
    r"[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+[ \t]*(;[ -~\t]*)?"
)
"""A media type as a Content-Type header carries it (RFC 9110 tokens, then parameters
of printable ASCII): no line break, control character or non-ASCII text."""


def _media_type(reported: object) -> str | None:
    """The content type a fetch reported, if it can be sent as one; else ``None`` (the
    default is used): a misbehaving fetch never breaks or injects the answer's headers."""
    if isinstance(reported, str) and _MEDIA_TYPE.fullmatch(reported):
        return reported
    return None


def _as_utf8(ctype: str) -> str:
    """``ctype`` with its charset (if it named one) replaced by UTF-8: the stored content
    is text, sent encoded as UTF-8 whatever charset the page it came from declared."""
    media, params = parse_options_header(ctype)  # quoted values may hold ";"
    kept = {k: v for k, v in params.items() if k.lower() != "charset"}
    return dump_options_header(media, {**kept, "charset": "utf-8"})


_ROUTES = (
    ("", "submit", "POST"),
    ("/openapi.json", "openapi", "GET, HEAD"),
    ("/<job_id>", "job", "GET, HEAD, DELETE"),
    ("/<job_id>/targets/<idx>", "target", "GET, HEAD"),
    ("/<job_id>/targets/<idx>/content", "content", "GET, HEAD"),
)
"""The API's routes and the methods each takes, as its ``Allow`` header says them."""


def _method_not_allowed(allow: str) -> Callable[..., Response]:
    def view(**_kw: Any) -> Response:
        return APIError(
            405,
            "method_not_allowed",
            f"method {request.method} not allowed here (allowed: {allow})",
            headers={"Allow": allow},
        ).response()

    return view


def _unknown_path(rest: str) -> Response:
    return APIError(404, "not_found", "no such resource").response()


def _no_job_id() -> Response:
    return APIError(
        404,
        "not_found",
        "no job id in the path: a job's URL is the Location its POST returned",
    ).response()


def init_app(
    app: Flask,
    runner: Runner,
    identify: Identify,
    *,
    url_prefix: str = "/jobs",
    **options: Any,
) -> BatchAPI:
    """Mount the jobs API on ``app`` and keep its state in ``app.extensions["batch"]``.

    Args:
        app: the Flask app.
        runner: the process's runner, built once at app start (never per request).
        identify: ``identify(request) -> (caller, caller_class) | None``.
        url_prefix: where the routes live (default ``/jobs``).
        **options: ``name``, ``max_body``, ``retry_after``, ``www_authenticate``, as for
            :func:`blueprint`.

    Returns:
        The mounted API's state (also ``app.extensions["batch"]``).
    """
    if EXTENSION_KEY in app.extensions:
        raise RuntimeError("batch.flask.init_app was already called on this app")
    api = _build(runner, identify, url_prefix, **options)
    app.register_blueprint(api.blueprint)
    app.extensions[EXTENSION_KEY] = api
    return api
