"""The operators' dashboard: a Flask blueprint of server-rendered pages over the store.

Pages: the job list (newest first, filtered by status and caller, paginated, with the
counts per status, live jobs against ``jobs_total`` and the callers at their cap) and a
job's page (every target, a result's first kilobytes on demand, a Cancel button). A small
script of the blueprint's own polls a JSON endpoint with ``If-None-Match`` so a job's page
follows its drain without reloading; without JavaScript a reload shows the same.

Everything stored (results, errors, hints, URLs, callers) is untrusted text: the templates
autoescape it (their own Jinja environment, whatever the app configures), no URL is ever
made a link, and every page is sent with a strict ``Content-Security-Policy``: no inline
script or style exists to allow, and every asset is served by the blueprint.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import math
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import jinja2
from flask import (
    Blueprint,
    Request,
    Response,
    abort,
    current_app,
    redirect,
    request,
    send_from_directory,
    url_for,
)
from werkzeug.exceptions import HTTPException, MethodNotAllowed

import dcache
from dcache import LIVE, TERMINAL, Delivery, JobRow, Status
from dcache._admin import TargetSummary
from dcache._rows import in_flight

from ._routing import ANY, PLAIN, answer_other_methods
from ._runner import Runner

__all__ = ["CSP", "PREVIEW_BYTES", "Authorize", "dashboard"]

Authorize = Callable[[Request], bool]
"""``authorize(request) -> bool``: whether the request may see and steer every job."""

CSP = (
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
    "object-src 'none'"
)
"""The Content-Security-Policy sent with every response of the dashboard."""

PREVIEW_BYTES = 4096
"""How much of a result's content the preview shows by default, in bytes."""
MAX_PREVIEW_BYTES = 65536

STATUSES = dcache.JOB_STATUSES
_CSRF_COOKIE = "batch_dashboard_csrf"
_MAX_ID = 64
_HERE = Path(__file__).parent
_STATIC = _HERE / "static" / "dashboard"
_CANCEL_MESSAGES = {
    "ok": "Cancelled: the target in flight is stored, then the job stops.",
    "finished": "Not cancelled: the job had already finished.",
    "resent": "Notification queued again: it is sent now, with the same webhook id.",
    Delivery.PENDING.value: (
        "Not resent: the notification is still pending (it will be sent anyway)."
    ),
    "none": (
        "Not resent: this job has no notification (none was asked for, or the job has "
        "not ended yet)."
    ),
}
_MAX_NUMBER = 10**9
"""Where a number in the query saturates: past every page, preview size and target index."""
_ROUTES = (
    ("/", "jobs", "GET, HEAD"),
    ("/static/<path:filename>", "static", "GET, HEAD"),
    ("/jobs/<job_id>", "job", "GET, HEAD"),
    ("/jobs/<job_id>/progress.json", "progress", "GET, HEAD"),
    ("/jobs/<job_id>/targets/<int:idx>/result", "result", "GET, HEAD"),
    ("/jobs/<job_id>/cancel", "cancel", "POST"),
    ("/jobs/<job_id>/redeliver", "redeliver", "POST"),
)
"""The blueprint's routes and the methods each takes, as its ``Allow`` header says them."""


def _plausible(job_id: str) -> bool:
    return 0 < len(job_id) <= _MAX_ID and job_id.isascii() and job_id.isprintable()


def _number(name: str) -> int | None:
    """The query parameter ``name`` as a whole number, or ``None`` when absent or unusable.

    ASCII digits only: ``str.isdigit`` also takes ``²`` or ``①``, which ``int`` refuses,
    and ``int`` alone takes signs, spaces and underscores. Bounded: a number past
    :data:`_MAX_NUMBER` counts as that (``int`` of 4301 digits raises, and nothing here
    counts that far), so every caller's own clamp still applies.
    """
    raw = request.args.get(name, "")
    if not (raw.isascii() and raw.isdigit()):
        return None
    digits = raw.lstrip("0") or "0"
    if len(digits) > len(str(_MAX_NUMBER)):
        return _MAX_NUMBER
    return min(int(digits), _MAX_NUMBER)


def _size(n: int | None) -> str:
    """A byte count for people: ``812 B``, ``4.0 KiB``, ``1.3 MiB``."""
    if n is None:
        return ""
    if n < 1024:
        return f"{n} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(job: JobRow) -> str:
    end = job.finished_at or dcache.utcnow()
    seconds = max(0.0, (end - job.created_at).total_seconds())
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_HERE / "templates" / "dashboard")),
        autoescape=True,  # every template, whatever its name: stored text is untrusted
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["size"] = _size
    env.filters["when"] = _when
    env.globals["url_for"] = url_for
    return env


