"""Ready-made fetchers: the real default one behind ``batch run``, safe to hand to strangers.

:class:`Fetcher` GETs ``http://`` and ``https://`` URLs (the standard library's
:mod:`http.client`, driven here: one overall deadline, a byte cap on every response, a
bounded number of redirects) and, when asked, reads ``file:`` URLs. :data:`fetch` is one
with the defaults.

By default it reaches public addresses only. Every connection it opens, at every redirect
hop, is judged on the address it is about to connect to, after name resolution, never
on the URL's text: loopback, private networks (RFC 1918, unique-local fc00::/7), CGNAT
100.64/10, link-local (169.254/16 with the cloud metadata address, fe80::/10),
multicast, unspecified, reserved and documentation ranges, and the IPv4-mapped, 6to4 and
NAT64 forms of any of them are refused before a byte is sent (:class:`BlockedAddressError`).
``Fetcher(allow=...)`` names the exceptions an app needs (an internal service). The
:class:`Guard` that does this is public so every outbound request of an app (webhooks
too) can go through the same policy.
"""

from __future__ import annotations

import base64
import codecs
import functools
import http.client
import io
import ipaddress
import mimetypes
import os
import re
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import SplitResult, quote, unquote, urljoin, urlsplit

from ._errors import FetchError
from ._values import Result, Target

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Address",
    "Allow",
    "BlockedAddressError",
    "Fetcher",
    "Guard",
    "address_refusal",
    "fetch",
    "parse_ip_literal",
]

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
"""The default cap on a response body, in bytes (4 MiB); ``Fetcher(max_bytes=...)``."""
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
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

Address: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
"""An IP address, as :mod:`ipaddress` parses it."""

Allow: TypeAlias = (
    Iterable[str | ipaddress.IPv4Network | ipaddress.IPv6Network] | Callable[[str, Address], bool]
)
"""What ``allow=`` takes: networks and host names, or ``(host, address) -> bool``."""

# -- the address policy ------------------------------------------------------------------

