"""The network jail: no test may connect anywhere but this machine's loopback.

A connection to an address outside 127.0.0.0/8 and ::1 fails loudly: the connect raises
:class:`NetJailError` at once (no packet is sent) and the attempt is recorded; the test
that made it then errors at teardown, even if the code under test swallowed the
exception (a fetcher turning it into a failed target, say). Name lookups of anything but
numeric hosts and ``localhost`` fail too (as an unknown name does), so no DNS query leaves.

Covered: ``socket.socket.connect`` / ``connect_ex`` (so also ``SSLSocket``, asyncio,
``http.client``, ``urllib``, PyMySQL), ``socket.create_connection``, ``sendto`` /
``sendmsg`` of UDP, and ``socket.getaddrinfo``, in this process; and in every Python
child process the suite starts with the inherited environment (the CLI, gunicorn
workers, crash and process workers), through ``sitecustomize`` in ``tests/_netjail_site``
(put first on ``PYTHONPATH``), which installs the same jail and appends violations to
the file named by ``BATCH_NETJAIL_LOG``. Not covered: C libraries that open their own
sockets (libpq, for psycopg); their servers are given as 127.0.0.1 by the suite.

Use: ``from _netjail import netjail, netjail_check  # noqa: F401`` in ``conftest.py``
(both fixtures are autouse).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["NetJailError", "install", "netjail", "netjail_check", "violations"]

ENV_ON = "BATCH_NETJAIL"
ENV_LOG = "BATCH_NETJAIL_LOG"
# Networks of the tests' own hosts (a network namespace a test made, e.g. _netns.Namespace):
# comma-separated, set by that test for the processes it runs there.
ENV_ALLOW = "BATCH_NETJAIL_ALLOW"
SITE_DIR = str(Path(__file__).parent / "_netjail_site")

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_lock = threading.Lock()
_violations: list[str] = []
_installed: dict[str, Any] = {}


class NetJailError(RuntimeError):
    """A test tried to reach beyond loopback; nothing was sent."""


def violations() -> list[str]:
    """The attempts recorded so far in this process (and its children, via the log)."""
    with _lock:
        out = list(_violations)
    log = os.environ.get(ENV_LOG)
    if log and os.path.exists(log):
        out += [line for line in Path(log).read_text().splitlines() if line]
    return out


def clear() -> None:
    """Forget recorded attempts (after a test that made one on purpose)."""
    with _lock:
        _violations.clear()
    log = os.environ.get(ENV_LOG)
    if log and os.path.exists(log):
        Path(log).write_text("")


def _record(what: str) -> NetJailError:
    message = f"netjail: {what} refused (only 127.0.0.0/8 and ::1 may be reached in tests)"
    log = os.environ.get(ENV_LOG)
    try:
        if not log:
            raise OSError("no log")
        with _lock, open(log, "a", encoding="utf-8") as fh:
            fh.write(f"[pid {os.getpid()}] {message}\n")
    except OSError:
        with _lock:
            _violations.append(message)
    return NetJailError(message)


def _is_local_ip(text: str) -> bool:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return True
    own = [n for n in os.environ.get(ENV_ALLOW, "").split(",") if n.strip()]
    return any(address in ipaddress.ip_network(n.strip(), strict=False) for n in own)


def _check_address(family: int, address: Any, what: str) -> None:
    if family not in (socket.AF_INET, socket.AF_INET6):
        return  # AF_UNIX, netlink...: local by nature
    host = str(address[0]) if isinstance(address, tuple) and address else str(address)
    if _is_local_ip(host) or host.lower() in _LOCAL_NAMES:
        return
    raise _record(f"{what} to {address!r}")


def install() -> None:
    """Patch the socket module (idempotent; stays for the life of the process)."""
    if _installed:
        return
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_sendto = socket.socket.sendto
    real_sendmsg = socket.socket.sendmsg
    real_create = socket.create_connection
    real_getaddrinfo = socket.getaddrinfo

    def connect(self: socket.socket, address: Any) -> None:
        _check_address(self.family, address, "connect")
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _check_address(self.family, address, "connect_ex")
        return real_connect_ex(self, address)

    def sendto(self: socket.socket, data: Any, *args: Any) -> int:
        address = args[-1]
        _check_address(self.family, address, "sendto")
        return real_sendto(self, data, *args)  # type: ignore[call-arg]

    def sendmsg(self: socket.socket, buffers: Any, *args: Any) -> int:
        if len(args) >= 3 and args[2] is not None:
            _check_address(self.family, args[2], "sendmsg")
        return real_sendmsg(self, buffers, *args)

    def create_connection(address: Any, *args: Any, **kw: Any) -> socket.socket:
        host = str(address[0])
        if not (_is_local_ip(host) or host.lower() in _LOCAL_NAMES):
            raise _record(f"create_connection to {address!r}")
        return real_create(address, *args, **kw)

    def getaddrinfo(host: Any, *args: Any, **kw: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name is None or str(name).lower() in _LOCAL_NAMES:
            return real_getaddrinfo(host, *args, **kw)
        flags = kw.get("flags", args[4] if len(args) > 4 else 0)
        try:
            # Numeric hosts need no query: let the C library parse them as it would.
            return real_getaddrinfo(host, *args[:4], flags=flags | socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        # An unknown name, as far as tests are concerned: no DNS query leaves the box.
        raise socket.gaierror(socket.EAI_NONAME, f"netjail: no name resolution of {name!r}")

    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    socket.socket.sendto = sendto  # type: ignore[method-assign, assignment]
    socket.socket.sendmsg = sendmsg  # type: ignore[method-assign]
    socket.create_connection = create_connection  # type: ignore[assignment]
    socket.getaddrinfo = getaddrinfo
    _installed.update(
        connect=real_connect,
        connect_ex=real_connect_ex,
        sendto=real_sendto,
        sendmsg=real_sendmsg,
        create_connection=real_create,
        getaddrinfo=real_getaddrinfo,
    )


def _export_to_children(log: str) -> None:
    os.environ[ENV_ON] = "1"
    os.environ[ENV_LOG] = log
    path = os.environ.get("PYTHONPATH", "")
    if SITE_DIR not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, path) if p)


# The fixtures exist only under pytest: a child process installs the jail through
# sitecustomize and must not pay for importing pytest.
if "pytest" in sys.modules:
    import pytest

    @pytest.fixture(scope="session", autouse=True)
    def netjail() -> Iterator[None]:
        """Jail this process and every Python child the suite starts (see the module doc)."""
        install()
        if ENV_LOG not in os.environ:
            fd, log = tempfile.mkstemp(prefix="netjail-", suffix=".log")
            os.close(fd)
            _export_to_children(log)
        else:
            _export_to_children(os.environ[ENV_LOG])
        yield

    @pytest.fixture(autouse=True)
    def netjail_check(netjail: None) -> Iterator[None]:
        """Error the test that tried to leave loopback, even if the attempt was swallowed."""
        clear()
        yield
        seen = violations()
        clear()
        if seen:
            pytest.fail("\n".join(["the network jail refused connections:", *seen]), pytrace=False)
