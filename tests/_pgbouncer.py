"""A real PgBouncer in transaction pooling mode, in front of the test PostgreSQL.

:func:`start` runs Debian's ``/usr/sbin/pgbouncer`` on a free loopback port with its own
configuration in a temporary directory (``pool_mode = transaction``, ``auth_type = trust``,
a small server pool), waits until it answers, and returns a :class:`Bouncer` whose
:meth:`Bouncer.stop` ends it. As root, PgBouncer refuses to run without ``-u``: it runs as
the ``postgres`` user, so its files are made readable by everyone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy.engine import URL, make_url

__all__ = ["PGBOUNCER", "Bouncer", "start"]

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Bouncer:
    """A running PgBouncer process and the URLs that reach PostgreSQL through it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, upstream: URL, root: Path):
        self.proc = proc
        self.port = port
        self.upstream = upstream
        self.root = root

    def url(self, *, flag: bool = True) -> str:
        """The upstream URL rerouted through the bouncer (``?pgbouncer=true`` if ``flag``)."""
        u = self.upstream.set(host="127.0.0.1", port=self.port)
        if flag:
            u = u.update_query_dict({"pgbouncer": "true"})
        return u.render_as_string(hide_password=False)

    def log(self) -> str:
        """What PgBouncer wrote so far (its stderr)."""
        return (self.root / "pgbouncer.log").read_text(errors="replace")

    def stop(self) -> None:
        """Stop the bouncer (SIGTERM, then SIGKILL) and remove its directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


def start(upstream_url: str, *, pool_size: int = 8, timeout: float = 15.0) -> Bouncer:
    """Start PgBouncer (transaction pooling) in front of ``upstream_url``'s server.

    Every database name is forwarded to the upstream host and port; each (database, user)
    pair gets at most ``pool_size`` server connections, however many clients connect.
    """
    upstream = make_url(upstream_url)
    user = upstream.username or "postgres"
    port = _free_port()
    root = Path(tempfile.mkdtemp(prefix="dcache-pgbouncer-"))
    root.chmod(0o755)
    (root / "users.txt").write_text(f'"{user}" ""\n')
    (root / "pgbouncer.ini").write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={upstream.host or '127.0.0.1'} port={upstream.port or 5432}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {root / 'users.txt'}",
                "pool_mode = transaction",
                "max_client_conn = 1000",
                f"default_pool_size = {pool_size}",
                "min_pool_size = 0",
                "reserve_pool_size = 0",
                "server_lifetime = 3600",
                "server_idle_timeout = 600",
                # Clients' cancel requests and idle transactions are the store's business.
                "query_wait_timeout = 60",
                "",
            ]
        )
    )
    for f in root.iterdir():
        f.chmod(0o644)
    cmd = [PGBOUNCER]
    if os.geteuid() == 0:
        cmd += ["-u", "postgres"]  # PgBouncer will not run as root
    cmd.append(str(root / "pgbouncer.ini"))
    with (root / "pgbouncer.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    bouncer = Bouncer(proc, port, upstream, root)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            out = bouncer.log()
            bouncer.stop()
            raise RuntimeError(f"pgbouncer exited with {proc.returncode}: {out}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return bouncer
        except OSError:
            if time.monotonic() > deadline:
                out = bouncer.log()
                bouncer.stop()
                raise RuntimeError(f"pgbouncer did not listen on {port}: {out}") from None
            time.sleep(0.05)
