"""Ready-made fetchers: the real default one behind ``batch run``.

:class:`Fetcher` GETs ``http://`` and ``https://`` URLs with the standard library's
:mod:`urllib` (timeouts, a size cap, a bounded number of redirects) and reads ``file://``
URLs; every other scheme is refused. :data:`fetch` is one with the defaults.

It is made for scripts and the command line. A web app that lets strangers name the URLs
must not hand them a fetcher that reads local files or reaches private addresses (SSRF):
build ``Fetcher(schemes=("https",))`` at least, and guard the addresses yourself.
"""

from __future__ import annotations

import base64
import codecs
import mimetypes
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from email.message import Message
from http.client import HTTPMessage
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

from ._errors import FetchError
from ._values import Result, Target

__all__ = ["DEFAULT_MAX_BYTES", "Fetcher", "fetch"]

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024
_TEXT_TYPES = (
    "application/json",
    "application/xml",
    "application/javascript",
    "application/ecmascript",
    "application/x-www-form-urlencoded",
    "application/x-ndjson",
    "application/yaml",
    "application/toml",
    "application/sql",
    "image/svg+xml",
)
_SUPPORTED_OPTIONS = frozenset({"grep"})
_HTTP = ("http", "https")


class _LimitedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow at most ``limit`` redirects, and only to the given schemes (http, https)."""

    # urllib's own loop guards, set past any limit of ours: we count by ourselves.
    max_redirections = 1000
    max_repeats = 1000

    def __init__(self, limit: int, schemes: tuple[str, ...]) -> None:
        self._limit = limit
        self._schemes = schemes

    def redirect_request(  # noqa: PLR0917 (urllib's signature)
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        scheme = urlsplit(newurl).scheme.lower()
        if scheme not in self._schemes:
            # urllib would follow a redirect to ftp://; we follow none outside the list.
            raise FetchError(
                f"redirect to a refused URL scheme {scheme!r} ({newurl[:200]})",
                hint="only http and https redirects are followed",
            )
        followed = sum(getattr(req, "redirect_dict", {}).values())
        if followed >= self._limit:
            raise FetchError(
                f"too many redirects: more than {self._limit} (the last to {newurl[:200]})",
                hint="fetch the final URL directly",
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class Fetcher:
    """A ``fetch(target) -> Result`` for ``http``, ``https`` and ``file`` URLs.

    Args:
        timeout: seconds for connecting and for each read; also the budget for the
            whole download (a server that drips bytes cannot hold a target forever).
        max_bytes: the largest body accepted; a larger one fails the target.
        max_redirects: how many redirects to follow (0: none).
        schemes: the URL schemes accepted, a subset of ``http``, ``https``, ``file``.
        user_agent: the ``User-Agent`` header sent.

    The result's ``content`` is the body decoded as text (its declared charset, else
    UTF-8, undecodable bytes replaced); a body that is not text (an image, a PDF) is
    base64, with ``meta["encoding"] = "base64"``. ``meta`` holds ``status`` (HTTP),
    ``content_type``, ``url`` (after redirects) and ``bytes``. The ``grep`` option keeps
    the lines that contain its text; any other option fails the target, since this
    fetcher cannot honour it.

    HTTP errors (4xx, 5xx), timeouts, unreachable hosts, too many redirects, bodies over
    ``max_bytes`` and refused schemes fail the target with a :class:`FetchError` and a hint.
    """

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_redirects: int = 5,
        schemes: Iterable[str] = ("http", "https", "file"),
        user_agent: str = "batch-dcache/0.1 (+https://pypi.org/project/batch-dcache/)",
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes!r}")
        if not 0 <= max_redirects <= 100:
            raise ValueError(f"max_redirects must be from 0 to 100, got {max_redirects!r}")
        accepted = tuple(s.lower() for s in schemes)
        unknown = sorted(set(accepted) - {"http", "https", "file"})
        if unknown or not accepted:
            raise ValueError(f"schemes must be among http, https and file, not {unknown}")
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        self.schemes = accepted
        self.user_agent = user_agent
        redirect_to = tuple(s for s in accepted if s in _HTTP)
        self._opener = urllib.request.build_opener(_LimitedRedirects(max_redirects, redirect_to))

    def __repr__(self) -> str:
        return (
            f"Fetcher(timeout={self.timeout!r}, max_bytes={self.max_bytes!r}, "
            f"max_redirects={self.max_redirects!r}, schemes={self.schemes!r})"
        )

    def __call__(self, target: Target) -> Result:
        """Fetch one target; raise :class:`FetchError` to fail it."""
        scheme = urlsplit(target.url).scheme.lower()
        if scheme not in self.schemes:
            raise FetchError(
                f"URL scheme {scheme!r} refused" if scheme else "URL has no scheme",
                hint=f"use a URL whose scheme is {' or '.join(self.schemes)}",
            )
        extra = sorted(set(target.options.to_json()) - _SUPPORTED_OPTIONS)
        if extra:
            raise FetchError(
                f"option(s) {', '.join(extra)} not supported by the default fetcher",
                hint="pass --fetch module:callable with a fetcher that supports them",
            )
        if scheme == "file":
            body, meta = self._read_file(target.url)
        else:
            body, meta = self._get(target.url)
        content = _decode(body, meta)
        if target.options.grep:
            needle = target.options.grep
            content = "\n".join(line for line in content.splitlines() if needle in line)
        return Result(content, meta)

    # -- file:// ------------------------------------------------------------------------

    def _read_file(self, url: str) -> tuple[bytes, dict[str, Any]]:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise FetchError(
                f"file URL names a remote host {parts.netloc!r}", hint="use file:///path"
            )
        # "file:name" (no slashes) is relative to the working directory: handy offline.
        path = Path(unquote(parts.path))
        try:
            size = path.stat().st_size
            if path.is_dir():
                raise FetchError(f"{path} is a directory", hint="name a file")
            if size > self.max_bytes:
                raise FetchError(
                    f"file is {size} bytes, at most {self.max_bytes} allowed",
                    hint="raise Fetcher(max_bytes=...) or split the file",
                )
            with path.open("rb") as fh:
                body = fh.read(self.max_bytes + 1)
        except FileNotFoundError:
            raise FetchError(f"no such file: {path}", hint="check the path") from None
        except OSError as exc:
            raise FetchError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(body) > self.max_bytes:
            raise FetchError(f"file is over {self.max_bytes} bytes")
        ctype = mimetypes.guess_type(path.name)[0] or ""
        if not ctype or ctype == "application/octet-stream":
            # An unknown suffix (.toml, .log, none): text if it is valid UTF-8.
            try:
                body.decode("utf-8")
                ctype = "text/plain"
            except UnicodeDecodeError:
                ctype = "application/octet-stream"
        if _is_text(ctype) and "charset" not in ctype:
            ctype += "; charset=utf-8"
        return body, {"content_type": ctype, "path": str(path), "bytes": len(body)}

    # -- http(s):// ---------------------------------------------------------------------

    def _get(self, url: str) -> tuple[bytes, dict[str, Any]]:
        req = urllib.request.Request(  # noqa: S310 (the scheme was checked: http or https)
            url, headers={"User-Agent": self.user_agent, "Accept-Encoding": "identity"}
        )
        deadline = time.monotonic() + self.timeout
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                status = int(resp.status)
                ctype = resp.headers.get("Content-Type", "")
                final = resp.geturl()
                length = resp.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise FetchError(
                        f"response is {length} bytes, at most {self.max_bytes} allowed",
                        hint="raise Fetcher(max_bytes=...)",
                    )
                body = self._read_capped(resp, deadline)
        except urllib.error.HTTPError as exc:
            exc.close()
            if 300 <= exc.code < 400:
                raise FetchError(
                    f"HTTP {exc.code} {exc.reason}: a redirect without a usable Location",
                    hint="fetch the final URL directly",
                ) from None
            raise FetchError(
                f"HTTP {exc.code} {exc.reason}",
                hint=_status_hint(exc.code),
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise FetchError(
                    f"timed out after {self.timeout:g} s", hint="retry later"
                ) from None
            raise FetchError(f"cannot reach {_host(url)}: {reason}", hint="check the URL") from None
        except TimeoutError:
            raise FetchError(f"timed out after {self.timeout:g} s", hint="retry later") from None
        except (OSError, ValueError) as exc:  # reset connections, bad URLs, bad responses
            raise FetchError(f"{type(exc).__name__}: {exc}", hint="check the URL") from None
        return body, {"status": status, "content_type": ctype, "url": final, "bytes": len(body)}

    def _read_capped(self, resp: Any, deadline: float) -> bytes:
        chunks: list[bytes] = []
        size = 0
        read = getattr(resp, "read1", resp.read)  # read1: what has arrived, without waiting
        while True:
            chunk = read(_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise FetchError(
                    f"response is over {self.max_bytes} bytes",
                    hint="raise Fetcher(max_bytes=...)",
                )
            if time.monotonic() > deadline:
                raise FetchError(f"download took over {self.timeout:g} s", hint="retry later")
            chunks.append(chunk)


def _host(url: str) -> str:
    return urlsplit(url).netloc or url[:200]


def _status_hint(code: int) -> str:
    if code in (401, 403):
        return "the server wants credentials this fetcher does not send"
    if code == 404:
        return "check the URL"
    if code == 429 or code >= 500:
        return "the server is busy or failing; retry later"
    return ""


def _is_text(ctype: str) -> bool:
    main = ctype.split(";", 1)[0].strip().lower()
    return (
        not main
        or main.startswith("text/")
        or main in _TEXT_TYPES
        or main.endswith(("+json", "+xml"))
    )


def _decode(body: bytes, meta: dict[str, Any]) -> str:
    """The body as text in its declared charset; base64 when it is not text."""
    ctype = str(meta.get("content_type", ""))
    if not _is_text(ctype):
        meta["encoding"] = "base64"
        return base64.b64encode(body).decode("ascii")
    msg = Message()
    msg["Content-Type"] = ctype or "text/plain"
    charset = msg.get_content_charset() or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        charset = "utf-8"
    return body.decode(charset, errors="replace")


fetch: Fetcher = Fetcher()
"""The default fetcher: http, https and file; 30 s timeout, 4 MiB, 5 redirects."""
