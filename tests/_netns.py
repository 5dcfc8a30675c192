"""A network namespace joined to this one by a veth pair, whose link a test can cut.

The namespace holds one end of the pair and nothing else: no default route, so a process
in it can reach only the host end's address, on a private /30 that exists only on this
pair (traffic never leaves the machine). :meth:`Namespace.partition` drops every packet
on both ends, the way a real network partition does (no reset, no ICMP): with ``tc``'s
``netem loss 100%`` where the kernel has netem, else with the ``blackhole`` qdisc, which
drops the same packets the same silent way. :meth:`Namespace.heal` undoes it.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not when they are
missing, for a skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

__all__ = ["Namespace", "unavailable"]

# 10.241.0.0/16 holds the /30s; each namespace takes one chosen by the test's pid.
_POOL = ipaddress.ip_network("10.241.0.0/16")


def unavailable() -> str | None:
    """Why a namespace cannot be made here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found)"
    return None


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=20)


class Namespace:
    """A namespace ``name`` with ``client_ip``, reaching this namespace at ``host_ip``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(1)}"
        self.name = f"dcache-test-{tag}"
        self.host_if = f"dch{tag}"
        self.client_if = f"dcn{tag}"
        subnets = list(_POOL.subnets(new_prefix=30))
        self.subnet = subnets[(os.getpid() * 7 + secrets.randbelow(64)) % len(subnets)]
        first, second = list(self.subnet.hosts())
        self.host_ip, self.client_ip = str(first), str(second)
        self.dropping = False

    def __enter__(self) -> Namespace:
        in_use = _run("ip", "-o", "addr").stdout
        assert f" {self.host_ip}/" not in in_use, f"{self.subnet} is already in use here"
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.client_if)
            _run("ip", "link", "set", self.client_if, "netns", self.name)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            self._in_ns("ip", "addr", "add", f"{self.client_ip}/30", "dev", self.client_if)
            self._in_ns("ip", "link", "set", self.client_if, "up")
            self._in_ns("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in_ns(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", self.name, *argv)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` inside the namespace (``ip netns exec``)."""
        # The network jail (tests/_netjail.py) lets the child reach this test's own hosts.
        env = dict(kwargs.pop("env", None) or os.environ)
        env["BATCH_NETJAIL_ALLOW"] = str(self.subnet)
        argv = ["ip", "netns", "exec", self.name, *argv]
        return subprocess.Popen(argv, text=True, env=env, **kwargs)

    def partition(self) -> str:
        """Drop every packet on both ends of the pair; returns the qdisc used."""
        used = ""
        for run, dev in ((_run, self.host_if), (self._in_ns, self.client_if)):
            try:
                run("tc", "qdisc", "add", "dev", dev, "root", "netem", "loss", "100%")
                used = "netem loss 100%"
            except subprocess.CalledProcessError as exc:
                if "unknown" not in (exc.stderr or "").lower():
                    raise
                # This kernel was built without netem: blackhole drops every packet too.
                run("tc", "qdisc", "add", "dev", dev, "root", "blackhole")
                used = "blackhole"
        self.dropping = True
        return used

    def heal(self) -> None:
        """Let packets through again."""
        for run, dev in ((_run, self.host_if), (self._in_ns, self.client_if)):
            with contextlib.suppress(subprocess.CalledProcessError):
                run("tc", "qdisc", "del", "dev", dev, "root")
        self.dropping = False

    def close(self) -> None:
        """Remove the qdiscs, the pair and the namespace (each step even if one fails)."""
        with contextlib.suppress(Exception):
            self.heal()
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "del", self.name)  # takes its end of the pair along
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "link", "del", self.host_if)
