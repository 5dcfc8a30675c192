"""A small TCP proxy on loopback that a test can sever and restore, the way Toxiproxy does.

The proxy listens on ``127.0.0.1`` (an ephemeral port) and forwards every connection to
one upstream address on loopback (the shared PostgreSQL or MariaDB server). A test cuts
the database away with :meth:`Proxy.sever`, which resets every open connection (the client
sees ``ECONNRESET``, the server sees its client go) and answers every new connection with
a reset, and brings it back with :meth:`Proxy.restore`. The servers themselves keep
running, so other tests that use them are not disturbed.

:meth:`Proxy.stall` is the silent kind of outage (a network partition): every connection
stays open but no byte moves in either direction, and new connections are accepted and
then never answered. :meth:`Proxy.stall_on` stalls at a chosen point of the client's
stream (say the chunk that carries ``COMMIT``), holding that chunk back.

The proxy can also listen on another local address than loopback (the host end of a veth
pair into a test's network namespace), still forwarding only to loopback.

The listening socket stays bound for the proxy's whole life (a severed proxy accepts and
resets), so its port never changes and no other process can take it meanwhile. Only
loopback addresses are accepted.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

from sqlalchemy.engine import make_url

__all__ = ["Proxy", "proxied"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_CHUNK = 65536


def _reset(sock: socket.socket) -> None:
    """Close a socket with an RST instead of a FIN (SO_LINGER with a zero timeout)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # Closing an fd does not wake a thread blocked in recv() on it (Linux); shutting down
    # the read side does, and sends nothing, so the peer still sees the RST of the close.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


class _Link:
    """One proxied connection: the client's socket, the upstream socket, two pumps."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self.flowing = threading.Event()  # cleared while the proxy is stalled
        self.flowing.set()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.flowing.set()  # wake pumps held by a stall so they can exit
            _reset(self.client)
            _reset(self.upstream)


class Proxy:
    """A threaded TCP proxy from ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``.

    Use it as a context manager (it is started on enter and stopped on exit) or call
    :meth:`start` and :meth:`close`.
    """

    def __init__(
        self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1"
    ) -> None:
        if upstream_host not in _LOOPBACK:
            raise ValueError(f"the proxy only forwards to loopback, not {upstream_host!r}")
        self.upstream = (
            "127.0.0.1" if upstream_host == "localhost" else upstream_host,
            upstream_port,
        )
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._severed = False
        self._stalled = False
        self._trigger: bytes | None = None
        self.triggered = threading.Event()  # set when stall_on's pattern went by
        self._stopping = threading.Event()
        self.listen_host = listen_host
        self._listener = socket.create_server((listen_host, 0), backlog=128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"proxy-accept-{self.port}", daemon=True
        )
        self.accepted = 0  # connections accepted in total (forwarded or reset)

    # -- control -----------------------------------------------------------------------

    def start(self) -> Proxy:
        """Start accepting connections."""
        self._accepter.start()
        return self

    def sever(self) -> None:
        """Reset every open connection and answer new ones with a reset, until restored."""
        with self._lock:
            self._severed = True
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.close()

    def stall(self) -> None:
        """Stop every byte in both directions, keeping connections open, until restored."""
        with self._lock:
            self._stalled = True
            for link in self._links:
                link.flowing.clear()

    def stall_on(self, pattern: bytes) -> threading.Event:
        """Stall every connection (as :meth:`stall`) when a client sends ``pattern``.

        The chunk that carries it is held back with everything after it, so the server
        never sees it unless the proxy is restored; :meth:`sever` drops it. Returns the
        event set when the pattern went by.
        """
        with self._lock:
            self._trigger = pattern
            self.triggered.clear()
        return self.triggered

    def _check_trigger(self, data: bytes) -> None:
        with self._lock:
            if self._trigger is None or self._trigger not in data:
                return
            self._trigger = None
            self._stalled = True
            for link in self._links:
                link.flowing.clear()
        self.triggered.set()

    def restore(self) -> None:
        """Forward connections again (stalled ones resume where they were)."""
        with self._lock:
            self._severed = False
            self._stalled = False
            self._trigger = None
            for link in self._links:
                link.flowing.set()

    @property
    def severed(self) -> bool:
        """Whether the proxy is cut."""
        return self._severed

    def open_links(self) -> int:
        """How many proxied connections are open."""
        with self._lock:
            return len(self._links)

    def close(self) -> None:
        """Stop accepting, reset every connection, and wait for the accept thread."""
        self._stopping.set()
        self.sever()
        if self._accepter.is_alive():
            self._accepter.join(5)
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "severed" if self._severed else "stalled" if self._stalled else "open"
        up = f"{self.upstream[0]}:{self.upstream[1]}"
        return f"<Proxy {self.listen_host}:{self.port} -> {up} {state}>"

    # -- threads -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            with self._lock:
                severed, stalled = self._severed, self._stalled
            if severed or self._stopping.is_set():
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            link = _Link(client, upstream)
            with self._lock:
                if self._severed:
                    link.close()
                    continue
                if self._stalled or stalled:
                    link.flowing.clear()
                self._links.add(link)
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump,
                    args=(link, src, dst, way == "up"),
                    name=f"proxy-{self.port}-{way}",
                    daemon=True,
                ).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while not link.closed.is_set():
                data = src.recv(_CHUNK)
                if not data:
                    break
                if up and self._trigger is not None:
                    self._check_trigger(data)
                # A stall holds the bytes here: nothing reaches the other side.
                while not link.flowing.wait(0.1):
                    if link.closed.is_set() or self._stopping.is_set():
                        return
                if link.closed.is_set():
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # One side went away: pass that on by closing both (as a dropped link would).
            with self._lock:
                self._links.discard(link)
            link.close()


@contextlib.contextmanager
def proxied(url: str) -> Iterator[tuple[Proxy, str]]:
    """A running proxy in front of the server of ``url``, and the URL through the proxy.

    The proxied URL names the same database, user and query, only the port differs.
    """
    u = make_url(url)
    host = u.host or "127.0.0.1"
    port = u.port or {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}[u.get_backend_name()]
    with Proxy(host, port) as proxy:
        yield proxy, u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
