"""The default fetcher's address guard, deadline and byte caps, against real loopback servers.

Every server here is a real socket on 127.0.0.x; the network jail (``_netjail``) makes any
attempt to reach further fail the test, so a broken guard cannot send a packet off the box.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _netjail import NetJailError, clear, netjail, netjail_check, violations  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

import batch
from batch.fetchers import (
    BlockedAddressError,
    Fetcher,
    Guard,
    address_refusal,
    parse_ip_literal,
)

LOOPBACK = ["127.0.0.0/8", "::1"]

# -- a raw loopback server: counts connections and the bytes it managed to send ------------


class RawServer:
    """A TCP server on ``host`` running ``handler(conn, server)`` per connection."""

    def __init__(
        self,
        handler: Callable[[socket.socket, RawServer], None],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.sent = 0
        self.active = 0
        self.idle = threading.Condition()
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{netloc}:{self.port}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            with self.idle:
                self.active += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._converse(conn)
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until every connection's handler has returned (its writes failed or ended)."""
        with self.idle:
            assert self.idle.wait_for(lambda: self.active == 0, timeout), "handler still busy"

    def _converse(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(4096)
                    if not data:
                        return
                    head += data
                with self._lock:
                    self.requests.append(head)
                self.handler(conn, self)
            except OSError:
                pass

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def serve() -> Iterator[Callable[..., RawServer]]:
    made: list[RawServer] = []

    def make(handler: Callable[[socket.socket, RawServer], None], **kw: Any) -> RawServer:
        server = RawServer(handler, **kw)
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


def reply(body: bytes = b"hello", status: str = "200 OK", **headers: str) -> Callable[..., None]:
    def handler(conn: socket.socket, server: RawServer) -> None:
        lines = [f"HTTP/1.1 {status}", "Connection: close"]
        if "Content_Type" not in headers:
            lines.append("Content-Type: text/plain; charset=utf-8")
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        server.send(conn, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    return handler


def get(url: str, fetcher: Fetcher | None = None) -> batch.Result:
    return (fetcher or Fetcher())(batch.Target(url))


def refused(url: str, fetcher: Fetcher | None = None) -> batch.FetchError:
    with pytest.raises(batch.FetchError) as info:
        get(url, fetcher)
    return info.value


# -- the address policy -----------------------------------------------------------------------


def test_a_loopback_server_is_refused_by_default_and_reached_with_allow(
    serve: Callable[..., RawServer],
) -> None:
    """The default fetcher never connects to 127.0.0.1; allow= names the exception."""
    server = serve(reply(b"inside"))
    err = refused(server.url + "/")
    assert isinstance(err, BlockedAddressError)
    assert err.message == "blocked address 127.0.0.1 (loopback)"
    assert "Fetcher(allow=['127.0.0.1'])" in err.hint
    assert server.connections == 0

    assert get(server.url + "/", Fetcher(allow=["127.0.0.1"])).content == "inside"
    assert get(server.url + "/", Fetcher(allow=["127.0.0.0/8"])).content == "inside"
    by_name = f"http://localhost:{server.port}/"
    assert get(by_name, Fetcher(allow=["localhost"])).content == "inside"
    asked: list[tuple[str, str]] = []

    def only_this_port_host(host: str, address: Any) -> bool:
        asked.append((host, str(address)))
        return host == "127.0.0.1"

    assert get(server.url + "/", Fetcher(allow=only_this_port_host)).content == "inside"
    assert asked == [("127.0.0.1", "127.0.0.1")]
    assert server.connections == 4


@pytest.mark.parametrize(
    "host",
    [
        "2130706433",
        "0x7f.1",
        "127.1",
        "017700000001",
        "[::ffff:127.0.0.1]",
        "0",
        "0.0.0.0",
        "[::1]",
        "[::]",
        "localhost",
    ],
)
def test_every_spelling_of_this_host_is_refused(serve: Callable[..., RawServer], host: str) -> None:
    """Decimal, hex, short, mapped and named spellings of loopback never connect."""
    server = serve(reply(b"inside"))
    err = refused(f"http://{host}:{server.port}/")
    assert err.message.startswith("blocked address "), err.message
    assert "Fetcher(allow=" in err.hint
    assert server.connections == 0
    if host != "localhost":  # names are judged when connected
        with pytest.raises(BlockedAddressError):
            Fetcher().check_url(f"http://{host}:{server.port}/")


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("10.0.0.5", "private network"),
        ("172.16.3.4", "private network"),
        ("192.168.1.1", "private network"),
        ("100.64.0.1", "shared address space (CGNAT)"),
        ("169.254.169.254", "link-local, cloud metadata"),
        ("192.0.2.1", "documentation"),
        ("224.0.0.251", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("[fd00::1]", "unique-local (private network)"),
        ("[fe80::1]", "link-local"),
        ("[ff02::1]", "multicast"),
        ("[2001:db8::1]", "documentation"),
        ("[::ffff:10.0.0.5]", "private network, IPv4-mapped 10.0.0.5"),
        ("[64:ff9b::a9fe:a9fe]", "link-local, cloud metadata, NAT64 169.254.169.254"),
        ("[2002:a00:5::1]", "private network, 6to4 10.0.0.5"),
    ],
)
def test_private_and_special_addresses_are_refused_before_any_connect(
    host: str, reason: str
) -> None:
    """Every non-global range fails the target with its reason; no connect is attempted."""
    err = refused(f"http://{host}/latest/meta-data/")
    address = host.strip("[]")
    assert err.message == f"blocked address {ipaddress.ip_address(address)} ({reason})"
    assert violations() == []  # the jail saw no connect: the guard refused first


def test_a_redirect_to_a_refused_address_fails_without_reaching_it(
    serve: Callable[..., RawServer],
) -> None:
    """Each hop is judged at its connect: an allowed server cannot bounce us inside."""
    inside = serve(reply(b"secret"), host="127.0.0.1")
    outside = serve(reply(b"", "302 Found", Location=inside.url + "/admin"), host="127.0.0.2")
    named = serve(
        reply(b"", "302 Found", Location=f"http://localhost:{inside.port}/"), host="127.0.0.2"
    )
    fetcher = Fetcher(allow=["127.0.0.2"])
    err = refused(outside.url + "/", fetcher)
    assert err.message == "blocked address 127.0.0.1 (loopback)"
    err = refused(named.url + "/", fetcher)
    assert err.message.startswith("blocked address ")
    assert err.message.endswith("(loopback) for host 'localhost'")
    assert (outside.connections, named.connections, inside.connections) == (1, 1, 0)


def test_dns_rebinding_cannot_move_the_connection(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolver answering allowed 127.0.0.2 first, then 127.0.0.1, never reaches .1."""
    allowed = serve(reply(b"allowed"), host="127.0.0.2")
    try:
        forbidden = serve(reply(b"secret"), host="127.0.0.1", port=allowed.port)
    except OSError:
        pytest.skip("port taken on 127.0.0.1")
    answers = ["127.0.0.2", "127.0.0.1", "127.0.0.1", "127.0.0.1"]
    calls: list[str] = []

    def rebinding(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != "rebind.test":
            return real(host, port, *args, **kw)
        address = answers[min(len(calls), len(answers) - 1)]
        calls.append(address)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    url = f"http://rebind.test:{allowed.port}/"
    result = get(url, Fetcher(allow=["127.0.0.2"]))
    assert result.content == "allowed"
    assert forbidden.connections == 0
    # Asked again (the rebinding answer now first): refused at the check itself.
    err = refused(url, Fetcher(allow=["127.0.0.2"]))
    assert err.message == "blocked address 127.0.0.1 (loopback) for host 'rebind.test'"
    assert forbidden.connections == 0
    assert calls == ["127.0.0.2", "127.0.0.1"]  # one resolution per connection


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("::ffff:0:127.0.0.1", "IPv4-translated"),
        ("::ffff:0:10.0.0.5", "IPv4-translated"),
        ("64:ff9b:1::a00:5", "local-use NAT64"),
        ("64:ff9b:1:a00:0:500::", "local-use NAT64"),
        ("3fff::1", "documentation"),
        ("5f00::1", "segment routing"),
        ("4000::1", "reserved"),
        ("100::1", "discard-only"),
    ],
)
def test_ipv6_ranges_outside_global_unicast_are_refused_on_every_python(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch, address: str, words: str
) -> None:
    """IANA's non-global IPv6 ranges are refused by the policy's own table, not by
    whatever ``is_global`` the running Python's ``ipaddress`` knows (3.11.7 calls these
    global): as a literal (early and at the fetch) and as what a name resolves to."""
    parsed = ipaddress.IPv6Address(address)
    assert words in (address_refusal(parsed) or "")
    with pytest.raises(BlockedAddressError, match=words):
        Fetcher().check_url(f"http://[{address}]/")
    err = refused(f"http://[{address}]/")
    assert isinstance(err, BlockedAddressError)
    assert err.message.startswith(f"blocked address {parsed} ("), err.message
    server = serve(reply(b"inside"))

    def answer(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, int(port), 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", answer)
    err = refused(f"http://svc.test:{server.port}/")
    assert err.message.endswith("for host 'svc.test'"), err.message
    assert server.connections == 0
    # The operator can still name one on purpose.
    assert Guard([address]).refusal("svc.test", parsed) is None


@pytest.mark.parametrize(
    "address", ["192.0.0.0", "192.0.0.8", "192.0.0.11", "192.0.0.100", "192.0.0.171", "192.0.0.255"]
)
def test_ietf_protocol_assignments_are_refused_on_every_python(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch, address: str
) -> None:
    """IANA's 192.0.0.0/24 is not globally reachable (but for 192.0.0.9 and .10): refused
    by the policy's own IPv4 table, not by the running Python's ``is_global`` (3.11.7
    calls all of it global but .0/29 and .170/31), in every form that carries it."""
    parsed = ipaddress.IPv4Address(address)
    for form in (address, f"::ffff:{address}", f"64:ff9b::{address}"):
        why = address_refusal(ipaddress.ip_address(form)) or ""
        assert "IETF protocol assignments" in why, form
    six_to_four = ipaddress.IPv6Address((0x2002 << 112) | (int(parsed) << 80))
    assert "IETF protocol assignments" in (address_refusal(six_to_four) or "")
    err = refused(f"http://{address}/")
    assert isinstance(err, BlockedAddressError)
    assert err.message == f"blocked address {address} (IETF protocol assignments)"
    server = serve(reply(b"inside"))

    def answer(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    monkeypatch.setattr(socket, "getaddrinfo", answer)
    err = refused(f"http://svc.test:{server.port}/")
    assert err.message.endswith("for host 'svc.test'"), err.message
    assert server.connections == 0


@pytest.mark.parametrize("address", ["192.0.0.9", "192.0.0.10", "192.31.196.1", "8.8.8.8"])
def test_globally_reachable_special_ipv4_addresses_pass_on_every_python(address: str) -> None:
    """IANA marks PCP and TURN anycast (192.0.0.9, .10) and AS112 globally reachable:
    they pass whatever the running Python's ``is_global`` says (3.11.7 refuses .9, .10)."""
    assert address_refusal(ipaddress.IPv4Address(address)) is None
    assert address_refusal(ipaddress.IPv6Address(f"::ffff:{address}")) is None


def test_a_name_with_any_refused_address_is_refused(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every candidate address is judged: one refused answer refuses the name."""
    allowed = serve(reply(b"allowed"), host="127.0.0.2")

    def two(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", int(port))),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port))),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two)
    err = refused(f"http://two.test:{allowed.port}/", Fetcher(allow=["127.0.0.2"]))
    assert "blocked address 127.0.0.1" in err.message
    assert allowed.connections == 0


def test_an_explicit_proxy_is_used_and_the_environment_is_not(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """http_proxy in the environment is ignored; Fetcher(proxy=...) sends through it."""
    proxy = serve(reply(b"via proxy"))
    origin = serve(reply(b"direct"), host="127.0.0.2")
    monkeypatch.setenv("http_proxy", proxy.url)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    assert get(origin.url + "/x", Fetcher(allow=["127.0.0.2"])).content == "direct"
    assert proxy.connections == 0
    assert get(origin.url + "/x?q=1", Fetcher(proxy=proxy.url)).content == "via proxy"
    assert proxy.requests[0].startswith(f"GET {origin.url}/x?q=1 HTTP/1.1\r\n".encode())
    assert origin.connections == 1
    with pytest.raises(ValueError, match="proxy"):
        Fetcher(proxy="socks5://127.0.0.1:1080")


@pytest.mark.parametrize(
    "url", ["http://[::1/", "http://[::1]:x/", "http://example.org:99999/", "http://h:port/"]
)
def test_a_malformed_url_fails_its_target_as_a_fetch_error(url: str) -> None:
    """What urlsplit cannot take is a FetchError (the target fails, the API answers 422),
    never a ValueError escaping the fetcher."""
    with pytest.raises(batch.FetchError, match="invalid URL"):
        Fetcher().check_url(url)
    err = refused(url)
    assert type(err) is batch.FetchError
    assert err.message.startswith("invalid URL "), err.message
    assert err.hint == "check the URL"


def test_a_redirect_to_a_malformed_url_fails_the_target(serve: Callable[..., RawServer]) -> None:
    """A Location urljoin cannot take fails the target like any other bad redirect."""
    bouncer = serve(reply(b"", "302 Found", Location="http://[::1/inside"))
    err = refused(bouncer.url + "/", Fetcher(allow=LOOPBACK))
    assert type(err) is batch.FetchError
    assert err.message.startswith("invalid URL "), err.message


@pytest.mark.parametrize(
    "host",
    ["127\u30020\u30020\u30021", "127\uff0e0\uff0e0\uff0e1", "\u2460\u2461\u2466.0.0.1"],
)
def test_the_early_check_judges_the_host_the_fetch_would_connect_to(host: str) -> None:
    """Ideographic and fullwidth dots and circled digits become 127.0.0.1 through IDNA, as
    they do when the fetch connects: the early check refuses them too."""
    with pytest.raises(BlockedAddressError, match="loopback"):
        Fetcher().check_url(f"http://{host}/")
    with pytest.raises(BlockedAddressError, match="loopback"):
        get(f"http://{host}/")


def test_check_url_refuses_schemes_and_literal_addresses_only() -> None:
    """The early check (the HTTP API's 422) judges what it can without resolving."""
    strict = Fetcher()
    for url in ("http://127.0.0.1/", "https://[::1]/", "http://10.1.2.3:8080/x"):
        with pytest.raises(BlockedAddressError):
            strict.check_url(url)
    for url in ("file:///etc/passwd", "ftp://example.org/", "gopher://x/", "nope"):
        with pytest.raises(batch.FetchError, match="scheme"):
            strict.check_url(url)
    strict.check_url("https://example.org/")  # a name: judged when connected
    strict.check_url("http://8.8.8.8/")
    Fetcher(allow=["10.0.0.0/8"]).check_url("http://10.1.2.3/")
    with pytest.raises(batch.FetchError, match="no host"):
        strict.check_url("http:///path")


def test_allow_refuses_nonsense() -> None:
    """A typo in allow= is a ValueError at construction, not a silent no-op."""
    with pytest.raises(ValueError, match="neither a network nor a host name"):
        Guard(["10.0.0.0/33 "])
    with pytest.raises(TypeError):
        Guard("10.0.0.0/8")  # type: ignore[arg-type]
    assert Guard(["10.0.0.0/8"]).refusal("x", ipaddress.ip_address("10.9.9.9")) is None
    # A network allows the IPv4-mapped form of its addresses too.
    assert Guard(["10.0.0.0/8"]).refusal("x", ipaddress.ip_address("::ffff:10.9.9.9")) is None


# -- the classification, against ipaddress ----------------------------------------------------


def _expected_refused(address: Any) -> bool:
    """An independent statement of the policy in terms of ``ipaddress`` alone."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return _expected_refused(address.ipv4_mapped)
        if address in ipaddress.ip_network("64:ff9b::/96"):
            return _expected_refused(ipaddress.IPv4Address(address.packed[-4:]))
        if address.sixtofour is not None and _expected_refused(address.sixtofour):
            return True
        if address in ipaddress.ip_network("::/96") and address > ipaddress.ip_address("::1"):
            return True
        if address.is_site_local:
            return True
        # IANA: global unicast is 2000::/3 only; within it, the documentation ranges.
        if address not in ipaddress.ip_network("2000::/3"):
            return True
        if any(address in ipaddress.ip_network(n) for n in ("2001:db8::/32", "3fff::/20")):
            return True
        return not address.is_global or address.is_multicast
    # IPv4: IANA's special-purpose registry, its ranges not globally reachable (less the
    # two anycast addresses it marks reachable), and multicast; not ``is_global``, whose
    # table differs between Python releases.
    if address in (ipaddress.ip_address("192.0.0.9"), ipaddress.ip_address("192.0.0.10")):
        return False
    return any(address in ipaddress.ip_network(n) for n in _IANA_V4_NOT_GLOBAL)


_IANA_V4_NOT_GLOBAL = (
    *("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16"),
    *("172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15"),
    *("198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4", "255.255.255.255/32"),
    "224.0.0.0/4",  # multicast
)


v4 = st.ip_addresses(v=4)
v6 = st.ip_addresses(v=6)
embedded = st.one_of(
    v4.map(lambda a: ipaddress.IPv6Address(f"::ffff:{a}")),
    v4.map(lambda a: ipaddress.IPv6Address(f"64:ff9b::{a}")),
    v4.map(lambda a: ipaddress.IPv6Address((0x2002 << 112) | (int(a) << 80))),
)


@settings(max_examples=3000, deadline=None)
@given(st.one_of(v4, v6, st.ip_addresses(network="2000::/3"), embedded))
def test_classification_matches_ipaddress(address: Any) -> None:
    """Refused exactly when ipaddress says not global or multicast (embedded v4 judged)."""
    assert (address_refusal(address) is not None) == _expected_refused(address)


@settings(max_examples=1000, deadline=None)
@given(v4)
def test_every_inet_aton_spelling_parses_to_its_address(address: Any) -> None:
    """Hex, octal and short forms mean what the C resolver says they mean."""
    n = int(address)
    spellings = [
        str(n),
        hex(n),
        f"{n >> 24}.{n & 0xFFFFFF}",
        f"{n >> 24}.{(n >> 16) & 0xFF}.{n & 0xFFFF}",
        ".".join(f"0{int(p):o}" for p in str(address).split(".")),
    ]
    for text in spellings:
        assert parse_ip_literal(text) == address, text
        assert socket.inet_aton(text) == address.packed, text


def _numeric_host(text: str) -> bytes | None:
    """The IPv4 address the C resolver reads ``text`` as, if it is one (what a connect to
    that host would reach without asking DNS)."""
    try:
        infos = socket.getaddrinfo(text, None, socket.AF_INET, 0, 0, socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        return None
    return socket.inet_aton(infos[0][4][0])


@pytest.mark.parametrize(
    "text",
    [
        "0x-1",
        "0x-7f.1",
        "1.2.0x-1",
        "0x7_f.1",
        "0x+7f.1",
        "0x0x7f.1",
        "01_77.1",
        "+127.1",
        "0x",
        "0x.1",
        "08.1",
        " 1.2.3.4",
        "1.2.3.4 ",
        "0 1.2",
        "1.2.3.256",
        "1.2.65536",
        "1.16777216",
        "4294967296",
        "0x100.1",
        "00.0x0.0.0377",
        "0x7f.1",
        "127.1",
    ],
)
def test_literal_parsing_agrees_with_the_c_resolver(text: str) -> None:
    """Python's int() reads signs, underscores and white space that the C resolver does
    not: such a host is a name (or nothing), never an address, and the parser never
    raises."""
    parsed = parse_ip_literal(text)
    assert (parsed.packed if parsed is not None else None) == _numeric_host(text), text
    # Non-ASCII digits are a name's until IDNA has made them ASCII (as the fetch does).
    assert parse_ip_literal("\uff11\uff12\uff17.1") is None


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX._+- ", max_size=14))
def test_literal_parsing_agrees_with_the_c_resolver_on_any_text(text: str) -> None:
    """The same, for any text of digits, hex letters, dots, signs and underscores."""
    parsed = parse_ip_literal(text)
    assert (parsed.packed if parsed is not None else None) == _numeric_host(text), text


# -- one deadline, byte caps -------------------------------------------------------------------


def test_dripping_headers_cannot_outlast_the_deadline(serve: Callable[..., RawServer]) -> None:
    """A server dripping a header byte at a time is cut off at timeout=1, not per read."""

    def drip(conn: socket.socket, server: RawServer) -> None:
        server.send(conn, b"HTTP/1.1 200 OK\r\n")
        while not server.stop.wait(0.05):
            server.send(conn, b"X")

    server = serve(drip)
    started = time.monotonic()
    err = refused(server.url + "/", Fetcher(timeout=1, allow=LOOPBACK))
    took = time.monotonic() - started
    assert "timed out after 1 s" in err.message
    assert 0.9 < took < 1.6


def test_the_deadline_covers_every_redirect_hop(serve: Callable[..., RawServer]) -> None:
    """Slow hops add up: five 0.4 s redirects fail a timeout=1 fetch at about 1 s."""

    def slow_hop(conn: socket.socket, server: RawServer) -> None:
        if server.stop.wait(0.4):
            return
        n = int(server.requests[-1].split(b" ")[1].rsplit(b"/", 1)[1])
        reply(b"", "302 Found", Location=f"/hop/{n + 1}")(conn, server)

    server = serve(slow_hop)
    started = time.monotonic()
    err = refused(server.url + "/hop/0", Fetcher(timeout=1, allow=LOOPBACK))
    assert "timed out" in err.message
    assert time.monotonic() - started < 1.6
    assert server.connections <= 3


def test_a_stalled_tls_handshake_is_cut_at_the_deadline(serve: Callable[..., RawServer]) -> None:
    """https goes through the same guarded socket: a silent peer cannot stall the handshake."""
    # The server waits for an HTTP request head, which a ClientHello never completes: it
    # accepts and stays silent.
    server = serve(reply(b"never"))
    url = f"https://127.0.0.1:{server.port}/"
    assert isinstance(refused(url), BlockedAddressError)  # guarded like http
    started = time.monotonic()
    err = refused(url, Fetcher(timeout=1, allow=LOOPBACK))
    assert "timed out" in err.message
    assert time.monotonic() - started < 1.6


@pytest.mark.parametrize("via_proxy", [False, True], ids=["direct", "proxy"])
def test_a_slow_connect_leaves_the_tls_handshake_only_what_is_left(
    serve: Callable[..., RawServer], monkeypatch: pytest.MonkeyPatch, via_proxy: bool
) -> None:
    """The deadline covers connect and TLS handshake together: a connect that took 0.8 s
    of timeout=1 leaves the stalled handshake 0.2 s, not a fresh second (the handshake
    takes the socket's timeout whole, as it stood before the connect). Through a proxy
    the same holds after its CONNECT tunnel."""
    if via_proxy:

        def tunnel(conn: socket.socket, server: RawServer) -> None:
            server.send(conn, b"HTTP/1.1 200 Connection established\r\n\r\n")
            server.stop.wait(5)  # then silent: the ClientHello is never answered

        server = serve(tunnel)
        fetcher = Fetcher(timeout=1, proxy=server.url)
        url = "https://origin.test/"
    else:
        server = serve(reply(b"never"))  # waits for a request head: silent to TLS
        fetcher = Fetcher(timeout=1, allow=LOOPBACK)
        url = f"https://127.0.0.1:{server.port}/"
    real = socket.socket.connect

    def slow_connect(sock: socket.socket, address: Any) -> None:
        real(sock, address)
        if address[1] == server.port:
            time.sleep(0.8)  # as a server whose SYN queue is full answers late

    monkeypatch.setattr(socket.socket, "connect", slow_connect)
    started = time.monotonic()
    err = refused(url, fetcher)
    took = time.monotonic() - started
    assert "timed out" in err.message
    assert 0.9 < took < 1.5, took
    assert server.connections == 1


def _big(status: str, size: int, **headers: str) -> Callable[..., None]:
    def handler(conn: socket.socket, server: RawServer) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        lines = [f"HTTP/1.1 {status}", "Connection: close", "Content-Type: text/plain"]
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        server.send(conn, ("\r\n".join(lines) + "\r\n\r\n").encode())
        chunk = b"x" * 65536
        for _ in range(size // len(chunk)):
            server.send(conn, chunk)

    return handler


@pytest.mark.parametrize("declared", [True, False])
def test_a_redirect_body_is_never_read(serve: Callable[..., RawServer], declared: bool) -> None:
    """A 302 carrying 64 MiB is left unread: the server gets rid of far less than max_bytes."""
    final = serve(reply(b"landed"))
    size = 64 * 1024 * 1024
    headers = {"Location": final.url + "/end"}
    if declared:
        headers["Content-Length"] = str(size)
    bouncer = serve(_big("302 Found", size, **headers))
    result = get(bouncer.url + "/", Fetcher(max_bytes=1024 * 1024, allow=LOOPBACK, timeout=10))
    assert result.content == "landed"
    bouncer.wait_idle()  # its writes fail once our socket is closed
    assert bouncer.sent < 1024 * 1024, bouncer.sent


def test_an_unsized_body_is_read_only_to_the_cap(serve: Callable[..., RawServer]) -> None:
    """A body without Content-Length is cut at max_bytes, not drained."""
    server = serve(_big("200 OK", 64 * 1024 * 1024))
    err = refused(server.url + "/", Fetcher(max_bytes=1024 * 1024, allow=LOOPBACK, timeout=10))
    assert err.message == f"response is over {1024 * 1024} bytes"
    server.wait_idle()
    assert server.sent < 4 * 1024 * 1024, server.sent


def _flood(kind: str) -> Callable[..., None]:
    """A response whose body is small but whose framing never ends (or ends very late):
    endless ``100 Continue`` heads, 1-byte chunks each under a 60 KiB extension, or an
    endless trailer after a small chunked body."""

    def handler(conn: socket.socket, server: RawServer) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
        if kind == "continues":
            while not server.stop.is_set():
                server.send(conn, b"HTTP/1.1 100 Continue\r\n\r\n" * 2000)
        elif kind == "chunk-extensions":
            server.send(conn, head)
            for _ in range(900):  # 900 bytes of body in 54 MB of framing
                server.send(conn, b"1;" + b"e" * 60_000 + b"\r\nx\r\n")
            server.send(conn, b"0\r\n\r\n")
        else:
            server.send(conn, head + b"5\r\nhello\r\n0\r\n")
            while not server.stop.is_set():
                server.send(conn, b"X-Trailer: " + b"t" * 1000 + b"\r\n")

    return handler


@pytest.mark.parametrize("kind", ["continues", "chunk-extensions", "trailers"])
def test_framing_is_capped_as_the_body_is(serve: Callable[..., RawServer], kind: str) -> None:
    """Heads, chunk extensions and trailers are read through the same cap as the body (a
    little over ``max_bytes``): a server cannot make a fetch read gigabytes of them until
    its deadline, nor succeed after 54 MB of framing around a 900-byte body."""
    server = serve(_flood(kind))
    fetcher = Fetcher(max_bytes=1000, allow=LOOPBACK, timeout=20)
    started = time.monotonic()
    err = refused(server.url + "/", fetcher)
    cap = fetcher.max_bytes + fetcher.max_bytes // 4 + 1024 * 1024
    assert err.message == (
        f"response took over {cap} bytes on the wire, headers and framing included "
        "(its body may take 1000)"
    ), err.message
    assert time.monotonic() - started < 10
    server.stop.set()
    server.wait_idle()
    assert server.sent < fetcher.max_bytes + 4 * 1024 * 1024, server.sent


def test_a_chunked_body_of_small_chunks_is_read_whole(serve: Callable[..., RawServer]) -> None:
    """The cap on framing leaves room for an honest body sent in small chunks."""

    def chunks(conn: socket.socket, server: RawServer) -> None:
        head = b"HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
        server.send(conn, head + b"1\r\nx\r\n" * 1000 + b"0\r\n\r\n")

    server = serve(chunks)
    assert get(server.url + "/", Fetcher(max_bytes=1000, allow=LOOPBACK)).content == "x" * 1000


def test_a_refused_connection_says_the_server_may_be_down() -> None:
    """Nothing listening is a server down (retry later), not a wrong URL."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # bound, never listening: the port refuses
    err = refused(f"http://127.0.0.1:{port}/", Fetcher(allow=LOOPBACK))
    assert err.message == f"cannot reach 127.0.0.1:{port}: Connection refused"
    assert "retry later" in err.hint and "down" in err.hint


def test_grep_reads_a_text_body_served_as_bytes_and_refuses_a_binary_one(
    serve: Callable[..., RawServer],
) -> None:
    """``grep`` keeps lines of text: a UTF-8 body served as ``application/octet-stream``
    (Python's http.server, object stores by default) is searched as text, not as its
    base64; a body that is no text fails the target instead of answering nothing."""
    text = serve(reply(b"a\nprice: 3\ny\n", Content_Type="application/octet-stream"))
    target = batch.Target(text.url + "/b", batch.Options(grep="price"))
    result = Fetcher(allow=LOOPBACK)(target)
    assert result.content == "price: 3"
    assert "encoding" not in result.meta
    binary = serve(reply(b"\xff\xd8\xff price", Content_Type="image/jpeg"))
    with pytest.raises(batch.FetchError, match="grep needs a text body") as info:
        Fetcher(allow=LOOPBACK)(batch.Target(binary.url + "/p", batch.Options(grep="price")))
    assert "image/jpeg" in info.value.message
    # Without grep a binary body is still base64, whole.
    plain = Fetcher(allow=LOOPBACK)(batch.Target(binary.url + "/p"))
    assert plain.meta["encoding"] == "base64"


@pytest.mark.parametrize("charset", ["base64", "rot13", "undefined", "no-such-charset", "zlib"])
def test_an_unusable_charset_decodes_as_utf8(serve: Callable[..., RawServer], charset: str) -> None:
    """A charset Python cannot decode text with never crashes the fetch: UTF-8, replaced."""
    body = "café \xff".encode("latin-1")
    server = serve(reply(body, Content_Type=f"text/plain; charset={charset}"))
    result = get(server.url + "/", Fetcher(allow=LOOPBACK))
    assert result.content == "caf\ufffd \ufffd"


@pytest.mark.parametrize(
    ("charset", "body", "content"),
    [
        # Python codecs, but no charset a web page has: punycode's decoder is quadratic
        # (a 1 MB body took 22 s of CPU past the deadline), utf-7 and the escape codecs
        # decode to lone surrogates (then "result not storable").
        ("punycode", b"abc-", "abc-"),
        ("utf-7", b"a+2AA-b", "a+2AA-b"),
        ("unicode_escape", b"a\\ud800b", "a\\ud800b"),
        ("raw_unicode_escape", b"a\\ud800b", "a\\ud800b"),
        ("idna", b"xn--caf-dma", "xn--caf-dma"),
        # Charsets pages do declare decode as declared.
        ("windows-1252", "café".encode("cp1252"), "café"),
        ("iso-8859-2", "łódź".encode("iso-8859-2"), "łódź"),
        ("shift_jis", "日本".encode("shift_jis"), "日本"),
        ("utf-16", "hé".encode("utf-16"), "hé"),
        ("koi8-r", "мир".encode("koi8-r"), "мир"),
        # WHATWG's labels that Python does not know, and Latin-1 read as browsers do.
        ("windows-31j", "日本".encode("cp932"), "日本"),
        ("x-sjis", "日本".encode("cp932"), "日本"),
        ("windows-874", "ไทย".encode("cp874"), "ไทย"),
        ("x-mac-cyrillic", "мир".encode("mac-cyrillic"), "мир"),
        ("iso-8859-1", b"\x93caf\xe9\x94", "\u201ccafé\u201d"),
        ("us-ascii", b"\x93a\x94", "\u201ca\u201d"),
    ],
)
def test_only_the_charsets_of_the_web_are_decoded_as_declared(
    serve: Callable[..., RawServer], charset: str, body: bytes, content: str
) -> None:
    """Any other codec name decodes as UTF-8 (replaced), in time and storable."""
    server = serve(reply(body, Content_Type=f"text/html; charset={charset}"))
    result = get(server.url + "/", Fetcher(allow=LOOPBACK))
    assert result.content == content
    result.content.encode("utf-8")  # no lone surrogate


def test_a_content_length_of_non_ascii_digits_is_ignored_as_http_client_does(
    serve: Callable[..., RawServer],
) -> None:
    """``"²".isdigit()`` is True and ``int("²")`` raises: the fetch crashed with a
    ValueError instead of reading the body (or failing as a FetchError)."""

    def handler(conn: socket.socket, server: RawServer) -> None:
        head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: \xb2\r\n"
        server.send(conn, (head + "Connection: close\r\n\r\nbody").encode("latin-1"))

    server = serve(handler)
    assert get(server.url + "/", Fetcher(allow=LOOPBACK)).content == "body"


@pytest.mark.parametrize(
    ("location", "path"),
    [(b"/caf\xc3\xa9", "/caf%C3%A9"), (b"/caf\xe9", "/caf%E9"), (b"/a%20b", "/a%20b")],
)
def test_a_redirect_location_in_raw_bytes_is_followed_to_those_bytes(
    serve: Callable[..., RawServer], location: bytes, path: str
) -> None:
    """UTF-8 bytes in a Location header are the UTF-8 path they spell (http.client hands
    them over as latin-1 text, which was encoded again: /caf%C3%83%C2%A9); bytes that
    are not UTF-8 are sent percent-encoded as they came."""
    final = serve(reply(b"landed"))

    def bounce(conn: socket.socket, server: RawServer) -> None:
        head = b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:%d" % final.port
        server.send(conn, head + location + b"\r\nContent-Length: 0\r\n\r\n")

    bouncer = serve(bounce)
    assert get(bouncer.url + "/", Fetcher(allow=LOOPBACK)).content == "landed"
    assert final.requests[0].split(b" ")[1] == path.encode()


# -- file: -------------------------------------------------------------------------------------


def test_file_urls_are_refused_by_default(tmp_path: Path) -> None:
    """file: is off unless named in schemes; the hint says how to turn it on."""
    page = tmp_path / "p.txt"
    page.write_text("local")
    err = refused(page.as_uri())
    assert err.message == "URL scheme 'file' refused"
    assert get(page.as_uri(), Fetcher(schemes=("file",))).content == "local"


@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
def test_only_regular_files_are_read(tmp_path: Path, kind: str) -> None:
    """A FIFO (no writer), a device or a socket fails at once instead of blocking."""
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path = tmp_path / "sock"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
    outcome: list[BaseException | batch.Result] = []

    def attempt() -> None:
        try:
            outcome.append(get(path.as_uri(), Fetcher(schemes=("file",))))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(5)
    if kind == "fifo" and worker.is_alive():
        with open(path, "wb"):  # unblock the stuck open so the thread can end
            pass
    assert not worker.is_alive(), "the fetch blocked"
    assert isinstance(outcome[0], batch.FetchError)
    if kind != "socket":  # a socket cannot even be opened (ENXIO): failed all the same
        assert "not a regular file" in str(outcome[0])


# -- the jail itself ---------------------------------------------------------------------------


def test_the_jail_refuses_and_records_a_connect_beyond_loopback() -> None:
    """0.0.0.0 is not loopback to the jail (and would only reach this host if it failed)."""
    with socket.socket() as s, pytest.raises(NetJailError):
        s.connect(("0.0.0.0", 9))
    with pytest.raises(NetJailError):
        socket.create_connection(("0.0.0.0", 9), timeout=1)
    assert len(violations()) == 2
    clear()


def test_the_jail_covers_child_processes() -> None:
    """A Python child started with the suite's environment is jailed and reports back."""
    code = (
        "import socket\n"
        "try:\n    socket.create_connection(('0.0.0.0', 9), timeout=1)\n"
        "except RuntimeError as exc:\n    print(type(exc).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "NetJailError", done.stderr
    assert any("0.0.0.0" in v for v in violations())
    clear()
