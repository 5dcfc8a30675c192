"""The OpenAPI 3.1 document of the Flask jobs API, served at ``<prefix>/openapi.json``.

Kept true by ``tests/test_flask.py``, which validates every response it gets against it.
"""

from __future__ import annotations

import copy
from typing import Any

import dcache

from ._values import MAX_OPTION_LENGTH, MAX_URL_LENGTH

CONTENT_CSP = "sandbox; default-src 'none'"
"""The ``Content-Security-Policy`` of every ``/content`` answer: the fetched content is
shown as its type says, inert (no script, no form, no plugin, no load) and in an opaque
origin, whatever a page of it holds."""

__all__ = ["document"]

_REF = "#/components/schemas/"
_JOB_STATUSES = list(dcache.JOB_STATUSES)
_TARGET_STATUSES = list(dcache.TARGET_STATUSES)
_DELIVERY_STATUSES = list(dcache.DELIVERY_STATUSES)
_ERROR_TYPES = (
    "bad_request, invalid_parameter, invalid_idempotency_key, unauthorized, not_found, "
    "expired, no_result, method_not_allowed, job_finished, payload_too_large, "
    "unsupported_media_type, "
    "invalid_request, invalid_targets, too_many_targets, refused_target, idempotency_key_reused, "
    "caller_busy, busy, unavailable, internal"
)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(description: str, **headers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json_content(_ref("Error"))}
    if headers:
        out["headers"] = headers
    return out


_STR = {"type": "string"}
_TIME = {"type": ["string", "null"], "format": "date-time"}
_RETRY_AFTER = {
    "description": "Seconds to wait before retrying.",
    "schema": {"type": "integer", "minimum": 0},
    "required": True,
}

_SCHEMAS: dict[str, Any] = {
    "Options": {
        "type": "object",
        "description": "Per-target options, passed to the server's fetch untouched.",
        "properties": {
            **{
                name: {"type": "string", "maxLength": MAX_OPTION_LENGTH}
                for name in ("mode", "question", "pages", "grep", "jq")
            },
            "context": {"type": "boolean"},
            "recover": {"type": "boolean"},
        },
        "additionalProperties": False,
    },
    "Target": {
        "type": "object",
        "required": ["url"],
        "properties": {
            "url": {"type": "string", "minLength": 1, "maxLength": MAX_URL_LENGTH},
            "options": {"anyOf": [_ref("Options"), {"type": "null"}]},
        },
        "additionalProperties": False,
    },
    "SubmitRequest": {
        "type": "object",
        "required": ["targets"],
        "properties": {
            "targets": {
                "type": "array",
                "minItems": 1,
                "items": _ref("Target"),
                "description": "Distinct targets, at most the server's targets_per_job "
                "(32 by default).",
            },
            "notify": {
                "type": "object",
                "required": ["url"],
                "properties": {"url": {"type": "string", "minLength": 1, "maxLength": 2048}},
                "additionalProperties": False,
                "description": "Where to announce the job's end: a signed webhook "
                "(Standard Webhooks) POSTed there once the job ends, retried for about a "
                "day. Needs webhooks enabled on the server; loopback, private and "
                "link-local addresses are refused unless the server allows them.",
            },
        },
        "additionalProperties": False,
    },
    "Notification": {
        "type": "object",
        "required": ["id", "url", "status", "attempts", "next_attempt_at", "last_answer"],
        "properties": {
            "id": {"type": "string", "description": "The webhook-id of every attempt."},
            "url": {"type": "string"},
            "status": {"type": "string", "enum": _DELIVERY_STATUSES},
            "attempts": {"type": "integer", "minimum": 0},
            "next_attempt_at": {"type": ["string", "null"], "format": "date-time"},
            "last_answer": {"type": "string"},
        },
        "additionalProperties": False,
    },
    "Job": {
        "type": "object",
        "required": [
            "id",
            "status",
            "error",
            "targets_total",
            "targets_done",
            "targets_failed",
            "finished_at",
            "caller",
            "caller_class",
            "created_at",
            "updated_at",
            "expires_at",
        ],
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
            "status": {"type": "string", "enum": _JOB_STATUSES},
            "error": {
                "type": "string",
                "description": 'Why the job failed as a whole (e.g. "restart"); else empty.',
            },
            "targets_total": {"type": "integer", "minimum": 1},
            "targets_done": {
                "type": "integer",
                "minimum": 0,
                "description": "Targets stored, done or failed.",
            },
            "targets_failed": {"type": "integer", "minimum": 0},
            "finished_at": {
                **_TIME,
                "description": "When the job's drain stopped; null while it runs.",
            },
            "caller": _STR,
            "caller_class": _STR,
            "created_at": _TIME,
            "updated_at": _TIME,
            "expires_at": {
                **_TIME,
                "description": "When the job lapses (unless it is still live).",
            },
        },
        "additionalProperties": False,
    },
    "Result": {
        "type": "object",
        "required": ["content"],
        "properties": {"content": _STR, "meta": {"type": "object"}},
        "additionalProperties": False,
    },
    "TargetStatus": {
        "type": "object",
        "required": ["idx", "url", "options", "status", "result", "error", "hint"],
        "properties": {
            "idx": {"type": "integer", "minimum": 0},
            "url": _STR,
            "options": _ref("Options"),
            "status": {"type": "string", "enum": _TARGET_STATUSES},
            "result": {"oneOf": [_ref("Result"), {"type": "null"}]},
            "error": _STR,
            "hint": _STR,
            "bytes": {
                "type": "integer",
                "minimum": 0,
                "description": "With ?results=false only, for a target with a stored "
                "result: its size in bytes (the UTF-8 JSON of the result object).",
            },
        },
        "additionalProperties": False,
    },
    "SubmitResponse": {
        "type": "object",
        "required": ["job", "reused"],
        "properties": {
            "job": _ref("Job"),
            "reused": {
                "type": "boolean",
                "description": "True when an existing job (same caller, same targets, lease "
                "holding) was returned instead of a new one.",
            },
        },
        "additionalProperties": False,
    },
    "StatusResponse": {
        "type": "object",
        "required": ["job", "targets"],
        "properties": {
            "job": _ref("Job"),
            "notification": _ref("Notification"),
            "targets": {"type": "array", "items": _ref("TargetStatus")},
        },
        "additionalProperties": False,
    },
    "JobResponse": {
        "type": "object",
        "required": ["job"],
        "properties": {"job": _ref("Job")},
        "additionalProperties": False,
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {
                    "type": {"type": "string", "description": "One of: " + _ERROR_TYPES},
                    "message": _STR,
                    "field": {"type": "string"},
                    "index": {"type": "integer"},
                    "count": {"type": "integer"},
                    "limit": {"type": "integer"},
                    "live": {"type": "integer"},
                    "retry_after": {"type": "integer"},
                    "status": {
                        "type": "string",
                        "enum": list(dict.fromkeys(_JOB_STATUSES + _TARGET_STATUSES)),
                        "description": "The job's status (job_finished), or the target's"
                        " (no_result).",
                    },
                    "parameter": {"type": "string"},
                    "hint": {"type": "string"},
                    "expired_at": {**_TIME, "description": "When an expired job lapsed."},
                },
                "additionalProperties": False,
            },
            "expired_at": {
                **_TIME,
                "description": "410 only: when the job's lease lapsed (null if unknown).",
            },
        },
        "additionalProperties": False,
    },
}

