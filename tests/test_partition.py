"""A real network partition: the client in a network namespace, its packets dropped.

The proxy tests (``test_faults.py``, ``test_io_timeout.py``) imitate a silent server in
user space; here the kernel drops the packets. The store's client runs in a subprocess
inside a network namespace (``_netns.Namespace``) and reaches the shared server through
a veth pair and a forwarder bound to the pair's host end (the servers listen on loopback
only). Once the client holds pooled connections, every packet on the pair is dropped and
each request path must fail with ``StoreUnavailableError`` within ``io_timeout`` + 2 s:
PyMySQL's read timeout, libpq's ``tcp_user_timeout`` and the client-side deadline see to
it. Needs root and iproute2; skipped (with the reason) without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _netns import Namespace, unavailable
from _proxy import Proxy
from conftest import backend_url, wipe
from sqlalchemy.engine import make_url

import dcache

IO_TIMEOUT = 2.0
CHILD = Path(__file__).with_name("_partition_child.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=str(unavailable())),
]


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's next stdout line, or a failure after ``timeout`` seconds."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if not got or not got[0]:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the child said nothing within {timeout} s; stderr:\n{err}")
    return got[0]


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"])
def test_requests_fail_fast_when_the_network_drops_every_packet(
    backend: str, tmp_path: Path
) -> None:
    """A partition (no reset, no answer, not even an ACK) costs each request a 503 in seconds."""
    url = make_url(backend_url(backend, tmp_path))
    direct = dcache.DB.open(url.render_as_string(hide_password=False))
    try:
        wipe(direct)
    finally:
        direct.close()
    with (
        Namespace() as ns,
        Proxy(url.host or "127.0.0.1", url.port or 0, listen_host=ns.host_ip) as fwd,
    ):
        through = url.set(host=ns.host_ip, port=fwd.port).render_as_string(hide_password=False)
        proc = ns.popen(
            [sys.executable, str(CHILD), through, str(IO_TIMEOUT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert read_line(proc, 60).strip() == "ready"
            how = ns.partition()
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            outcome = json.loads(read_line(proc, IO_TIMEOUT + 30))
        finally:
            ns.heal()
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
    assert set(outcome) == {"status", "job", "jobs", "submit", "cancel"}
    for name, seen in outcome.items():
        assert seen != "hung", f"{name} hung through the partition ({how})"
        assert seen["unavailable"], (name, seen)
        assert seen["seconds"] < IO_TIMEOUT + 2, (name, seen)
