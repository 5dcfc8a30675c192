"""A loopback TCP proxy that knows where statements and COMMITs are, and cuts there.

:class:`WireProxy` forwards one protocol (PostgreSQL's frontend/backend protocol v3, or
MySQL's client/server protocol) between a client on ``127.0.0.1`` and one upstream server
on loopback, reading just enough of each byte stream to see *statement boundaries*:

- PostgreSQL: a simple query (``Q``), or an extended-protocol group (``P``/``B``/``D``/
  ``E``/``C``... closed by ``S`` Sync, which is how psycopg 3 sends parametrised queries);
  each is answered by exactly one ``ReadyForQuery`` (``Z``), which ends its reply.
- MySQL: one client command (a logical packet with sequence id 0: ``COM_QUERY``,
  ``COM_PING``...); its reply ends with the OK/ERR packet, or a result set's last EOF.
  PyMySQL sends ``COMMIT`` as ``COM_QUERY "COMMIT"``.

While *armed* (:meth:`WireProxy.arm`) it numbers the statements of every connection in
the order they reach it (1, 2, ...) and records each one (:class:`Unit`). Given a
:class:`Cut`, at statement ``n`` it does one of:

- ``before``: drops the statement and resets the connection (the server never sees it);
- ``after``: forwards it, forwards its whole reply, then resets the connection;
- ``commit`` (statements that commit: COMMIT, and on PostgreSQL a write sent while the
  session is in no transaction block, an implicit transaction the server commits at its
  Sync): forwards it, waits until the server has answered (so the commit happened), drops
  the answer and resets the connection: the client cannot know whether its commit took
  effect.

With ``action="exit"`` the proxy ends its whole process with ``os._exit`` at the cut
instead (a crash at that statement; for ``after`` and ``commit`` once the server has
answered, so the statement took effect); a child process uses that to die with a
committed-or-not write.

The proxy only forwards to loopback. It is not a general parser: it understands what
psycopg 3 and PyMySQL send (no TLS, no COPY, no compression); a URL through it turns TLS
and GSS encryption off (:func:`wire_url`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections import deque
from typing import Literal

import attrs
from sqlalchemy.engine import make_url

__all__ = ["EXIT_CODE", "KINDS", "Cut", "Unit", "WireProxy", "wire_url"]

KINDS = ("before", "after", "commit")
EXIT_CODE = 77  # the exit status of a process the proxy (or a hook) killed at a cut
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_CHUNK = 65536
_PG_SSL = 80877103
_PG_GSS = 80877104
_MY_MORE_RESULTS = 0x0008
_MY_DEPRECATE_EOF = 1 << 24
_MY_QUIT = 0x01
_MY_QUERY = 0x03
_MY_PING = 0x0E


@attrs.frozen
class Cut:
    """Where to cut: at statement ``n`` (1-based, counted while armed), how."""

    n: int
    kind: Literal["before", "after", "commit"]


@attrs.define
class Unit:
    """One statement the proxy saw while armed."""

    n: int
    link: int  # which connection (in the order the proxy accepted them)
    text: str  # the SQL (or the command's name), shortened
    commit: bool


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), waking a thread blocked in recv on it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


def _is_commit(sql: str) -> bool:
    words = sql.strip().rstrip(";").split()
    return bool(words) and words[0].upper() in ("COMMIT", "END")


def _writes(sql: str) -> bool:
    """Whether a statement may change data (so, outside a transaction block, commits it)."""
    words = sql.strip().split(maxsplit=1)
    return bool(words) and words[0].upper() in ("WITH", "UPDATE", "INSERT", "DELETE")


def _short(sql: str) -> str:
    s = " ".join(sql.split())
    return s if len(s) <= 120 else s[:117] + "..."


def _lenenc(buf: bytes, pos: int) -> tuple[int, int]:
    """A MySQL length-encoded integer at ``pos``: (value, next position)."""
    first = buf[pos]
    if first < 0xFB:
        return first, pos + 1
    size = {0xFC: 2, 0xFD: 3, 0xFE: 8}.get(first, 0)
    return int.from_bytes(buf[pos + 1 : pos + 1 + size], "little"), pos + 1 + size


class _Link:
    """One proxied connection and its protocol state (pumps: up and down)."""

    def __init__(self, ordinal: int, client: socket.socket, upstream: socket.socket) -> None:
        self.ordinal = ordinal
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self.lock = threading.Lock()
        # Statements sent upstream and not yet answered, oldest first: (number, cut kind).
        self.waiting: deque[str | None] = deque()
        # Set once a cut is due on this connection: nothing more is forwarded upstream.
        self.frozen = False
        # PostgreSQL: the frontend is in its untyped start-up phase; raw bytes the
        # backend owes for an SSL/GSS request; prepared statement texts by name.
        self.startup = True
        self.raw_replies = 0
        self.prepared: dict[bytes, str] = {}
        self.last_text = "<extended>"
        # Whether the last ReadyForQuery said the session is in no transaction block.
        self.idle = True
        # MySQL: capability flag of the session; reply parser state.
        self.deprecate_eof = False
        self.reply_state: tuple[str, int] = ("first", 0)

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            _reset(self.client)
            _reset(self.upstream)


class WireProxy:
    """A statement-aware TCP proxy from ``127.0.0.1:<port>`` to a loopback server.

    Args:
        protocol: ``"postgresql"`` or ``"mysql"``.
        upstream_host: the server's host (loopback only).
        upstream_port: the server's port.
        action: ``"reset"`` (cut the connection) or ``"exit"`` (end this process).
    """

    def __init__(
        self,
        protocol: str,
        upstream_host: str,
        upstream_port: int,
        *,
        action: Literal["reset", "exit"] = "reset",
    ) -> None:
        if upstream_host not in _LOOPBACK:
            raise ValueError(f"the proxy only forwards to loopback, not {upstream_host!r}")
        if protocol not in ("postgresql", "mysql"):
            raise ValueError(f"unknown protocol {protocol!r}")
        self.protocol = protocol
        self.action = action
        self.upstream = (
            "127.0.0.1" if upstream_host == "localhost" else upstream_host,
            upstream_port,
        )
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._ordinal = 0
        self._armed = False
        self._cut: Cut | None = None
        self._count = 0
        self._units: list[Unit] = []
        self._fired: Unit | None = None
        self._stopping = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._accepter = threading.Thread(
            target=self._accept_loop, name=f"wireproxy-{self.port}", daemon=True
        )

    # -- control -----------------------------------------------------------------------

    def start(self) -> WireProxy:
        """Start accepting connections."""
        self._accepter.start()
        return self

    def arm(self, cut: Cut | None = None) -> None:
        """Start numbering statements from 1 (and cut at ``cut`` if given)."""
        if cut is not None and cut.kind not in KINDS:
            raise ValueError(f"unknown cut kind {cut.kind!r}")
        with self._lock:
            self._armed = True
            self._cut = cut
            self._count = 0
            self._units = []
            self._fired = None

    def disarm(self) -> tuple[list[Unit], Unit | None]:
        """Stop numbering; return the statements seen and the one cut (None: no cut)."""
        with self._lock:
            self._armed = False
            self._cut = None
            return list(self._units), self._fired

    def reset_all(self) -> None:
        """Reset every open connection (a test's clean slate between trials)."""
        with self._lock:
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.close()

    def close(self) -> None:
        """Stop accepting, reset every connection, wait for the accept thread."""
        self._stopping.set()
        self.reset_all()
        if self._accepter.is_alive():
            self._accepter.join(5)
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> WireProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- accepting and pumping ---------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._ordinal += 1
                link = _Link(self._ordinal, client, upstream)
                self._links.add(link)
            threading.Thread(
                target=self._pump_up, args=(link,), name=f"wireproxy-{self.port}-up", daemon=True
            ).start()
            threading.Thread(
                target=self._pump_down,
                args=(link,),
                name=f"wireproxy-{self.port}-down",
                daemon=True,
            ).start()

    def _drop(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.close()

    def _kill(self, link: _Link) -> None:
        """The cut itself: reset the connection, or end the process."""
        if self.action == "exit":
            os._exit(EXIT_CODE)
        self._drop(link)

    def _statement(self, link: _Link, text: str, commit: bool) -> str | None:
        """Number a statement about to go upstream; return the cut to apply, if any."""
        with self._lock:
            if not self._armed:
                return None
            self._count += 1
            unit = Unit(self._count, link.ordinal, _short(text), commit)
            self._units.append(unit)
            cut = self._cut
            if cut is None or cut.n != self._count or self._fired is not None:
                return None
            if cut.kind == "commit" and not commit:
                return None
            self._fired = unit
            return cut.kind

    def _pump_up(self, link: _Link) -> None:
        buf = bytearray()
        try:
            while not link.closed.is_set():
                data = link.client.recv(_CHUNK)
                if not data:
                    break
                with link.lock:
                    frozen = link.frozen
                if frozen:
                    continue  # a cut is due: the server must see nothing after its statement
                buf += data
                out = (
                    self._up_pg(link, buf)
                    if self.protocol == "postgresql"
                    else self._up_my(link, buf)
                )
                if out is None:
                    return  # cut before a statement
                if out:
                    link.upstream.sendall(out)
        except OSError:
            pass
        finally:
            self._drop(link)

    def _pump_down(self, link: _Link) -> None:
        buf = bytearray()
        try:
            while not link.closed.is_set():
                data = link.upstream.recv(_CHUNK)
                if not data:
                    break
                buf += data
                out, cut = (
                    self._down_pg(link, buf)
                    if self.protocol == "postgresql"
                    else self._down_my(link, buf)
                )
                if cut == "after":
                    link.client.sendall(out)
                    self._kill(link)
                    return
                if cut == "commit":
                    self._kill(link)  # the server committed; the client never hears of it
                    return
                if out:
                    link.client.sendall(out)
        except OSError:
            pass
        finally:
            self._drop(link)

    @staticmethod
    def _queue(link: _Link, kind: str | None) -> None:
        """A statement went upstream; its reply (in order) is awaited, maybe for a cut."""
        with link.lock:
            link.waiting.append(kind)
            if kind is not None:
                # Nothing more goes upstream on this connection: the cut follows its reply.
                link.frozen = True

    @staticmethod
    def _answered(link: _Link) -> str | None:
        """One reply has ended: the cut kind to apply after it, if any."""
        with link.lock:
            return link.waiting.popleft() if link.waiting else None

    # -- PostgreSQL --------------------------------------------------------------------

    def _up_pg(self, link: _Link, buf: bytearray) -> bytes | None:
        """Consume complete frontend messages from ``buf``; return the bytes to forward."""
        out = bytearray()
        while True:
            if link.startup:
                if len(buf) < 4:
                    break
                size = struct.unpack("!I", buf[:4])[0]
                if len(buf) < size:
                    break
                code = struct.unpack("!I", buf[4:8])[0] if size >= 8 else 0
                out += buf[:size]
                del buf[:size]
                if code in (_PG_SSL, _PG_GSS):
                    with link.lock:
                        link.raw_replies += 1  # the backend answers with one raw byte
                else:
                    link.startup = False
                continue
            if len(buf) < 5:
                break
            kind = buf[0:1]
            size = struct.unpack("!I", buf[1:5])[0]
            if len(buf) < 1 + size:
                break
            msg = bytes(buf[: 1 + size])
            if kind == b"P":
                body = msg[5:]
                name, _, rest = bytes(body).partition(b"\x00")
                query = rest.partition(b"\x00")[0].decode("utf-8", "replace")
                link.prepared[name] = query
                link.last_text = query
            if kind in (b"Q", b"S"):
                # The group this message closes is one statement: hold everything of it
                # (``out`` since the last boundary) until the decision is made.
                text = self._pg_text(link, out + msg if kind == b"S" else msg)
                # Outside a transaction block, an extended-protocol group is an implicit
                # transaction: a write in it commits at its Sync.
                implicit = kind == b"S" and link.idle and _writes(text)
                cut = self._statement(link, text, _is_commit(text) or implicit)
                if cut == "before":
                    self._kill(link)
                    return None
                self._queue(link, cut)
                out += msg
                del buf[: 1 + size]
                # Forward the group now: its reply is what the client waits for.
                link.upstream.sendall(bytes(out))
                out = bytearray()
                if cut is not None:
                    buf.clear()  # the connection dies after this statement's reply
                    break
                continue
            out += msg
            del buf[: 1 + size]
            if kind == b"H":
                # A Flush asks for replies before any Sync: forward what we hold.
                link.upstream.sendall(bytes(out))
                out = bytearray()
        return bytes(out)

    @staticmethod
    def _pg_text(link: _Link, group: bytes) -> str:
        """The SQL of a ``Q`` message, or of the statement an extended group executes."""
        if group[:1] == b"Q":
            return group[5:].rstrip(b"\x00").decode("utf-8", "replace")
        pos, text = 0, link.last_text
        while pos + 5 <= len(group):
            kind = group[pos : pos + 1]
            size = struct.unpack("!I", group[pos + 1 : pos + 5])[0]
            body = group[pos + 5 : pos + 1 + size]
            if kind == b"P":
                rest = body.partition(b"\x00")[2]
                text = rest.partition(b"\x00")[0].decode("utf-8", "replace")
            elif kind == b"B":
                stmt = body.partition(b"\x00")[2].partition(b"\x00")[0]
                text = link.prepared.get(bytes(stmt), text)
                link.last_text = text
            pos += 1 + size
        return text

    def _down_pg(self, link: _Link, buf: bytearray) -> tuple[bytes, str | None]:
        """Consume complete backend messages; stop right after a reply a cut waits for."""
        out = bytearray()
        while True:
            with link.lock:
                raw = link.raw_replies
                if raw and buf:
                    link.raw_replies -= 1
            if raw and buf:
                out += buf[:1]
                del buf[:1]
                continue
            if len(buf) < 5:
                return bytes(out), None
            size = struct.unpack("!I", buf[1:5])[0]
            if len(buf) < 1 + size:
                return bytes(out), None
            kind = buf[0:1]
            msg = bytes(buf[: 1 + size])
            del buf[: 1 + size]
            if kind == b"Z":
                link.idle = msg[5:6] == b"I"
                cut = self._answered(link)
                if cut is not None:
                    return bytes(out + msg) if cut == "after" else bytes(out), cut
            out += msg

    # -- MySQL -------------------------------------------------------------------------

    @staticmethod
    def _my_packet(buf: bytearray) -> tuple[bytes, int, bytes] | None:
        """Take one logical packet (joined across 16 MiB parts): (raw bytes, seq, payload)."""
        pos, payload, seq = 0, bytearray(), -1
        while True:
            if len(buf) < pos + 4:
                return None
            size = int.from_bytes(buf[pos : pos + 3], "little")
            if seq < 0:
                seq = buf[pos + 3]
            if len(buf) < pos + 4 + size:
                return None
            payload += buf[pos + 4 : pos + 4 + size]
            pos += 4 + size
            if size < 0xFFFFFF:
                raw = bytes(buf[:pos])
                del buf[:pos]
                return raw, seq, bytes(payload)

    def _up_my(self, link: _Link, buf: bytearray) -> bytes | None:
        out = bytearray()
        while (packet := self._my_packet(buf)) is not None:
            raw, seq, payload = packet
            if seq != 0 or not payload:
                # Authentication: the handshake response (seq 1) carries the capabilities.
                if seq == 1 and len(payload) >= 4:
                    flags = int.from_bytes(payload[:4], "little")
                    link.deprecate_eof = bool(flags & _MY_DEPRECATE_EOF)
                out += raw
                continue
            cmd = payload[0]
            if cmd == _MY_QUIT:
                out += raw
                continue
            if cmd == _MY_QUERY:
                text = payload[1:].decode("utf-8", "replace")
            elif cmd == _MY_PING:
                text = "COM_PING"
            else:
                text = f"COM_{cmd:#04x}"
            cut = self._statement(link, text, cmd == _MY_QUERY and _is_commit(text))
            if cut == "before":
                self._kill(link)
                return None
            self._queue(link, cut)
            out += raw
            link.upstream.sendall(bytes(out))
            out = bytearray()
            if cut is not None:
                buf.clear()  # the connection dies after this statement's reply
                break
        return bytes(out)

    def _my_reply_ends(self, link: _Link, payload: bytes) -> bool:
        """Feed one server packet of a reply to the parser; True when the reply ended."""
        state, left = link.reply_state
        head = payload[0] if payload else 0
        if state == "first":
            if head == 0x00 or (head == 0xFE and len(payload) < 9):
                return not self._my_more(payload)
            if head in (0xFF, 0xFB):
                return True
            ncols, _ = _lenenc(payload, 0)
            link.reply_state = ("cols", ncols)
            return False
        if state == "cols":
            left -= 1
            if left > 0:
                link.reply_state = ("cols", left)
            elif link.deprecate_eof:
                link.reply_state = ("rows", 0)
            else:
                link.reply_state = ("coleof", 0)
            return False
        if state == "coleof":
            link.reply_state = ("rows", 0)
            return False
        # rows
        if head == 0xFF:
            link.reply_state = ("first", 0)
            return True
        if head == 0xFE and len(payload) < (0xFFFFFF if link.deprecate_eof else 9):
            link.reply_state = ("first", 0)
            return not self._my_more(payload)
        return False

    @staticmethod
    def _my_more(payload: bytes) -> bool:
        """Whether an OK/EOF packet says another result set follows."""
        if payload[0] == 0xFE and len(payload) >= 5:
            status = int.from_bytes(payload[3:5], "little")
        else:
            _rows, pos = _lenenc(payload, 1)
            _last, pos = _lenenc(payload, pos)
            status = (
                int.from_bytes(payload[pos : pos + 2], "little") if len(payload) >= pos + 2 else 0
            )
        return bool(status & _MY_MORE_RESULTS)

    def _down_my(self, link: _Link, buf: bytearray) -> tuple[bytes, str | None]:
        out = bytearray()
        while (packet := self._my_packet(buf)) is not None:
            raw, _seq, payload = packet
            with link.lock:
                replying = bool(link.waiting)
            if not replying:
                out += raw  # the greeting and authentication
                continue
            if self._my_reply_ends(link, payload):
                link.reply_state = ("first", 0)
                cut = self._answered(link)
                if cut is not None:
                    return bytes(out + raw) if cut == "after" else bytes(out), cut
            out += raw
        return bytes(out), None


def wire_url(url: str, port: int) -> str:
    """``url`` pointed at a :class:`WireProxy` on ``port`` (PostgreSQL: no TLS, no GSS)."""
    u = make_url(url).set(host="127.0.0.1", port=port)
    if u.get_backend_name() == "postgresql":
        u = u.update_query_dict({"sslmode": "disable", "gssencmode": "disable"})
    return u.render_as_string(hide_password=False)


def upstream_of(url: str) -> tuple[str, str, int]:
    """(protocol, host, port) of a server URL."""
    u = make_url(url)
    backend = u.get_backend_name()
    protocol = "postgresql" if backend == "postgresql" else "mysql"
    port = u.port or (5432 if protocol == "postgresql" else 3306)
    return protocol, u.host or "127.0.0.1", port