_JOB_ID = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "The job's id, as returned by POST.",
}

_IDX = {
    "name": "idx",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 0},
    "description": "The target's index in the submitted list, from 0.",
}

_ETAG = {
    "description": "Changes exactly when the job or any of its targets changes; send it "
    "back in If-None-Match to poll for a change.",
    "schema": _STR,
    "required": True,
}

_GONE = _error(
    "The caller's own job has expired: its lease lapsed (its results are gone). "
    "Told apart from an unknown id for a while (tombstones are kept 7 days by default); "
    "the top-level expired_at says when."
)

_COMMON = {
    "default": _error("Any other error (e.g. one raised by the app's identify hook)."),
    "401": _error("identify() named no caller: authentication required."),
    "500": _error("An unexpected server error."),
    "503": _error(
        "The job store is unavailable or the service is shutting down; retry.",
        **{"Retry-After": _RETRY_AFTER},
    ),
}


def _paths(prefix: str) -> dict[str, Any]:
    return {
        prefix: {
            "post": {
                "operationId": "submitJob",
                "summary": "Submit a job (idempotent)",
                "description": (
                    "Starts a job draining the targets one at a time, in order. The same "
                    "caller submitting the same targets (by canonical form: key order, white "
                    "space and default options do not matter) while the earlier job's lease "
                    "holds gets that job back with `reused: true`, in any status; no caps are "
                    "checked then. With an `Idempotency-Key` header the key decides instead "
                    "(IETF httpapi draft): the same key and payload return the same job; the "
                    "same key with a different payload is refused with 422."
                ),
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                        "description": "A unique key for this request (IETF httpapi draft).",
                    }
                ],
                "requestBody": {"required": True, "content": _json_content(_ref("SubmitRequest"))},
                "responses": {
                    "202": {
                        "description": "The job, running (or reused, in any status).",
                        "headers": {
                            "Location": {
                                "description": "The job's URL.",
                                "schema": _STR,
                                "required": True,
                            }
                        },
                        "content": _json_content(_ref("SubmitResponse")),
                    },
                    "400": _error("The body is not valid JSON, or a bad Idempotency-Key."),
                    **_COMMON,
                    "413": _error("The body is too large."),
                    "415": _error("The body is not application/json."),
                    "422": _error(
                        "Not a {targets: [...]} object, invalid or too many targets, an "
                        "Idempotency-Key reused with a different payload, or "
                        "(refused_target, with index, field and hint) a target the server's "
                        "fetcher refuses outright: a URL scheme it does not fetch (file:, "
                        "by default) or a host written as an address it may not reach "
                        "(loopback, private, link-local...; host names are judged when "
                        "fetched, and fail that target instead)."
                    ),
                    "429": _error(
                        "The caller has too many live jobs (caller_busy) or the service "
                        "does (busy).",
                        **{"Retry-After": _RETRY_AFTER},
                    ),
                },
            }
        },
        prefix + "/{job_id}": {
            "parameters": [_JOB_ID],
            "get": {
                "operationId": "getJob",
                "summary": "A job and its targets; optionally long-poll until it finishes",
                "description": (
                    "One read of the store; stored results are written into the answer "
                    "as stored. The ETag changes exactly when the job or a target does: "
                    "with If-None-Match carrying the current tag the answer is 304 with no "
                    "body, from one read of the job row. With wait too, the request waits "
                    "(up to wait seconds) for the tag to change; with wait alone, for the "
                    "job to finish. With results=false every result is null and each "
                    "stored result's size is given as bytes: fetch a result with "
                    "/targets/{idx} or its content with /targets/{idx}/content."
                ),
                "parameters": [
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "number", "minimum": 0, "maximum": 30},
                        "description": "Wait up to this many seconds for the job to finish "
                        "(or, with If-None-Match, for it to change).",
                    },
                    {
                        "name": "results",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "boolean", "default": True},
                        "description": "false: leave every result out (null), give its "
                        "size in bytes instead.",
                    },
                    {
                        "name": "If-None-Match",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "An ETag of an earlier answer: 304 while it is "
                        "still current.",
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The job and every target, in index order.",
                        "headers": {"ETag": _ETAG},
                        "content": _json_content(_ref("StatusResponse")),
                    },
                    "304": {
                        "description": "Not modified: the If-None-Match tag is current (no body).",
                        "headers": {"ETag": _ETAG},
                    },
                    "400": _error("wait is not a number from 0 to 30, or results not a boolean."),
                    **_COMMON,
                    "404": _error("Unknown, lapsed, or another caller's job."),
                    "410": _GONE,
                },
            },
            "delete": {
                "operationId": "cancelJob",
                "summary": "Cancel a live job",
                "description": (
                    "The job becomes cancelled at once; its drain stores the target in "
                    "flight and stops before the next. Stored targets stay readable."
                ),
                "responses": {
                    "200": {
                        "description": "The cancelled job.",
                        "content": _json_content(_ref("JobResponse")),
                    },
                    **_COMMON,
                    "404": _error("Unknown, lapsed, or another caller's job."),
                    "409": _error("The job has already finished (done, failed, ...)."),
                    "410": _GONE,
                },
            },
        },
        prefix + "/{job_id}/targets/{idx}": {
            "parameters": [_JOB_ID, _IDX],
            "get": {
                "operationId": "getTarget",
                "summary": "One target with its result",
                "responses": {
                    "200": {
                        "description": "The target, its result as stored (null until "
                        "stored, and for a failed target).",
                        "content": _json_content(_ref("TargetStatus")),
                    },
                    **_COMMON,
                    "404": _error("Unknown, lapsed or another caller's job, or no such target."),
                    "410": _GONE,
                },
            },
        },
        prefix + "/{job_id}/targets/{idx}/content": {
            "parameters": [_JOB_ID, _IDX],
            "get": {
                "operationId": "getTargetContent",
                "summary": "One target's fetched content, raw",
                "description": (
                    "The result's content as the body, with the content type fetch "
                    "reported in meta.content_type (text is sent as UTF-8 and its charset "
                    "says so; text/plain; charset=utf-8 when it reported none); content "
                    "fetch stored as base64 (meta.encoding) is decoded. One result at a "
                    "time: a client pulls large results with bounded memory on both sides. "
                    "Sandboxed: a fetched page opened here runs no script and has an "
                    "origin of its own."
                ),
                "responses": {
                    "200": {
                        "description": "The content.",
                        "headers": {
                            "Content-Security-Policy": {
                                "description": "Always sandbox; default-src 'none'.",
                                "schema": {"type": "string", "const": CONTENT_CSP},
                            }
                        },
                        "content": {"*/*": {"schema": {}}},
                    },
                    **_COMMON,
                    "404": _error(
                        "Unknown, lapsed or another caller's job, no such target, "
                        "or (no_result, with status) no result stored for it."
                    ),
                    "410": _GONE,
                },
            },
        },
        prefix + "/openapi.json": {
            "get": {
                "operationId": "getOpenAPI",
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "The OpenAPI 3.1 document of this API.",
                        "content": _json_content({"type": "object"}),
                    },
                },
            }
        },
    }


def document(prefix: str = "/jobs", server: str = "/") -> dict[str, Any]:
    """The OpenAPI 3.1 document for the API mounted at ``prefix`` behind ``server``."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batch jobs API",
            "version": "1",
            "description": (
                "Persistent, serial batch jobs. Submit up to 32 targets (a URL and options); "
                "one worker drains them in order and stores each outcome as it completes; "
                "poll, long-poll or cancel until the job's lease lapses. The app decides who "
                "the caller is (its identify hook); a caller only ever sees its own jobs. "
                "Every error is {error: {type, message, ...}}. Responses carry "
                "Cache-Control: no-store."
            ),
        },
        "servers": [{"url": server}],
        "paths": _paths(prefix),
        "components": {"schemas": copy.deepcopy(_SCHEMAS)},
    }