def _etag(job: JobRow) -> str:
    # Every target write and status change updates the job row, so the row alone tells
    # whether anything on the page changed: a conditional poll is one primary-key read.
    raw = "|".join(
        str(v)
        for v in (
            job.id,
            job.status,
            job.targets_done,
            job.targets_failed,
            job.updated_at.isoformat(),
            job.finished_at.isoformat() if job.finished_at else "",
            job.error,
        )
    )
    return '"' + hashlib.sha256(raw.encode("utf-8", "backslashreplace")).hexdigest()[:32] + '"'


def _in_flight(job: JobRow, rows: list[TargetSummary]) -> int:
    """The index of the target being fetched (see :func:`dcache._rows.in_flight`), or -1."""
    return next(
        (t.idx for t in rows if in_flight(job.status, job.targets_done, t.idx, t.status)), -1
    )


def _progress(job: JobRow, rows: list[TargetSummary]) -> dict[str, Any]:
    flight = _in_flight(job, rows)
    return {
        "job": {
            "id": job.id,
            "status": job.status,
            "live": job.status in LIVE,
            "finished": job.finished_at is not None,
            "error": job.error,
            "targets_total": job.targets_total,
            "targets_done": job.targets_done,
            "targets_failed": job.targets_failed,
            "stored": job.targets_done,
            "finished_at": _when(job.finished_at),
            "duration": _duration(job),
        },
        "targets": [
            {
                "idx": t.idx,
                "status": Status.RUNNING.value if t.idx == flight else t.status,
                "in_flight": t.idx == flight,
                "error": t.error,
                "hint": t.hint,
                "result_bytes": t.result_bytes,
                "size": _size(t.result_bytes),
            }
            for t in rows
        ],
    }