_V4_REASONS: tuple[tuple[ipaddress.IPv4Network, str], ...] = tuple(
    (ipaddress.IPv4Network(net), why)
    for net, why in (
        ("0.0.0.0/8", "this host / unspecified"),
        ("127.0.0.0/8", "loopback"),
        ("10.0.0.0/8", "private network"),
        ("172.16.0.0/12", "private network"),
        ("192.168.0.0/16", "private network"),
        ("100.64.0.0/10", "shared address space (CGNAT)"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("169.254.0.0/16", "link-local, cloud metadata"),
        ("192.0.2.0/24", "documentation"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("198.18.0.0/15", "benchmarking"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
    )
)
# IANA's IPv4 special-purpose registry, every range it marks not globally reachable, and
# multicast: judged by this table alone, not by ``is_global``, whose table differs between
# Python releases (3.11.7 calls most of 192.0.0.0/24 global). Within 192.0.0.0/24, IANA
# marks the PCP and TURN anycast addresses globally reachable.
_V4_GLOBAL_EXCEPTIONS = (ipaddress.IPv4Address("192.0.0.9"), ipaddress.IPv4Address("192.0.0.10"))
_V6_REASONS: tuple[tuple[ipaddress.IPv6Network, str], ...] = tuple(
    (ipaddress.IPv6Network(net), why)
    for net, why in (
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("fc00::/7", "unique-local (private network)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("::ffff:0:0:0/96", "IPv4-translated (reserved)"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("5f00::/16", "segment routing (SRv6)"),
    )
)
# IANA allocates global unicast from 2000::/3 only; the rest is reserved by the IETF
# (the ranges above name the special ones). Judged here, not left to ``is_global``, whose
# table differs from one Python release to the next.
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _embedded_v4(address: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4), and the form's name."""
    if address in _MAPPED:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF), "IPv4-mapped"
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF), "NAT64"
    if address in _SIX_TO_FOUR:
        return ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF), "6to4"
    return None


def address_refusal(address: Address) -> str | None:
    """Why the default policy refuses ``address``, or ``None`` when it may be reached.

    Only globally routable unicast addresses pass, judged by the library's own tables of
    IANA's special-purpose ranges, not by the running Python's ``is_global``. An IPv6
    address that carries an IPv4 one (IPv4-mapped ``::ffff:0:0/96``, NAT64
    ``64:ff9b::/96``, 6to4 ``2002::/16``) is judged by that IPv4 address too, since
    that is where its packets go; deprecated IPv4-compatible and site-local forms, the
    IPv4-translated form, local-use NAT64 ``64:ff9b:1::/48``, and every other IPv6 address
    outside global unicast ``2000::/3`` are refused, whatever the running Python's
    ``is_global`` says of them.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_v4(address)
        if embedded is not None:
            v4, form = embedded
            inner = address_refusal(v4)
            if inner is not None:
                return f"{inner}, {form} {v4}"
            if form != "6to4":
                # Mapped and NAT64 addresses go exactly where their IPv4 address goes.
                return None
        elif address in _V4_COMPATIBLE and int(address) > 1:
            return "IPv4-compatible (deprecated)"
        for net6, why in _V6_REASONS:
            if address in net6:
                return why
        if address.is_multicast:
            return "multicast"
        if address not in _GLOBAL_UNICAST:
            return "reserved (outside global unicast 2000::/3)"
        if not address.is_global:
            return "not globally routable"
        return None
    if address in _V4_GLOBAL_EXCEPTIONS:
        return None
    for net4, why in _V4_REASONS:
        if address in net4:
            return why
    return None


_V4_PART = re.compile(r"0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*")
"""One part as ``inet_aton`` reads it: ASCII digits only, no sign, underscore or space
(all of which Python's ``int`` would take)."""


def _v4_part(text: str) -> int | None:
    """One part of an inet_aton address: decimal, octal (leading 0) or hex (0x)."""
    if _V4_PART.fullmatch(text) is None:
        return None
    if text[:2] in ("0x", "0X"):
        return int(text[2:], 16)
    return int(text, 8 if text[0] == "0" else 10)


def parse_ip_literal(host: str) -> Address | None:
    """The address a URL host spells literally, in every spelling a C resolver accepts.

    ``127.0.0.1``, ``127.1``, ``0x7f.1``, ``017700000001``, ``2130706433``, ``0`` and
    ``[::ffff:127.0.0.1]`` all are 127.0.0.1 (or its mapped form) to ``inet_aton`` and
    ``getaddrinfo``; ``None`` means the host is a name to be resolved.
    """
    text = host.strip("[]")
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            return None
    parts = text.split(".")
    if not 1 <= len(parts) <= 4 or not all(parts):
        return None
    values = [_v4_part(p) for p in parts]
    if any(v is None for v in values):
        return None
    nums = [v for v in values if v is not None]
    # inet_aton: a.b.c.d, a.b.c (c: 16 bits), a.b (b: 24 bits), a (32 bits).
    last_bits = 8 * (5 - len(nums))
    if any(v > 255 for v in nums[:-1]) or nums[-1] >= 1 << last_bits:
        return None
    value = nums[-1]
    for i, v in enumerate(nums[:-1]):
        value |= v << (24 - 8 * i)
    return ipaddress.IPv4Address(value)


class BlockedAddressError(FetchError):
    """A connection would reach an address the fetcher's policy refuses; nothing was sent."""

    def __init__(self, host: str, address: Address, reason: str):
        super().__init__(
            f"blocked address {address} ({reason})"
            + ("" if parse_ip_literal(host) == address else f" for host {host!r}"),
            hint=f"to reach it on purpose, build the fetcher with Fetcher(allow=[{str(address)!r}])"
            " (or its network, or the host name)",
        )
        self.host = host
        self.address = address
        self.reason = reason


class _Timeout(Exception):
    """The fetch's one overall deadline passed."""


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Timeout
    return left


class Guard:
    """The address policy of every outbound connection: resolve, judge, connect.

    Args:
        allow: exceptions to the policy: IP networks or addresses (``"10.1.2.0/24"``,
            ``"fd00::5"``) and host names (``"metrics.internal"``, the URL's host
            exactly, any address it resolves to), or a callable ``(host, address) ->
            bool`` consulted for every refused address. ``()``: public addresses only.
    """

    def __init__(self, allow: Allow = ()) -> None:
        self._allow_fn: Callable[[str, Address], bool] | None = None
        nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        names: set[str] = set()
        if callable(allow):
            self._allow_fn = allow
        else:
            if isinstance(allow, str):
                raise TypeError("allow must be a list of networks and names, not one string")
            for item in allow:
                if isinstance(item, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
                    nets.append(item)
                    continue
                try:
                    nets.append(ipaddress.ip_network(item, strict=False))
                except ValueError:
                    name = str(item).strip().rstrip(".").lower()
                    if not name or any(c in name for c in "/:@ "):
                        raise ValueError(
                            f"allow: {item!r} is neither a network nor a host name"
                        ) from None
                    names.add(name)
        self._nets = tuple(nets)
        self._names = frozenset(names)

    def __repr__(self) -> str:
        if self._allow_fn is not None:
            return f"Guard(allow={self._allow_fn!r})"
        shown = [str(n) for n in self._nets] + sorted(self._names)
        return f"Guard(allow={shown!r})"

    def _allowed(self, host: str, address: Address) -> bool:
        if self._allow_fn is not None:
            return bool(self._allow_fn(host, address))
        if host.strip("[]").rstrip(".").lower() in self._names:
            return True
        candidates: list[Address] = [address]
        if isinstance(address, ipaddress.IPv6Address):
            embedded = _embedded_v4(address)
            if embedded is not None:
                candidates.append(embedded[0])
        return any(a in net for a in candidates for net in self._nets if a.version == net.version)

    def refusal(self, host: str, address: Address) -> str | None:
        """Why connecting to ``address`` (resolved from ``host``) is refused, or ``None``."""
        reason = address_refusal(address)
        if reason is None or self._allowed(host, address):
            return None
        return reason

    def check_literal(self, host: str) -> None:
        """Raise :class:`BlockedAddressError` if ``host`` spells a refused address.

        Names pass: they are judged when connected, on what they resolve to then.
        """
        literal = parse_ip_literal(host)
        if literal is not None:
            reason = self.refusal(host, literal)
            if reason is not None:
                raise BlockedAddressError(host, literal, reason)

    def resolve(self, host: str, port: int, deadline: float) -> list[tuple[Any, ...]]:
        """The ``getaddrinfo`` answers for ``host``, every one judged; by ``deadline``."""
        literal = parse_ip_literal(host)
        if literal is not None:
            family = socket.AF_INET if literal.version == 4 else socket.AF_INET6
            infos: list[tuple[Any, ...]] = [
                (family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (str(literal), port))
            ]
        else:
            infos = _getaddrinfo(host, port, deadline)
        # Every candidate is judged: a name answering one public and one private address
        # is refused, rather than tried in turn.
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            reason = self.refusal(host, address)
            if reason is not None:
                raise BlockedAddressError(host, address, reason)
        return infos

    def connect(self, host: str, port: int, deadline: float) -> socket.socket:
        """A TCP connection to ``host``, made only to an address judged here.

        The addresses are resolved once, judged, and the socket connects to exactly
        those, so a resolver that answers differently later (DNS rebinding) changes
        nothing. Raises :class:`BlockedAddressError`, ``OSError``, or ``TimeoutError``
        when ``deadline`` (a :func:`time.monotonic` instant) passes.
        """
        try:
            infos = self.resolve(host, port, deadline)
        except _Timeout:
            raise TimeoutError(f"resolving {host} took too long") from None
        error: OSError | None = None
        for family, socktype, proto, _name, sockaddr in infos:
            sock = socket.socket(family, socktype, proto)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.connect(sockaddr)
            except OSError as exc:
                sock.close()
                error = exc
                if isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                    raise
                continue
            return sock
        raise error or OSError(f"no address for {host}")

    def create_connection(
        self,
        address: tuple[str, int],
        timeout: float | None = None,
        source_address: object = None,
    ) -> socket.socket:
        """:func:`socket.create_connection` behind this guard (``timeout``: DNS + connect)."""
        budget = 60.0 if timeout is None else timeout
        return self.connect(address[0], address[1], time.monotonic() + budget)


def _getaddrinfo(host: str, port: int, deadline: float) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` bounded by the deadline.

    The C resolver has no timeout of its own, so it runs on a short-lived daemon thread
    the fetch stops waiting for once its deadline passes (the lookup then ends on its own).
    """
    box: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:
            box.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="batch-fetch-dns", daemon=True).start()
    if not done.wait(_remaining(deadline)):
        raise _Timeout
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    infos: list[tuple[Any, ...]] = result
    return infos


# -- http.client, bounded -----------------------------------------------------------------


def _wire_cap(max_bytes: int) -> int:
    """The most bytes one response may take on the wire: the body's cap, a quarter more
    for chunked framing, and 1 MiB for heads (informational ones included), chunk
    extensions and trailers. ``http.client`` bounds each line, not how many lines come."""
    return max_bytes + max_bytes // 4 + 1024 * 1024


class _WireCapExceeded(Exception):
    """A response took more than its :func:`_wire_cap` of bytes on the wire."""


class _DeadlineIO(io.RawIOBase):
    """The response's socket reader: every read waits only until the overall deadline,
    and no more than ``cap`` bytes are read in all.

    A socket timeout alone bounds each read, so a server dripping one byte a second
    could hold a fetch for ever; here each read gets what is left of the one deadline.
    The cap counts every byte ``http.client`` reads (heads, chunk framing, trailers), so
    framing around a small body cannot make a fetch read gigabytes until its deadline.
    """

    def __init__(self, raw: Any, sock: socket.socket, deadline: float, cap: int) -> None:
        self._raw = raw
        self._sock = sock
        self._deadline = deadline
        self._left = cap

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's deadline passed")
        if self._left <= 0:
            raise _WireCapExceeded("the response took more bytes than its cap on the wire")
        self._sock.settimeout(left)
        with memoryview(buffer) as view:
            n: int = self._raw.readinto(view[: self._left])
        self._left -= n
        return n

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _Response(http.client.HTTPResponse):
    def __init__(
        self, sock: socket.socket, *args: Any, deadline: float, cap: int, **kw: Any
    ) -> None:
        super().__init__(sock, *args, **kw)
        # The SocketIO keeps the socket alive when http.client closes the connection
        # early (Connection: close); reads go through it, bounded by the deadline.
        raw = self.fp.detach()
        self.fp = io.BufferedReader(_DeadlineIO(raw, sock, deadline, cap))


def _guarded(
    conn: http.client.HTTPConnection, guard: Guard | None, deadline: float, cap: int
) -> None:
    """Make ``conn`` connect through ``guard`` and read within ``deadline`` and at most
    ``cap`` bytes a response."""

    def open_socket(
        address: tuple[str, int], timeout: object = None, source: object = None
    ) -> socket.socket:
        if guard is None:  # an explicit proxy: guarding the addresses is its job
            budget = max(deadline - time.monotonic(), 0.001)
            sock = socket.create_connection(address, budget)
        else:
            sock = guard.connect(address[0], address[1], deadline)
        # What is left, not what was left before the connect: the TLS handshake that
        # follows takes the socket's timeout whole as its own bound. (Through a proxy,
        # reading the CONNECT reply sets it again, as every read of a response does.)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        return sock

    # http.client's own seam for opening the socket (there since Python 3.0); TLS, a
    # CONNECT tunnel and the request itself all ride on the socket it returns.
    conn._create_connection = open_socket  # type: ignore[attr-defined]
    conn.response_class = _response_factory(deadline, cap)  # type: ignore[assignment]


def _response_factory(deadline: float, cap: int) -> Callable[..., _Response]:
    def make(sock: socket.socket, *args: Any, **kw: Any) -> _Response:
        return _Response(sock, *args, deadline=deadline, cap=cap, **kw)

    return make


def _request_target(parts: Any) -> str:
    # Quote what http.client would refuse (spaces, non-ASCII), keep what is already quoted.
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return path + (f"?{query}" if parts.query else "")


def _idna(host: str) -> str:
    try:
        host.encode("ascii")
    except UnicodeEncodeError:
        try:
            return host.encode("idna").decode("ascii")
        except UnicodeError:
            raise FetchError(f"invalid host name {host!r}", hint="check the URL") from None
    return host


def _split(url: str) -> SplitResult:
    """``urlsplit`` with the port read: a URL it cannot take fails as a :class:`FetchError`
    (its target fails, the HTTP API answers 422), never as a ``ValueError``."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # reading it checks it: not a number, or out of range
    except ValueError as exc:
        raise FetchError(f"invalid URL {url[:200]!r}: {exc}", hint="check the URL") from None
    return parts


def _hostname(parts: SplitResult, url: str) -> str:
    """The host a connection to ``parts`` is made to: IDNA applied (so ``127。0。0。1`` is
    judged as the ``127.0.0.1`` it becomes), a name's labels checked."""
    host = parts.hostname
    if not host:
        raise FetchError(f"URL has no host: {url[:200]!r}", hint="check the URL")
    host = _idna(host)
    if ":" not in host and parse_ip_literal(host) is None:
        labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
        if (
            len(host) > 254
            or not all(0 < len(label) <= 63 for label in labels)
            or any(c.isspace() or not c.isprintable() for c in host)
        ):
            raise FetchError(f"invalid host name {host[:200]!r}", hint="check the URL")
    return host


class Fetcher:
    """A ``fetch(target) -> Result`` for ``http`` and ``https`` URLs (and ``file``, if asked).

    Args:
        timeout: seconds for the whole fetch: name resolution, every connect, TLS
            handshake, headers and body of every redirect hop. A server that drips
            bytes cannot hold a target past it.
        max_bytes: the largest body accepted; a larger one fails the target. No response
            (a redirect's neither) is read much beyond it: heads, chunk framing and
            trailers count too, up to a quarter more and 1 MiB.
        max_redirects: how many redirects to follow (0: none).
        schemes: the URL schemes accepted, among ``http``, ``https`` and ``file``.
            ``file`` is off by default: add it (``schemes=("http", "https", "file")``)
            to read local files; only regular files are read.
        allow: exceptions to the address policy (see :class:`Guard`): networks and host
            names, or ``(host, address) -> bool``. ``("0.0.0.0/0", "::/0")`` allows all.
        proxy: an ``http://host:port`` proxy to send every request through (CONNECT for
            https). Proxies from the environment are never used. Through a proxy the
            proxy resolves and connects, so guarding addresses is its job.
        user_agent: the ``User-Agent`` header sent.

    The result's ``content`` is the body decoded as text (its declared charset when it
    is one of the web's, else UTF-8; undecodable bytes replaced); a body that is not text
    (an image, a PDF) is base64, with ``meta["encoding"] = "base64"``. ``meta`` holds
    ``status`` (HTTP), ``content_type``, ``url`` (after redirects) and ``bytes``. The
    ``grep`` option keeps the lines that contain its text (a body not labelled text is
    read as UTF-8 for it; one that is no text fails the target); any other option fails
    the target, since this fetcher cannot honour it.

    Refused addresses (:class:`BlockedAddressError`), HTTP errors (4xx, 5xx), timeouts,
    unreachable hosts, too many redirects, bodies over ``max_bytes`` and refused schemes
    fail the target with a :class:`~batch.FetchError` and a hint.
    """

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_redirects: int = 5,
        schemes: Iterable[str] = _HTTP,
        allow: Allow = (),
        proxy: str | None = None,
        user_agent: str = "batch-dcache/0.1 (+https://pypi.org/project/batch-dcache/)",
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes!r}")
        if not 0 <= max_redirects <= 100:
            raise ValueError(f"max_redirects must be from 0 to 100, got {max_redirects!r}")
        accepted = tuple(s.lower() for s in schemes)
        unknown = sorted(set(accepted) - {"http", "https", "file"})
        if unknown or not accepted:
            raise ValueError(f"schemes must be among http, https and file, not {unknown}")
        self.timeout = float(timeout)
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        self.schemes = accepted
        self.user_agent = user_agent
        self.guard = Guard(allow)
        self.proxy = proxy
        self._proxy: tuple[str, int] | None = None
        if proxy is not None:
            parts = urlsplit(proxy)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"proxy must be an http://host:port URL, not {proxy!r}")
            self._proxy = (parts.hostname, parts.port or 80)
        self._tls: ssl.SSLContext | None = None

    def __repr__(self) -> str:
        return (
            f"Fetcher(timeout={self.timeout!r}, max_bytes={self.max_bytes!r}, "
            f"max_redirects={self.max_redirects!r}, schemes={self.schemes!r}, "
            f"allow={self.guard!r}, proxy={self.proxy!r})"
        )

    def check_url(self, url: str) -> None:
        """Refuse early what this fetcher would surely refuse: raise :class:`~batch.FetchError`.

        Checks the scheme and a host spelled as a literal address (names are judged
        when connected). The HTTP API calls it to answer 422 before a job is made.
        """
        parts = _split(url)
        scheme = parts.scheme.lower()
        if scheme not in self.schemes:
            raise FetchError(
                f"URL scheme {scheme!r} refused" if scheme else "URL has no scheme",
                hint=f"use a URL whose scheme is {' or '.join(self.schemes)}",
            )
        if scheme in _HTTP:
            host = _hostname(parts, url)
            if self._proxy is None:
                self.guard.check_literal(host)

    def __call__(self, target: Target) -> Result:
        """Fetch one target; raise :class:`~batch.FetchError` to fail it."""
        scheme = _split(target.url).scheme.lower()
        if scheme not in self.schemes:
            self.check_url(target.url)  # raises, naming the refused scheme
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
        if not target.options.grep:
            return Result(_decode(body, meta), meta)
        if _is_text(str(meta.get("content_type", ""))):
            content = _decode(body, meta)
        else:
            content = _as_text_for_grep(body, meta)
        needle = target.options.grep
        content = "\n".join(line for line in content.splitlines() if needle in line)
        return Result(content, meta)

    # -- file: --------------------------------------------------------------------------

    def _read_file(self, url: str) -> tuple[bytes, dict[str, Any]]:
        parts = _split(url)
        if parts.netloc not in ("", "localhost"):
            raise FetchError(
                f"file URL names a remote host {parts.netloc!r}", hint="use file:///path"
            )
        # "file:name" (no slashes) is relative to the working directory: handy offline.
        path = Path(unquote(parts.path))
        try:
            # O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; the
            # fstat below then refuses everything that is not a regular file.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise FetchError(f"no such file: {path}", hint="check the path") from None
        except IsADirectoryError:
            raise FetchError(f"{path} is a directory", hint="name a file") from None
        except OSError as exc:
            raise FetchError(f"cannot read {path}: {exc.strerror or exc}") from None
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise FetchError(f"{path} is a directory", hint="name a file")
            if not stat.S_ISREG(info.st_mode):
                raise FetchError(
                    f"{path} is not a regular file (a pipe, socket or device)",
                    hint="name a regular file",
                )
            if info.st_size > self.max_bytes:
                raise FetchError(
                    f"file is {info.st_size} bytes, at most {self.max_bytes} allowed",
                    hint="raise Fetcher(max_bytes=...) or split the file",
                )
            with os.fdopen(fd, "rb") as fh:
                fd = -1  # the file object owns it now
                body = fh.read(self.max_bytes + 1)
        except OSError as exc:
            raise FetchError(f"cannot read {path}: {exc.strerror or exc}") from None
        finally:
            if fd >= 0:
                os.close(fd)
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

    # -- http(s): -----------------------------------------------------------------------

    def _get(self, url: str) -> tuple[bytes, dict[str, Any]]:
        deadline = time.monotonic() + self.timeout
        current = url
        try:
            for hop in range(self.max_redirects + 1):
                conn, resp = self._open(current, deadline)
                try:
                    status = int(resp.status)
                    if status in _REDIRECTS:
                        # A redirect's body is never read: not one byte of it counts.
                        current = self._next_hop(current, resp, hop)
                        continue
                    if not 200 <= status < 300:
                        raise _status_error(status, resp.reason)
                    body = self._read_body(resp)
                    meta = {
                        "status": status,
                        "content_type": resp.getheader("Content-Type", "") or "",
                        "url": current,
                        "bytes": len(body),
                    }
                    return body, meta
                finally:
                    # Both: the response holds the socket open until it is closed itself.
                    resp.close()
                    conn.close()
        except FetchError:
            raise
        except _WireCapExceeded:
            raise FetchError(
                f"response took over {_wire_cap(self.max_bytes)} bytes on the wire, headers "
                f"and framing included (its body may take {self.max_bytes})",
                hint="the server sends far more than its body; raise Fetcher(max_bytes=...) "
                "if it is to be read",
            ) from None
        except (_Timeout, TimeoutError):
            raise FetchError(
                f"timed out after {self.timeout:g} s (the whole fetch, redirects included)",
                hint="retry later, or raise Fetcher(timeout=...)",
            ) from None
        except socket.gaierror as exc:
            raise FetchError(
                f"cannot reach {_host(current)}: name not resolved ({exc.strerror or exc})",
                hint="check the URL",
            ) from None
        except ssl.SSLError as exc:
            raise FetchError(
                f"TLS failed with {_host(current)}: {exc.reason or exc}",
                hint="the server's certificate or TLS setup is not accepted",
            ) from None
        except http.client.HTTPException as exc:
            raise FetchError(
                f"bad HTTP answer from {_host(current)}: {type(exc).__name__}: {exc}",
                hint="the server broke the protocol; retry later",
            ) from None
        except ConnectionRefusedError as exc:
            raise FetchError(
                f"cannot reach {_host(current)}: {exc.strerror or exc}",
                hint="nothing listens there now (the server may be down); retry later",
            ) from None
        except OSError as exc:
            raise FetchError(
                f"cannot reach {_host(current)}: {exc.strerror or exc}", hint="check the URL"
            ) from None
        raise AssertionError("unreachable")  # pragma: no cover (the loop returns or raises)

    def _next_hop(self, current: str, resp: http.client.HTTPResponse, hop: int) -> str:
        location = _raw_location(resp.getheader("Location"))
        if not location:
            raise FetchError(
                f"HTTP {resp.status} {resp.reason}: a redirect without a usable Location",
                hint="fetch the final URL directly",
            )
        try:
            target = urljoin(current, location.strip())
        except ValueError as exc:
            raise FetchError(
                f"invalid URL {location[:200]!r} in a redirect: {exc}", hint="check the URL"
            ) from None
        scheme = _split(target).scheme.lower()
        if scheme not in _HTTP or scheme not in self.schemes:
            # Never from the web into file: or ftp:, whatever the scheme list says.
            raise FetchError(
                f"redirect to a refused URL scheme {scheme!r} ({target[:200]})",
                hint="only http and https redirects are followed",
            )
        if hop >= self.max_redirects:
            raise FetchError(
                f"too many redirects: more than {self.max_redirects} (the last to {target[:200]})",
                hint="fetch the final URL directly",
            )
        return target

    def _open(
        self, url: str, deadline: float
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        parts = _split(url)
        scheme = parts.scheme.lower()
        host = _hostname(parts, url)
        port = parts.port
        if port is None:  # always explicit: http.client would read "::1" as host:port
            port = 443 if scheme == "https" else 80
        headers = {
            "User-Agent": self.user_agent,
            "Accept": "*/*",
            "Connection": "close",
        }
        target = _request_target(parts)
        conn: http.client.HTTPConnection
        if self._proxy is None:
            conn = self._connection(scheme, host, port, deadline)
            _guarded(conn, self.guard, deadline, _wire_cap(self.max_bytes))
        else:
            conn = self._connection(scheme, *self._proxy, deadline)
            _guarded(conn, None, deadline, _wire_cap(self.max_bytes))
            if scheme == "https":
                conn.set_tunnel(host, port)
            else:
                netloc = f"[{host}]" if ":" in host else host
                target = f"http://{netloc}{f':{port}' if port else ''}{target}"
        try:
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        return conn, resp

    def _connection(
        self, scheme: str, host: str, port: int | None, deadline: float
    ) -> http.client.HTTPConnection:
        budget = max(deadline - time.monotonic(), 0.001)
        if scheme == "https":
            return http.client.HTTPSConnection(host, port, timeout=budget, context=self._context())
        return http.client.HTTPConnection(host, port, timeout=budget)

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _read_body(self, resp: http.client.HTTPResponse) -> bytes:
        length = resp.getheader("Content-Length")
        # ASCII digits only, as http.client reads it ("²".isdigit(), but int() refuses it).
        if (
            length is not None
            and _DIGITS.fullmatch(length.strip())
            and int(length) > self.max_bytes
        ):
            raise FetchError(
                f"response is {int(length)} bytes, at most {self.max_bytes} allowed",
                hint="raise Fetcher(max_bytes=...)",
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            # Never ask for more than one byte past the cap: that byte tells "too big".
            chunk = resp.read1(min(_CHUNK, self.max_bytes + 1 - size))
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise FetchError(
                    f"response is over {self.max_bytes} bytes",
                    hint="raise Fetcher(max_bytes=...)",
                )
            chunks.append(chunk)


def _status_error(code: int, reason: str) -> FetchError:
    if 300 <= code < 400:
        return FetchError(
            f"HTTP {code} {reason}: a redirect without a usable Location",
            hint="fetch the final URL directly",
        )
    return FetchError(f"HTTP {code} {reason}", hint=_status_hint(code))


def _host(url: str) -> str:
    return _split(url).netloc or url[:200]


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


# The charsets of the web (the WHATWG Encoding Standard's, plus ASCII, Latin-1, UTF-32 and
# a few common aliases' targets), by the names Python's codecs give them. Other codecs are
# no page's charset and some are hazards: punycode decodes in quadratic time (a 1 MB body
# took 22 s of CPU, past the fetch's deadline), utf-7 and the escape codecs decode to lone
# surrogates (no database stores them).
_WEB_CHARSETS = frozenset(
    [
        "ascii", "big5", "big5hkscs", "cp1250", "cp1251", "cp1252", "cp1253", "cp1254",
        "cp1255", "cp1256", "cp1257", "cp1258", "cp866", "cp874", "cp932", "cp949",
        "euc_jp", "euc_kr", "gb18030", "gb2312", "gbk", "iso2022_jp", "iso8859-1",
        "iso8859-2", "iso8859-3", "iso8859-4", "iso8859-5", "iso8859-6", "iso8859-7",
        "iso8859-8", "iso8859-9", "iso8859-10", "iso8859-11", "iso8859-13", "iso8859-14",
        "iso8859-15", "iso8859-16", "koi8-r", "koi8-u", "mac-cyrillic", "mac-roman",
        "shift_jis", "tis-620", "utf-16", "utf-16-be", "utf-16-le", "utf-32", "utf-8",
        "utf-8-sig",
    ]
)  # fmt: skip


_DIGITS = re.compile(r"[0-9]+")


def _raw_location(header: str | None) -> str | None:
    """A ``Location`` header as the URL its bytes spell: http.client hands headers over
    decoded as Latin-1, so UTF-8 bytes (``/caf\\xc3\\xa9``) would be encoded a second
    time. UTF-8 is read as such; other bytes are percent-encoded as they came."""
    if header is None or header.isascii():
        return header
    try:
        raw = header.encode("latin-1")
    except UnicodeEncodeError:
        return header  # not from the wire's bytes (a test's headers): as given
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(chr(b) if b < 0x80 else f"%{b:02X}" for b in raw)


# WHATWG labels Python does not know, and the labels WHATWG decodes otherwise than their
# name says (Latin-1 and ASCII as windows-1252, as browsers do: a page that says
# iso-8859-1 is most often cp1252, its curly quotes in 0x80-0x9F).
_WEB_ALIASES = {
    "windows-31j": "cp932",
    "x-sjis": "cp932",
    "ms932": "cp932",
    "windows-874": "cp874",
    "x-mac-cyrillic": "mac-cyrillic",
    "x-mac-ukrainian": "mac-cyrillic",
    "windows-949": "cp949",
    "cseuckr": "euc_kr",
    "x-euc-jp": "euc_jp",
    "x-gbk": "gbk",
    "iso-8859-8-i": "iso8859-8",
    "csiso88598i": "iso8859-8",
    "logical": "iso8859-8",
}
_AS_CP1252 = frozenset(["iso8859-1", "ascii"])


@functools.lru_cache(maxsize=64)
def _charset(ctype: str) -> str:
    """The declared charset if it is one of the web's (``_WEB_CHARSETS``), else UTF-8."""
    declared = "utf-8"
    for param in ctype.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            declared = value.strip().strip("'\"").strip() or "utf-8"
            break
    declared = _WEB_ALIASES.get(declared.lower(), declared)
    try:
        info = codecs.lookup(declared)
    except (LookupError, ValueError, TypeError, UnicodeError):
        return "utf-8"
    if info.name in _AS_CP1252:
        return "cp1252"
    return info.name if info.name in _WEB_CHARSETS else "utf-8"


def _decode(body: bytes, meta: dict[str, Any]) -> str:
    """The body as text in its declared charset; base64 when it is not text."""
    ctype = str(meta.get("content_type", ""))
    if not _is_text(ctype):
        meta["encoding"] = "base64"
        return base64.b64encode(body).decode("ascii")
    charset = _charset(ctype)
    try:
        return body.decode(charset, errors="replace")
    except (LookupError, UnicodeError, ValueError, TypeError):
        # A codec that misbehaves on this input: fall back rather than fail the target.
        return body.decode("utf-8", errors="replace")


def _as_text_for_grep(body: bytes, meta: dict[str, Any]) -> str:
    """A body not labelled text, read as the UTF-8 text that ``grep`` searches (servers
    label plain files ``application/octet-stream``); one that is no UTF-8 fails. (Not
    first encoded as base64, as :func:`_decode` would.)"""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        ctype = str(meta.get("content_type") or "no content type")
        raise FetchError(
            f"grep needs a text body: this one is binary ({ctype[:100]})",
            hint="fetch it without grep",
        ) from None


fetch: Fetcher = Fetcher()
"""The default fetcher (http and https to public addresses; 30 s, 4 MiB, 5 redirects)."""
