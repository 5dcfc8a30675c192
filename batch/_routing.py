"""How the library's blueprints (the JSON API, the dashboard) answer every method.

Routing errors (a method a path does not take, an unknown path) never reach a blueprint's
error handlers nor its ``before_request``: werkzeug answers them for the whole app, as an
HTML page whose ``Allow`` lists every method of every rule on the path. So each blueprint
answers them itself, in its own shape and through its own checks: a rule per route for
the methods it does not take (a 405 with the route's own ``Allow``), and one for
``OPTIONS`` (Flask's automatic one would list those 405 rules' methods as allowed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flask import Blueprint, Response

OTHER_METHODS = (
    *("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "TRACE", "QUERY"),
    *("PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "SEARCH"),
)
"""The methods (HTTP's, then WebDAV's) a blueprint answers itself on a route that does not
take them; only a method outside this list gets werkzeug's own 405."""

ANY = [*OTHER_METHODS, "OPTIONS"]
"""Every method a catch-all rule (an unknown path) answers."""

PLAIN = {"provide_automatic_options": False}
"""Keyword arguments of every rule: OPTIONS is answered by :func:`answer_other_methods`."""


def answer_other_methods(
    bp: Blueprint,
    routes: Iterable[tuple[str, str, str]],
    not_allowed: Callable[[str], Callable[..., Any]],
) -> None:
    """For each ``(rule, endpoint, allow)``: ``OPTIONS`` answers 204 with ``allow`` and
    ``OPTIONS``, and ``not_allowed`` answers the methods the route does not take, with
    the same list (the route takes ``OPTIONS`` too)."""
    for rule, endpoint, allow in routes:
        others = [m for m in OTHER_METHODS if m not in allow.split(", ")]
        allowed = f"{allow}, OPTIONS"
        bp.add_url_rule(rule, f"{endpoint}_405", not_allowed(allowed), methods=others, **PLAIN)
        bp.add_url_rule(
            rule, f"{endpoint}_options", _options(allowed), methods=["OPTIONS"], **PLAIN
        )


def _options(allowed: str) -> Callable[..., Response]:
    def view(**_kw: Any) -> Response:
        return Response(status=204, headers={"Allow": allowed})

    return view