class _Dashboard:
    """The state behind one mounted dashboard (its views are bound methods)."""

    def __init__(self, runner: Runner, authorize: Authorize, page_size: int) -> None:
        self.runner = runner
        self.authorize = authorize
        self.page_size = page_size
        self.env = _environment()

    # -- plumbing -----------------------------------------------------------------------

    def render(self, template: str, http_status: int = 200, **context: Any) -> Response:
        token = request.cookies.get(_CSRF_COOKIE, "")
        fresh = len(token) < 32
        if fresh:
            token = secrets.token_urlsafe(32)
        html = self.env.get_template(template).render(csrf_token=token, **context)
        resp = Response(html, status=http_status, mimetype="text/html")
        if fresh:
            resp.set_cookie(
                _CSRF_COOKIE,
                token,
                path=self.cookie_path(),
                secure=request.is_secure,
                httponly=True,
                samesite="Strict",
            )
        return resp

    def cookie_path(self) -> str:
        return url_for(".jobs").rstrip("/") or "/"

    def check(self) -> Response | None:
        """The blueprint's gate: 403 unless ``authorize(request)`` says yes.

        The package's own script and styles pass (they hold nothing of anybody's), so
        even the 403 page renders as designed.
        """
        if (request.endpoint or "").endswith(".static") or self.authorize(request) is True:
            return None
        return self.render("error.html", 403, title="Forbidden", message="Not authorized.")

    def error(self, exc: HTTPException) -> Response:
        status = exc.code or 500
        if request.path.endswith(".json"):
            resp = _json({"error": exc.name}, status)
        else:
            resp = self.render("error.html", status, title=exc.name, message=exc.description)
        # The exception's own headers stay: WWW-Authenticate on a 401 authorize raised
        # (HTTP Basic auth), Allow on a 405. The body is ours, so its type and length are.
        if exc.response is None:
            for name, value in exc.get_headers():
                if name.lower() not in ("content-type", "content-length"):
                    resp.headers[name] = value
        return resp

    def store_error(self, exc: dcache.StoreError) -> Response:
        message = "The database is unavailable; try again in a moment."
        if request.path.endswith(".json"):
            return _json({"error": message}, 503)
        return self.render("error.html", 503, title="Unavailable", message=message)

    # -- views --------------------------------------------------------------------------

    def jobs(self) -> Response:
        db = self.runner.db
        config = self.runner.config
        status = request.args.get("status", "")
        if status not in STATUSES:
            status = ""
        caller = request.args.get("caller", "")  # verbatim: callers are stored as given
        page = min(max(_number("page") or 1, 1), 1_000_000)
        per_caller = db.live_by_caller()
        counts = db.status_counts(caller=caller or None)
        rows = db.jobs_page(
            status=status or None,
            caller=caller or None,
            offset=(page - 1) * self.page_size,
            limit=self.page_size + 1,
        )
        more = len(rows) > self.page_size
        total = counts.get(status, 0) if status else sum(counts.values())

        def link(**changes: Any) -> str:
            args = {"status": status, "caller": caller, "page": page, **changes}
            query = {k: v for k, v in args.items() if v not in ("", None, 1)}
            return url_for(".jobs") + ("?" + urlencode(query) if query else "")

        at_cap = sorted(
            (c for c, n in per_caller.items() if n >= config.jobs_per_caller),
            key=lambda c: (-per_caller[c], c),
        )
        return self.render(
            "jobs.html",
            title="Jobs",
            jobs=rows[: self.page_size],
            counts=[(s, counts.get(s, 0)) for s in STATUSES],
            counts_total=sum(counts.values()),
            status=status,
            caller=caller,
            page=page,
            pages=max(1, math.ceil(total / self.page_size)),
            newer=link(page=page - 1) if page > 1 else None,
            older=link(page=page + 1) if more else None,
            status_link=lambda s: link(status=s, page=1),
            caller_link=lambda c: link(caller=c, status="", page=1),
            live=sum(per_caller.values()),
            jobs_total=config.jobs_total,
            jobs_per_caller=config.jobs_per_caller,
            at_cap=[(c, per_caller[c]) for c in at_cap[:50]],
            at_cap_more=max(0, len(at_cap) - 50),
            terminal=TERMINAL,
            live_statuses=LIVE,
        )

    def _summary(self, job_id: str) -> tuple[JobRow, list[TargetSummary]]:
        found = self.runner.db.job_summary(job_id) if _plausible(job_id) else None
        if found is None:
            abort(404, description="No such job (or its lease has lapsed).")
        return found

    def job(self, job_id: str) -> Response:
        job, rows = self._summary(job_id)
        show = _number("show")
        preview: tuple[int, str, int] | None = None
        if show is not None and show < job.targets_total:
            preview = self._preview(job_id, show, PREVIEW_BYTES)
        return self.render(
            "job.html",
            title=f"Job {job.id}",
            job=job,
            targets=rows,
            in_flight=_in_flight(job, rows),
            live=job.status in LIVE,
            duration=_duration(job),
            message=_CANCEL_MESSAGES.get(request.args.get("cancel", "")),
            notification=self.runner.notification(job.id),
            preview=preview,
            preview_bytes=PREVIEW_BYTES,
        )

    def progress(self, job_id: str) -> Response:
        db = self.runner.db
        if not _plausible(job_id):
            abort(404)
        current = db.get_job(job_id)
        if current is None:
            abort(404)
        if _etag(current) in _if_none_match():
            resp = Response(status=304)
            resp.headers["ETag"] = _etag(current)
            return resp
        job, rows = self._summary(job_id)
        resp = _json(_progress(job, rows))
        resp.headers["ETag"] = _etag(job)
        return resp

    def _preview(self, job_id: str, idx: int, limit: int) -> tuple[int, str, int] | None:
        """``(idx, first bytes of the content as text, content size)``, or ``None``."""
        stored = self.runner.db.target_result(job_id, idx)
        if stored is None:
            return None
        try:
            content = json.loads(stored).get("content", "")
        except (ValueError, AttributeError, RecursionError):
            return None
        if not isinstance(content, str):
            return None
        data = content.encode("utf-8", "backslashreplace")
        return idx, data[:limit].decode("utf-8", "ignore"), len(data)

    def result(self, job_id: str, idx: int) -> Response:
        self._summary(job_id)  # 404 for an unknown job
        limit = _number("bytes")
        limit = min(max(PREVIEW_BYTES if limit is None else limit, 1), MAX_PREVIEW_BYTES)
        found = self._preview(job_id, idx, limit)
        if found is None:
            abort(404, description="This target has no stored result.")
        _, text, size = found
        resp = Response(text, mimetype="text/plain")
        resp.headers["X-Result-Bytes"] = str(size)
        resp.headers["Content-Disposition"] = "inline"
        return resp

    def cancel(self, job_id: str) -> Response:
        if not self._csrf_ok():
            return self.render(
                "error.html",
                400,
                title="Not cancelled",
                message="The form could not be verified (it may be stale or come from "
                "another site). Reload the job's page and try again.",
            )
        if not _plausible(job_id):
            abort(404)
        if self.runner.cancel(job_id):
            outcome = "ok"
        else:
            self._summary(job_id)  # 404 for an unknown job
            outcome = "finished"
        target = url_for(".job", job_id=job_id, cancel=outcome)
        return redirect(target, code=303)  # type: ignore[return-value]

    def redeliver(self, job_id: str) -> Response:
        """Send a job's delivered or failed notification again (the form's POST)."""
        if not self._csrf_ok():
            return self.render(
                "error.html",
                400,
                title="Not resent",
                message="The form could not be verified (it may be stale or come from "
                "another site). Reload the job's page and try again.",
            )
        self._summary(job_id)  # 404 for an unknown job
        if self.runner.redeliver(job_id):
            outcome = "resent"
        elif self.runner.notification(job_id) is None:
            outcome = "none"
        else:
            outcome = Delivery.PENDING.value
        return redirect(url_for(".job", job_id=job_id, cancel=outcome), code=303)  # type: ignore[return-value]

    def _csrf_ok(self) -> bool:
        origin = request.headers.get("Origin")
        if origin is not None and origin != "null":
            own = urlsplit(request.host_url)
            theirs = urlsplit(origin)
            if (theirs.scheme, theirs.netloc) != (own.scheme, own.netloc):
                return False
        elif origin == "null":
            return False
        cookie = request.cookies.get(_CSRF_COOKIE, "")
        sent = request.form.get("csrf", "")
        return len(cookie) >= 32 and hmac.compare_digest(cookie.encode(), sent.encode())


def _if_none_match() -> set[str]:
    raw = request.headers.get("If-None-Match", "")
    return {tag.strip().removeprefix("W/") for tag in raw.split(",") if tag.strip()}


def _json(obj: object, status: int = 200) -> Response:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return Response(text, status=status, mimetype="application/json")


def _unknown(rest: str) -> Response:
    abort(404, description="No such page.")


def _static(filename: str) -> Response:
    # The blueprint's own static route (not Blueprint(static_folder=...)), so that it too
    # answers OPTIONS and other methods as the routes below do.
    max_age = current_app.get_send_file_max_age(filename)
    return send_from_directory(_STATIC, filename, max_age=max_age)


def _method_not_allowed(allow: str) -> Callable[..., Response]:
    def view(**_kw: Any) -> Response:
        raise MethodNotAllowed(valid_methods=allow.split(", "))  # its Allow header stays

    return view


def _headers(resp: Response) -> Response:
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"
    resp.headers["X-Frame-Options"] = "DENY"
    resp.headers.setdefault("Cache-Control", "no-store")
    return resp


def dashboard(
    runner: Runner,
    authorize: Authorize,
    url_prefix: str = "/batch",
    *,
    name: str = "batch_dashboard",
    page_size: int = 25,
) -> Blueprint:
    """The operators' dashboard as a blueprint: register it on the app.

    Args:
        runner: the process's runner (its store is read; cancels go through it).
        authorize: ``authorize(request) -> bool``; only a True answer gets in (operators
            see and may cancel every caller's jobs), anything else (False, None, a
            truthy string) is 403. It may also raise an ``HTTPException``, answered as
            the dashboard's page with the exception's headers (e.g. a 401 with
            ``WWW-Authenticate`` for HTTP Basic auth), or abort with a response of its
            own (e.g. a redirect to a login page).
        url_prefix: where the pages live.
        name: the blueprint's name.
        page_size: jobs per page of the list.

    Returns:
        The blueprint (``app.register_blueprint(dashboard(runner, is_operator))``).
    """
    if not callable(authorize):
        raise TypeError("authorize must be a callable: authorize(request) -> bool")
    if page_size < 1:
        raise ValueError(f"page_size must be positive, not {page_size}")
    state = _Dashboard(runner, authorize, page_size)
    bp = Blueprint(name, __name__, url_prefix=url_prefix)
    bp.before_request(state.check)
    bp.after_request(_headers)
    bp.add_url_rule("/", "jobs", state.jobs, methods=["GET"], **PLAIN)
    bp.add_url_rule("/static/<path:filename>", "static", _static, methods=["GET"], **PLAIN)
    bp.add_url_rule("/jobs/<job_id>", "job", state.job, methods=["GET"], **PLAIN)
    bp.add_url_rule(
        "/jobs/<job_id>/progress.json", "progress", state.progress, methods=["GET"], **PLAIN
    )
    bp.add_url_rule(
        "/jobs/<job_id>/targets/<int:idx>/result",
        "result",
        state.result,
        methods=["GET"],
        **PLAIN,
    )
    bp.add_url_rule("/jobs/<job_id>/cancel", "cancel", state.cancel, methods=["POST"], **PLAIN)
    bp.add_url_rule(
        "/jobs/<job_id>/redeliver", "redeliver", state.redeliver, methods=["POST"], **PLAIN
    )
    # Routing errors (a wrong method, an unknown path) never reach a blueprint's error
    # handlers or its before_request, so the blueprint answers them itself: through the
    # gate, as its own pages, with its headers. And OPTIONS too, since Flask's would list
    # these 405 rules' methods as allowed.
    answer_other_methods(bp, _ROUTES, _method_not_allowed)
    bp.add_url_rule("/<path:rest>", "unknown", _unknown, methods=ANY, **PLAIN)
    bp.register_error_handler(HTTPException, state.error)
    bp.register_error_handler(dcache.StoreError, state.store_error)
    return bp
