"""The command line (end to end in subprocesses) and the default fetcher behind it."""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import importlib.util
import io
import json
import os
import pty
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _netjail import netjail, netjail_check  # noqa: F401
from conftest import SERVER_URLS, default_sigint, failed_jobs, interrupt_and_wait, wipe
from sqlalchemy.engine import make_url

import batch
import dcache
from batch import _cli
from batch.fetchers import Fetcher

DATA = Path(__file__).parent / "data"
LOCAL: dict[str, Any] = {"allow": ["127.0.0.0/8"], "schemes": ("http", "https", "file")}
"""What these tests' fetchers allow: the loopback test server and files, as the CLI does."""


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a CLI child: its own SQLite file, tests/data importable."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("BATCH_")}
    out["BATCH_DB"] = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    out["PYTHONPATH"] = os.pathsep.join([str(DATA), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out["BATCH_TEST_LOG"] = str(tmp_path / "fetched.log")
    out["BATCH_TEST_GO"] = str(tmp_path / "go")
    out["BATCH_TEST_STARTED"] = str(tmp_path)
    return out


BATCH = [sys.executable, "-m", "batch"]


def cli(
    env: dict[str, str] | None,
    *args: str,
    stdin: str | None = None,
    cwd: Path | None = None,
    program: list[str] = BATCH,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m batch ARGS`` (or ``program ARGS``) to the end."""
    return subprocess.run(
        [*program, *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        check=False,
    )


def spawn(
    env: dict[str, str], *args: str, program: list[str] = BATCH, **kw: Any
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*program, *args],
        env=env,
        preexec_fn=kw.pop("preexec_fn", default_sigint),  # the tests' SIGINT is a Ctrl-C
        stdin=subprocess.DEVNULL,
        stdout=kw.pop("stdout", subprocess.PIPE),
        stderr=kw.pop("stderr", subprocess.PIPE),
        text=True,
        **kw,
    )


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def fetched(env: dict[str, str]) -> list[str]:
    path = Path(env["BATCH_TEST_LOG"])
    return path.read_text().splitlines() if path.exists() else []


def until(predicate: Any, timeout: float = 30.0) -> None:
    """Poll a condition a child process will make true (files, rows): no fixed sleeps."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def only_job(env: dict[str, str]) -> dcache.JobRow:
    with dcache.DB.open(env["BATCH_DB"]) as db:
        rows = db.list_jobs()
    assert len(rows) == 1
    return rows[0]


def write(path: Path, *rows: str) -> str:
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one ``batch: ...`` line a usage error prints on stderr (no traceback)."""
    shown = done.stdout + done.stderr
    assert "Traceback" not in shown, shown
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("batch: "), line
    return line


# -- a local HTTP server for the fetcher ------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    hang = threading.Event()

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str = "text/plain", **headers: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/text":
            self._send(200, "caf\u00e9\nline two\n".encode("latin-1"), "text/html; charset=latin-1")
        elif path == "/json":
            self._send(200, b'{"a": 1}', "application/json")
        elif path == "/png":
            self._send(200, b"\x89PNG\r\n\x1a\n\x00\xff", "image/png")
        elif path.startswith("/hop/"):
            n = int(path.rsplit("/", 1)[1])
            if n == 0:
                self._send(200, b"landed", "text/plain")
            else:
                self._send(302, b"", Location=f"/hop/{n - 1}")
        elif path == "/to-ftp":
            self._send(302, b"", Location="ftp://127.0.0.1/x")
        elif path == "/to-file":
            self._send(302, b"", Location="file:///etc/passwd")
        elif path == "/missing":
            self._send(404, b"nope")
        elif path == "/broken":
            self._send(503, b"down")
        elif path == "/big":
            self._send(200, b"x" * 5000)
        elif path == "/big-unsized":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"y" * 1000)
        elif path == "/hang":
            self.hang.wait(10)
            self._send(200, b"late")
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                if self.hang.wait(0.02):
                    break
                self.wfile.write(b"z")
                self.wfile.flush()
        else:
            self._send(404, b"?")


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients the tests time out on purpose leave broken pipes behind


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        _Handler.hang.set()
        httpd.shutdown()
        httpd.server_close()


def _fetch(url: str, fetcher: Fetcher | None = None, **options: Any) -> batch.Result:
    return (fetcher or Fetcher(**LOCAL))(batch.Target(url, batch.Options(**options)))


def _refused(url: str, fetcher: Fetcher | None = None, **options: Any) -> batch.FetchError:
    with pytest.raises(batch.FetchError) as info:
        _fetch(url, fetcher, **options)
    return info.value


# -- the default fetcher ------------------------------------------------------------------------


def test_fetcher_gets_text_with_status_and_content_type(server: str) -> None:
    """An HTTP GET decodes the declared charset and puts status and type in meta."""
    res = _fetch(server + "/text")
    assert res.content == "caf\u00e9\nline two\n"
    assert res.meta["status"] == 200
    assert res.meta["content_type"] == "text/html; charset=latin-1"
    assert res.meta["url"] == server + "/text"
    assert _fetch(server + "/text", grep="two").content == "line two"
    assert _fetch(server + "/json").content == '{"a": 1}'


def test_fetcher_returns_binary_bodies_as_base64(server: str) -> None:
    """A body that is not text comes back losslessly, base64-encoded and marked so."""
    res = _fetch(server + "/png")
    assert res.meta["encoding"] == "base64"
    assert res.content == "iVBORw0KGgoA/w=="


def test_fetcher_follows_a_bounded_number_of_redirects(server: str) -> None:
    """Redirects are followed up to max_redirects; more fail the target."""
    res = _fetch(server + "/hop/3", Fetcher(max_redirects=3, **LOCAL))
    assert res.content == "landed"
    assert res.meta["url"] == server + "/hop/0"
    err = _refused(server + "/hop/4", Fetcher(max_redirects=3, **LOCAL))
    assert "too many redirects" in err.message
    assert "redirects" in _refused(server + "/hop/1", Fetcher(max_redirects=0, **LOCAL)).message


def test_fetcher_never_follows_a_redirect_out_of_http(server: str) -> None:
    """A redirect to ftp:// or file:// is refused, not followed (no local file leaks)."""
    assert "ftp" in _refused(server + "/to-ftp").message
    assert "file" in _refused(server + "/to-file").message


def test_fetcher_fails_http_errors_with_hints(server: str) -> None:
    """4xx and 5xx answers fail the target with the status and a hint."""
    err = _refused(server + "/missing")
    assert err.message.startswith("HTTP 404")
    assert err.hint == "check the URL"
    assert "retry later" in _refused(server + "/broken").hint


def test_fetcher_caps_the_body_size(server: str) -> None:
    """Bodies over max_bytes fail, whether or not the server declares the length."""
    small = Fetcher(max_bytes=4096, **LOCAL)
    assert "5000 bytes" in _refused(server + "/big", small).message
    assert "over 4096 bytes" in _refused(server + "/big-unsized", small).message
    assert len(_fetch(server + "/big-unsized").content) == 10_000


def test_fetcher_times_out(server: str) -> None:
    """A server that does not answer, or drips its body, fails within the timeout."""
    fast = Fetcher(timeout=0.3, **LOCAL)
    started = time.monotonic()
    assert "timed out" in _refused(server + "/hang", fast).message
    assert "timed out" in _refused(server + "/drip", fast).message
    assert time.monotonic() - started < 5


def test_fetcher_reports_unreachable_hosts() -> None:
    """A closed port fails the target, it does not crash."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert "cannot reach" in _refused(f"http://127.0.0.1:{port}/").message


@pytest.mark.parametrize(
    "url",
    ["ftp://127.0.0.1/x", "gopher://x/", "data:text/plain,hi", "javascript:alert(1)", "/etc/hosts"],
)
def test_fetcher_refuses_other_schemes(url: str) -> None:
    """Only http, https and file URLs are fetched."""
    err = _refused(url)
    assert "refused" in err.message or "no scheme" in err.message
    assert "http or https or file" in err.hint


def test_fetcher_reads_files(tmp_path: Path) -> None:
    """file:// URLs (and relative file:name) are read, capped and reported."""
    page = tmp_path / "page.txt"
    page.write_text("alpha\nbeta\n", encoding="utf-8")
    res = _fetch(page.as_uri())
    assert res.content == "alpha\nbeta\n"
    assert res.meta == {
        "content_type": "text/plain; charset=utf-8",
        "path": str(page),
        "bytes": 11,
    }
    conf = tmp_path / "settings.toml"
    conf.write_text("name = 'caf\u00e9'\n", encoding="utf-8")
    assert _fetch(conf.as_uri()).content == "name = 'caf\u00e9'\n"
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\xff\x00\xfe")
    res = _fetch(blob.as_uri())
    assert (res.content, res.meta["encoding"]) == ("/wD+", "base64")
    assert "no such file" in _refused((tmp_path / "nope").as_uri()).message
    assert "directory" in _refused(tmp_path.as_uri()).message
    assert "remote host" in _refused("file://example.org/etc/hosts").message
    assert "at most 4" in _refused(page.as_uri(), Fetcher(max_bytes=4, **LOCAL)).message


def test_fetcher_refuses_options_it_cannot_honour(tmp_path: Path) -> None:
    """An option other than grep fails the target rather than being ignored."""
    page = tmp_path / "p.txt"
    page.write_text("x")
    err = _refused(page.as_uri(), jq=".a")
    assert "jq" in err.message
    assert "--fetch" in err.hint


def test_fetcher_scheme_list_narrows(tmp_path: Path) -> None:
    """A web app can keep only https: http and file are then refused."""
    https_only = Fetcher(schemes=("https",))
    assert "refused" in _refused("http://127.0.0.1/", https_only).message
    assert "refused" in _refused((tmp_path / "x").as_uri(), https_only).message
    with pytest.raises(ValueError, match="schemes"):
        Fetcher(schemes=("ftp",))
    with pytest.raises(ValueError, match="timeout"):
        Fetcher(timeout=0)


# -- batch run ----------------------------------------------------------------------------------


def test_run_prints_each_outcome_and_exits_0_when_done(
    env: dict[str, str], tmp_path: Path, server: str
) -> None:
    """run fetches http and file targets with the default fetcher, one JSON line each."""
    page = tmp_path / "page.txt"
    page.write_text("alpha\nbeta\n", encoding="utf-8")
    targets = write(
        tmp_path / "targets.txt",
        "# a comment, then a blank line",
        "",
        server + "/text",
        json.dumps({"url": page.as_uri(), "options": {"grep": "beta"}}),
        "file:page.txt",
    )
    done = cli(env, "run", targets, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = lines(done.stdout)
    assert [t["status"] for t in out] == ["done", "done", "done"]
    assert out[0]["result"]["meta"]["status"] == 200
    assert out[1]["result"]["content"] == "beta"
    assert out[1]["options"] == {"grep": "beta"}
    assert out[2]["result"]["content"] == "alpha\nbeta\n"
    assert "3 target(s)" in done.stderr
    assert only_job(env).status == "done"


def test_run_partial_exits_1_and_a_rerun_reuses_the_stored_results(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A rerun of the same file within the lease prints the stored results, fetching nothing."""
    targets = write(tmp_path / "t.txt", "test://ok/1", "test://fail/2")
    first = cli(env, "run", "--fetch", "cli_fetch:counting", targets)
    assert first.returncode == 1, first.stderr
    assert [t["status"] for t in lines(first.stdout)] == ["done", "failed"]
    assert lines(first.stdout)[1]["hint"] == "it is a test"
    assert fetched(env) == ["test://ok/1", "test://fail/2"]

    again = cli(env, "run", "--fetch", "cli_fetch:counting", targets)
    assert again.returncode == 1
    assert again.stdout == first.stdout
    assert "reused" in again.stderr
    assert "without fetching again" in again.stderr
    assert "it ended partial; to fetch these targets again now, pass another --caller" in (
        " ".join(again.stderr.split())
    )
    assert fetched(env) == ["test://ok/1", "test://fail/2"]


def test_run_reads_targets_from_stdin(env: dict[str, str]) -> None:
    """FILE - reads the targets from standard input."""
    done = cli(env, "run", "--fetch", "cli_fetch:counting", "-", stdin="test://a\ntest://b\n")
    assert done.returncode == 0, done.stderr
    assert [t["url"] for t in lines(done.stdout)] == ["test://a", "test://b"]


def test_run_from_a_closed_stdin_is_a_one_line_error(env: dict[str, str]) -> None:
    """`batch run - <&-` (no standard input at all) is bad input, not a crash."""
    done = cli(env, "run", "-", program=["sh", "-c", 'exec "$0" "$@" <&-', *BATCH])
    assert done.returncode == 2, done.stderr
    assert "<stdin>" in _one_line_error(done)


def test_deeply_nested_json_is_bad_input_not_a_crash(env: dict[str, str], tmp_path: Path) -> None:
    """Valid JSON nested deeper than the parser follows: exit 2, one line naming the file
    and the line, nothing fetched."""
    nested = '{"a": ' * 10**5 + "1" + "}" * 10**5
    path = write(tmp_path / "deep.txt", "test://a", f'{{"url": "test://b", "options": {nested}}}')
    done = cli(env, "run", "--fetch", "cli_fetch:counting", path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path}:2: " in _one_line_error(done)
    assert fetched(env) == []


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "no targets"),
        (["# only a comment"], "no targets"),
        (["test://a", "{not json"], ":2: not valid JSON"),
        (["test://a", "two words"], ":2: one URL a line"),
        (["test://a", '{"url": "test://b", "extra": 1}'], ":2: targets[1]: unknown field"),
        (["test://a", "", "test://a"], ":3: targets[1] duplicates targets[0]"),
        (['{"url": "test://a", "options": {"grep": 3}}'], ":1: targets[0]: options.grep"),
        (["test://x"] * 0 + [f"test://{i}" for i in range(33)], "too many targets"),
    ],
)
def test_run_refuses_bad_input_with_exit_2(
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rows: list[str],
    message: str,
) -> None:
    """Bad target files exit 2 naming the line at fault, before anything is fetched."""
    monkeypatch.setenv("BATCH_DB", env["BATCH_DB"])
    path = write(tmp_path / "bad.txt", *rows)
    assert _cli.main(["run", "--fetch", "batch.demo:fetch_file", path]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fetch", "nocolon"], "use module:callable"),
        (["--fetch", "no_such_module_xyz:f"], "cannot import"),
        (["--fetch", "cli_fetch:nothing"], "has no nothing"),
        (["--fetch", "cli_fetch:not_callable"], "not callable"),
    ],
)
def test_run_refuses_a_bad_fetch_with_exit_2(
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    """--fetch must name an importable callable as module:callable."""
    monkeypatch.setenv("BATCH_DB", env["BATCH_DB"])
    monkeypatch.syspath_prepend(str(DATA))
    path = write(tmp_path / "t.txt", "test://a")
    assert _cli.main(["run", *args, path]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("def fetch(target):\n    return (\n", "SyntaxError"),
        ("raise RuntimeError('broken at import')\n", "RuntimeError: broken at import"),
        ("import no_such_dependency_xyz\n", "No module named 'no_such_dependency_xyz'"),
    ],
)
def test_a_fetch_module_that_fails_to_import_is_a_one_line_error(
    env: dict[str, str], tmp_path: Path, command: str, source: str, raised: str
) -> None:
    """Whatever a --fetch module raises while it is imported: exit 2, one line naming the
    module and the exception, in `run` and `serve` alike."""
    (tmp_path / "cli_broken_fetch.py").write_text(source)
    targets = write(tmp_path / "t.txt", "test://a")
    args = [targets] if command == "run" else ["--port", "0"]
    done = cli(env, command, "--fetch", "cli_broken_fetch:fetch", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert "cli_broken_fetch" in line
    assert raised in line


def test_serve_finds_a_fetch_module_in_the_working_directory(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Started through the `batch` console script (whose own folder, not the working
    directory, is first on sys.path), `serve --fetch` finds local modules as `run` does."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "cli_local_fetch.py").write_text(
        "import batch\n\ndef fetch(target):\n    return batch.Result('local', {})\n"
    )
    script = tmp_path / "bin" / "batch"  # what pip writes for [project.scripts]
    script.parent.mkdir()
    script.write_text("import sys\nfrom batch.__main__ import main\nsys.exit(main())\n")
    targets = write(work / "t.txt", "test://a")
    command = [sys.executable, str(script)]
    ran = cli(env, "run", "--fetch", "cli_local_fetch:fetch", targets, cwd=work, program=command)
    assert ran.returncode == 0, ran.stderr
    assert lines(ran.stdout)[0]["result"]["content"] == "local"
    proc = spawn(
        {**env, "PYTHONFAULTHANDLER": "1"},
        *("serve", "--port", "0", "--fetch", "cli_local_fetch:fetch"),
        program=command,
        cwd=work,
        stdout=subprocess.DEVNULL,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "batch dashboard on http://127.0.0.1:" in first, first + proc.stderr.read()
        assert interrupt_and_wait(proc, 30) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_serve_on_a_port_in_use_says_so_in_one_line_and_closes_its_runner(
    env: dict[str, str],
) -> None:
    """werkzeug printed its own lines and called sys.exit(1) from inside make_server, so
    the CLI's message never ran and its runner was never closed (its owner row stayed)."""
    pytest.importorskip("flask")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = cli(env, "serve", "--port", str(port))
    line = _one_line_error(done)
    assert done.returncode == 1, line
    assert line.startswith(f"batch: cannot listen on 127.0.0.1:{port}: "), line
    assert "in use" in line, line
    with dcache.DB.open(env["BATCH_DB"]) as db:
        assert [o.owner for o in db.owners() if o.present] == []  # the runner was closed


@pytest.mark.parametrize("caller", ["", "x" * 300])
def test_a_bad_caller_is_reported_as_the_caller_option(
    env: dict[str, str], tmp_path: Path, caller: str
) -> None:
    """--caller's fault is not blamed on the targets file."""
    targets = write(tmp_path / "t.txt", "test://a")
    done = cli(env, "run", "--caller", caller, "--fetch", "cli_fetch:counting", targets)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert line.startswith("batch: --caller ")
    assert targets not in line
    assert fetched(env) == []


def test_run_of_a_missing_file_exits_2(env: dict[str, str], tmp_path: Path) -> None:
    """A missing targets file is bad input (end to end: the exit status a shell sees)."""
    done = cli(env, "run", str(tmp_path / "missing.txt"))
    assert done.returncode == 2
    assert "no such file" in done.stderr
    assert _cli.main(["frobnicate"]) == 2


def _started(tmp_path: Path, name: str) -> bool:
    return (tmp_path / f"started-{name}").exists()


def test_ctrl_c_cancels_the_job_stores_the_target_in_flight_and_exits_130(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The first Ctrl-C cancels the job; the in-flight target is stored; exit 130."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b", "test://x/c")
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets)
    try:
        until(lambda: _started(tmp_path, "a"))
        proc.send_signal(signal.SIGINT)
        until(lambda: only_job(env).status == "cancelled")
        Path(env["BATCH_TEST_GO"]).touch()  # let the target in flight finish
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "cancelled" in err
    assert [t["status"] for t in lines(out)] == ["done", "pending", "pending"]
    job = only_job(env)
    assert job.status == "cancelled"
    assert job.finished_at is not None
    assert fetched(env) == ["test://x/a"]


def _default_signals() -> None:
    """``preexec_fn``: SIGINT, SIGTERM and SIGHUP at their default actions, whatever the
    test runner inherited (``nohup`` ignores SIGHUP, a background job SIGINT)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigterm_or_sighup_cancels_the_job_stores_the_target_in_flight_and_exits_128_plus_it(
    env: dict[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    """A service manager's stop (SIGTERM) or a closed terminal (SIGHUP) must not leave the
    job running with nobody draining it: the caller would be refused as busy on every retry."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b", "test://x/c")
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets, preexec_fn=_default_signals)
    try:
        until(lambda: _started(tmp_path, "a"))
        proc.send_signal(sig)
        until(lambda: only_job(env).status == "cancelled")
        Path(env["BATCH_TEST_GO"]).touch()  # let the target in flight finish
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert sig.name in err
    assert "Traceback" not in err
    assert [t["status"] for t in lines(out)] == ["done", "pending", "pending"]
    job = only_job(env)
    assert job.status == "cancelled"
    assert job.finished_at is not None
    assert fetched(env) == ["test://x/a"]
    # The caller's slot is free again: the same caller runs another file at once.
    again = cli(env, "run", "--fetch", "cli_fetch:counting", write(tmp_path / "u.txt", "test://y"))
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_second_ctrl_c_or_sigterm_leaves_at_once_with_the_job_cancelled(
    env: dict[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    """A second Ctrl-C (or SIGTERM) does not wait for a stuck fetch; the job is not left
    running: it stays cancelled."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b")
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets, preexec_fn=_default_signals)
    try:
        until(lambda: _started(tmp_path, "a"))
        proc.send_signal(sig)
        until(lambda: only_job(env).status == "cancelled")
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=30)
    finally:
        Path(env["BATCH_TEST_GO"]).touch()
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "leaving without waiting" in err
    assert "Traceback" not in err
    assert only_job(env).status == "cancelled"
    assert fetched(env) == ["test://x/a"]


def test_run_shows_a_progress_bar_on_a_terminal(env: dict[str, str], tmp_path: Path) -> None:
    """On a TTY, stderr carries a progress bar; stdout stays pure JSON lines."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b")
    main_fd, sub_fd = pty.openpty()
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets, stderr=sub_fd)
    os.close(sub_fd)
    seen = b""
    try:
        until(lambda: _started(tmp_path, "a"))
        Path(env["BATCH_TEST_GO"]).touch()
        while True:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        out, _ = proc.communicate(timeout=30)
    finally:
        os.close(main_fd)
        proc.kill()
    assert proc.returncode == 0
    job_id = only_job(env).id
    assert f"job {job_id[:8]}".encode() in seen
    assert b"\r" in seen
    assert len(lines(out)) == 2


def test_line_bar_is_the_fallback_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without tqdm installed, a one-line counter stands in for the bar."""
    real = _cli.importlib.import_module

    def no_tqdm(name: str) -> Any:
        if name == "tqdm":
            raise ImportError("no tqdm")
        return real(name)

    monkeypatch.setattr(_cli.importlib, "import_module", no_tqdm)
    job = batch.Job(
        id="ab" * 16, status="running", error="", targets_total=4, targets_done=1, finished_at=None
    )
    bar = _cli._progress(job, True)
    bar.update(job)
    bar.close()
    err = capsys.readouterr().err
    assert "job abababab [######" in err
    assert "1/4 running" in err


# -- status, cancel, jobs, purge ----------------------------------------------------------------


class _Blocking:
    """An in-process fetch held at a gate, so a CLI child can act on a live job."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def __call__(self, target: batch.Target) -> batch.Result:
        self.started.set()
        assert self.gate.wait(30)
        return batch.Result("ok")


def test_status_cancel_jobs_and_purge_end_to_end(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """status, cancel, jobs and purge work on a job drained by another process."""
    fetch = _Blocking()
    with dcache.DB.open(env["BATCH_DB"]) as db:
        runner = batch.Runner(db, fetch)
        try:
            job_id, _ = runner.submit(
                "web:alice", "web", [{"url": "test://a"}, {"url": "test://b"}]
            )
            assert fetch.started.wait(10)

            table = cli(env, "status", job_id)
            assert table.returncode == 0, table.stderr
            assert f"job {job_id}: running" in table.stdout
            assert "IDX" in table.stdout
            assert "test://a" in table.stdout
            as_json = cli(env, "status", job_id, "--json")
            body = json.loads(as_json.stdout)
            assert [t["status"] for t in body["targets"]] == ["running", "pending"]

            live = cli(env, "jobs", "--live", "--json")
            assert [j["id"] for j in lines(live.stdout)] == [job_id]

            cancelled = cli(env, "cancel", job_id)
            assert cancelled.returncode == 0, cancelled.stderr
            assert "cancelled" in cancelled.stdout
            fetch.gate.set()
            job = runner.wait(job_id, timeout=10)
            assert job is not None
            assert job.status == "cancelled"
            found = runner.status(job_id)
            assert found is not None
            assert [t.status for t in found[1]] == ["done", "pending"]

            # The same commands in-process (same code, no interpreter start-up each).
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("BATCH_DB", env["BATCH_DB"])
                assert _cli.main(["cancel", job_id]) == 1
                assert "already cancelled" in capsys.readouterr().err
                assert _cli.main(["status", "f" * 32]) == 1
                assert "no job" in capsys.readouterr().err
                assert _cli.main(["cancel", "f" * 32]) == 1
                assert _cli.main(["jobs"]) == 0
                table = capsys.readouterr().out
                assert job_id in table
                assert "cancelled" in table
                assert _cli.main(["jobs", "--live"]) == 0
                assert capsys.readouterr().err.strip() == "batch: no live jobs"
        finally:
            fetch.gate.set()
            runner.close(timeout=10)

        # A job whose lease lapsed is purged by `batch purge`.
        with batch.Runner(db, lambda t: batch.Result("x"), batch.Config(ttl=0.05)) as short:
            lapsed, _ = short.submit("web:bob", "web", [{"url": "test://c"}])
            short.wait(lapsed, timeout=10)
        until(lambda: db.get_job(lapsed) is None)
    purged = cli(env, "purge", "--json")
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout) == {"purged": 1}
    remaining = cli(env, "jobs", "--json")
    assert [j["id"] for j in lines(remaining.stdout)] == [job_id]


def test_purge_deletes_every_lapsed_job_not_one_calls_worth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A purge transaction takes a few MiB of results (here: one job), and one call of
    purge_expired at most 100 transactions: `batch purge` goes on until none is left."""
    import dcache._upkeep

    monkeypatch.setattr(dcache._upkeep, "PURGE_BATCH_BYTES", 1)
    url = f"sqlite:///{tmp_path / 'batch.sqlite3'}"
    then = dcache.utcnow() - dt.timedelta(days=1)
    with dcache.DB.open(url) as db:
        failed_jobs(db, 105, then, ttl=dt.timedelta(minutes=1))
    assert _cli.main(["purge", "--db", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"purged": 105}


def test_purge_keeps_tombstones_for_the_days_given(env: dict[str, str]) -> None:
    """`batch purge` deletes the tombstones older than --tombstone-days (default 7)."""
    now = dcache.utcnow()
    lapsed = {}
    with dcache.DB.open(env["BATCH_DB"]) as db:
        for caller, days in (("old", 40), ("recent", 3)):
            then = now - dt.timedelta(days=days, minutes=1)
            out = db.submit(
                job_id=batch.new_job_id(),
                caller=caller,
                caller_class="cli",
                idem_key=caller,
                targets=[dcache.NewTarget("test://a", "{}")],
                ttl=dt.timedelta(minutes=1),
                jobs_per_caller=1,
                jobs_total=10,
                now=then,
            )
            assert out.job is not None
            assert db.fail_job(out.job.id, "x", now=then)
            lapsed[caller] = out.job.id

    def tombstones() -> set[str]:
        with contextlib.closing(sqlite3.connect(env["BATCH_DB"].removeprefix("sqlite:///"))) as c:
            return {row[0] for row in c.execute("SELECT id FROM batch_tombstone")}

    first = cli(env, "purge", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {"purged": 2}
    assert tombstones() == set(lapsed.values())
    again = cli(env, "purge")  # the 40-day-old tombstone is past the default 7 days
    assert again.returncode == 0, again.stderr
    assert again.stdout == "purged 0 lapsed job(s)\n"
    assert tombstones() == {lapsed["recent"]}
    kept = cli(env, "purge", "--tombstone-days", "3.5")
    assert kept.returncode == 0, kept.stderr
    assert tombstones() == {lapsed["recent"]}
    shorter = cli(env, "purge", "--tombstone-days", "2")
    assert shorter.returncode == 0, shorter.stderr
    assert tombstones() == set()
    for bad in ("-1", "36501", "nan", "week"):
        refused = cli(env, "purge", "--tombstone-days", bad)
        assert refused.returncode == 2, bad
        assert "--tombstone-days" in refused.stderr
        assert "days" in refused.stderr


def test_a_busy_caller_exits_75(env: dict[str, str], tmp_path: Path) -> None:
    """A caller at its live-job cap gets exit 75 (retry later), not a crash or a wait."""
    fetch = _Blocking()
    with dcache.DB.open(env["BATCH_DB"]) as db, batch.Runner(db, fetch) as runner:
        try:
            runner.submit("cli", "cli", [{"url": "test://a"}])
            targets = write(tmp_path / "t.txt", "test://other")
            busy = cli(env, "run", "--fetch", "cli_fetch:counting", targets)
            assert busy.returncode == 75, busy.stderr
            assert "busy" in busy.stderr
            other = cli(env, "run", "--caller", "bob", "--fetch", "cli_fetch:counting", targets)
            assert other.returncode == 0, other.stderr
        finally:
            fetch.gate.set()


def test_a_jobs_limit_past_its_maximum_is_a_usage_error_not_a_traceback(
    env: dict[str, str],
) -> None:
    """``--limit 99999999999999999999`` crashed with OverflowError on SQLite and printed a
    raw driver error on the servers; a bound with a clear error, exit 2, holds instead."""
    assert cli(env, "purge").returncode == 0  # the store exists
    for bad in ("99999999999999999999", str(2**63), str(_cli.MAX_LIMIT + 1)):
        done = cli(env, "jobs", "--limit", bad)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert f"--limit: at most {_cli.MAX_LIMIT:,}" in done.stderr
    done = cli(env, "jobs", "--limit", str(_cli.MAX_LIMIT))
    assert done.returncode == 0, done.stderr


def test_db_option_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--db goes before or after the command; $BATCH_DB, then the default, stand in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BATCH_DB", raising=False)
    # A read-only command creates no database: the default's missing file is an error.
    assert _cli.main(["jobs"]) == 2
    err = capsys.readouterr().err
    assert "no batch store at sqlite:///batch.sqlite3" in err
    assert "does not exist" in err
    assert list(tmp_path.iterdir()) == []
    for args in (
        ["--db", "sqlite:///a.sqlite3", "purge"],
        ["purge", "--db", "sqlite:///b.sqlite3"],
    ):
        assert _cli.main(args) == 0  # purge writes: it creates the store
    assert (tmp_path / "a.sqlite3").exists()
    assert (tmp_path / "b.sqlite3").exists()
    for args in (["--db", "sqlite:///a.sqlite3", "jobs"], ["jobs", "--db", "sqlite:///b.sqlite3"]):
        assert _cli.main(args) == 0
    assert "no jobs" in capsys.readouterr().err
    monkeypatch.setenv("BATCH_DB", "sqlite:///c.sqlite3")
    assert _cli.main(["purge"]) == 0
    assert (tmp_path / "c.sqlite3").exists()
    assert "purged 0" in capsys.readouterr().out
    assert _cli.main(["status", "0" * 32]) == 1  # $BATCH_DB's store, no such job
    assert "no job" in capsys.readouterr().err
    assert _cli.main(["jobs", "--db", "nosuchdialect://x"]) == 2  # bad input
    assert _cli.main(["--help"]) == 0


# -- the CLI's own fetcher, Ctrl-C, secrets, odd input ---------------------------------------


def test_the_cli_fetcher_reads_files_and_private_addresses_and_says_so(
    tmp_path: Path, server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The machine's own user may read local files and local services; --help says so."""
    page = tmp_path / "p.txt"
    page.write_text("local")
    assert _cli.local_fetch(batch.Target(page.as_uri())).content == "local"
    assert _cli.local_fetch(batch.Target(server + "/json")).content == '{"a": 1}'
    with pytest.raises(batch.FetchError, match="blocked address 127.0.0.1"):
        batch.fetchers.fetch(batch.Target(server + "/json"))
    with pytest.raises(batch.FetchError, match="scheme 'file' refused"):
        batch.fetchers.fetch(batch.Target(page.as_uri()))
    assert _cli.main(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "private and loopback addresses" in text
    assert "file" in text


def _sigint_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    masks = [int(line.split()[1], 16) for line in status.splitlines() if "Pnd:" in line]
    return any(mask & (1 << (signal.SIGINT - 1)) for mask in masks)


def test_a_quick_double_ctrl_c_cancels_the_job_and_leaves(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Two Ctrl-Cs in a row (before the first is acted on) still cancel, then exit 130."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b", "test://x/c")
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets)
    try:
        until(lambda: _started(tmp_path, "a"))
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # The kernel drops a second SIGINT sent while the first is still pending: wait
        # for its delivery (not for the CLI to act on it), then press again.
        until(lambda: not _sigint_pending(proc.pid), timeout=10)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        Path(env["BATCH_TEST_GO"]).touch()
        proc.kill()
    assert proc.returncode == 130, err
    assert took < 10, "it waited for the blocked fetch"
    assert "interrupted twice" in err or "interrupted again" in err
    assert "cancelled" in err
    assert "Traceback" not in err
    assert only_job(env).status == "cancelled"
    assert fetched(env) == ["test://x/a"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_the_database_password_is_never_printed(
    env: dict[str, str], tmp_path: Path, backend: str
) -> None:
    """A --db password (raw or %-encoded) shows as *** in every message, pass or fail."""
    secret = "S3cret%40pw"
    if backend == "sqlite":
        urls = [f"postgresql+psycopg://someone:{secret}@127.0.0.1:1/nothing"]
    else:
        scheme, rest = SERVER_URLS[backend].split("://", 1)
        user, host = rest.split("@", 1)
        urls = [f"{scheme}://{user.split(':')[0]}:{secret}@{host}"]
    targets = write(tmp_path / "t.txt", "test://a")
    caller = f"pw-{os.getpid()}-{time.monotonic_ns()}"  # never a job reused from a past run
    for url in urls:
        for args in (
            ["run", "--caller", caller, "--fetch", "cli_fetch:counting", "--db", url, targets],
            ["jobs", "--db", url],
            ["purge", "--db", url],
        ):
            done = cli(env, *args)
            shown = done.stdout + done.stderr
            assert "S3cret" not in shown, shown
            assert "Traceback" not in shown, shown
            if args[0] == "run":
                assert ":***@" in done.stderr, done.stderr
    if backend != "sqlite":
        with dcache.DB.open(SERVER_URLS[backend]) as db:
            wipe(db)


@pytest.mark.parametrize(
    "url", ["not a url", "://", "postgresql://u:Pw-secret@127.0.0.1:notaport/db", "sqlite"]
)
def test_a_malformed_db_url_is_a_one_line_error(env: dict[str, str], url: str) -> None:
    """No traceback, no password, a non-zero exit: a typo in --db is bad input."""
    done = cli(env, "jobs", "--db", url)
    assert done.returncode != 0
    lines_ = done.stderr.strip().splitlines()
    assert len(lines_) == 1, done.stderr
    assert lines_[0].startswith("batch: ")
    assert "Pw-secret" not in done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://someone:Pw-{secret}@127.0.0.1:1/nothing",
        "mysql+pymysql://someone:Pw-{secret}@127.0.0.1:1/nothing",
        "postgresql+psycopg://someone@127.0.0.1:1/nothing?password=Pw-{secret}",
    ],
)
def test_serve_never_prints_the_database_password(env: dict[str, str], url: str) -> None:
    """`serve` hides the --db password as every other command does, in its message and in
    the error it quotes (port 1 on loopback: nothing listens there)."""
    secret = f"{os.getpid()}x{time.monotonic_ns()}"
    done = cli(env, "serve", "--port", "0", "--db", url.format(secret=secret))
    assert secret not in done.stdout + done.stderr
    assert done.returncode == 75, done.stderr
    line = _one_line_error(done)
    assert "***" in line
    assert "server is running and accepts connections on 127.0.0.1:1" in line


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def test_a_missing_driver_names_the_extra_of_its_backend(tmp_path: Path) -> None:
    """Without psycopg or PyMySQL installed, the hint names the extra that installs the
    driver the URL asks for (exit 2: nothing to retry)."""
    code = (
        "import sys\n"
        "sys.modules['psycopg'] = sys.modules['pymysql'] = None  # as if not installed\n"
        "from batch._cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for url, extra in [
        ("postgresql+psycopg://u@127.0.0.1:1/db", "postgres"),
        ("mysql+pymysql://u@127.0.0.1:1/db", "mysql"),
        ("mariadb+pymysql://u@127.0.0.1:1/db", "mysql"),
    ]:
        done = cli(None, "jobs", "--db", url, cwd=tmp_path, program=[sys.executable, "-c", code])
        assert done.returncode == 2, done.stderr
        line = _one_line_error(done)
        assert line.endswith(f"is not installed; install it: pip install 'batch-dcache[{extra}]'")


@pytest.mark.parametrize("command", ["jobs", "serve"])
@pytest.mark.parametrize(
    ("url", "says", "never"),
    [
        ("notaurl", "is not a database URL", ""),
        ("foo://u:Pw-secret@h/db", "no database 'foo'", "install"),
        ("sqlite+nodriver:///x.sqlite3", "no driver 'nodriver' for sqlite", "folder"),
        ("postgresql+psycopg://u:Pw-secret@127.0.0.1:notaport/db", "port", "int()"),
        ("postgresql+psycopg://u@127.0.0.1:99999/db", "port", "server is running"),
        ("postgresql+psycopg://u@127.0.0.1:1/db?pgbouncer=maybe", "pgbouncer", "server"),
        ("postgresql+psycopg://u@127.0.0.1:1/db?sslmode=bogus", "sslmode", "server"),
        ("mysql+pymysql://u@127.0.0.1:1/db?pgbouncer=true", "pgbouncer", "server"),
        ("mysql+pymysql://u@127.0.0.1:1/db?nosuchoption=1", "nosuchoption", "server"),
        pytest.param(
            "postgresql+psycopg2://u@127.0.0.1:1/db",
            "pip install 'batch-dcache[postgres]'",
            "[mysql]",
            marks=pytest.mark.skipif(not _missing("psycopg2"), reason="psycopg2 installed"),
        ),
        pytest.param(
            "mariadb+mysqldb://u@127.0.0.1:1/db",
            "pip install 'batch-dcache[mysql]'",
            "[postgres]",
            marks=pytest.mark.skipif(not _missing("MySQLdb"), reason="mysqlclient installed"),
        ),
        pytest.param(
            "mssql+pyodbc://u@127.0.0.1:1/db",
            "SQLite, PostgreSQL or MySQL/MariaDB",
            "batch-dcache[",
            marks=pytest.mark.skipif(not _missing("pyodbc"), reason="pyodbc installed"),
        ),
    ],
)
def test_a_bad_db_url_exits_2_with_a_hint_that_fits(
    env: dict[str, str], command: str, url: str, says: str, never: str
) -> None:
    """An unknown dialect or driver, a bad port or a bad query option is bad input (exit
    2, one line, no password), in `serve` as in the other commands; the hint names what
    failed (the right extra for a driver not installed), not a server to go and check."""
    args = ["--port", "0"] if command == "serve" else []
    done = cli(env, command, *args, "--db", url)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert says in line
    if never:
        assert never not in line
    assert "Pw-secret" not in line


def test_a_utf8_bom_is_not_part_of_the_first_url(env: dict[str, str], tmp_path: Path) -> None:
    """A file saved by an editor that writes a byte-order mark reads as without one."""
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbftest://a\ntest://b\n")
    done = cli(env, "run", "--fetch", "cli_fetch:counting", str(path))
    assert done.returncode == 0, done.stderr
    assert [t["url"] for t in lines(done.stdout)] == ["test://a", "test://b"]
    piped = cli(
        env,
        "run",
        "--caller",
        "pipe",
        "--fetch",
        "cli_fetch:counting",
        "-",
        stdin="\ufefftest://c\n",
    )
    assert piped.returncode == 0, piped.stderr
    assert [t["url"] for t in lines(piped.stdout)] == ["test://c"]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_a_byte_that_is_not_utf8_is_reported_at_its_line(ending: bytes) -> None:
    """Like bad JSON, a bad byte names its line (and column), whatever ends the lines."""
    data = ending.join([b"\xef\xbb\xbftest://a", b"# note", b"test://b\xffc", b""])
    with pytest.raises(_cli.InputError) as err:
        _cli._text_lines(data, "t.txt")
    assert str(err.value) == "t.txt:3: not UTF-8 text: byte 0xff at column 9"
    assert _cli._text_lines(ending.join([b"\xef\xbb\xbfa", b"", "é".encode()]), "t") == [
        "a",
        "",
        "é",
    ]


def test_a_file_or_stdin_that_is_not_utf8_exits_2_naming_the_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"test://a\ntest://caf\xe9\n")
    done = cli(env, "run", str(path))
    assert done.returncode == 2
    assert f"{path}:2: not UTF-8 text: byte 0xe9 at column 11" in done.stderr
    piped = subprocess.run(
        [*BATCH, "run", "-"], env=env, input=b"\xfftest://a\n", capture_output=True
    )
    assert piped.returncode == 2
    assert b"<stdin>:1: not UTF-8 text: byte 0xff at column 1" in piped.stderr


# -- made for people: tables on a terminal, --output, --watch, errors, completion, help -------


class Pty:
    """A child's terminal: stdout and stderr on one pseudo-terminal of a known size."""

    def __init__(self, env: dict[str, str], *args: str, cols: int = 80) -> None:
        import fcntl
        import struct
        import termios

        self.main_fd, sub_fd = pty.openpty()
        fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
        env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
        self.proc = spawn(env, *args, stdout=sub_fd, stderr=sub_fd)
        os.close(sub_fd)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 30.0) -> str:
        """Read until ``text`` has appeared (or the child closed the terminal)."""
        import select

        raw = b""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not shown in time; saw {self.seen!r}")
            ready, _, _ = select.select([self.main_fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.main_fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                break
            raw += chunk
            self.seen += chunk.decode("utf-8", "replace").replace("\r\n", "\n")
        return self.seen

    def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        """Read to the end; the exit status and everything shown."""
        self.read_until("\x00never\x00", timeout) if self.proc.poll() is None else None
        code = self.proc.wait(timeout=timeout)
        os.close(self.main_fd)
        return code, self.seen


@pytest.fixture
def finish_pty() -> Iterator[list[Pty]]:
    ptys: list[Pty] = []
    yield ptys
    for p in ptys:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


def _shown(p: Pty) -> tuple[int, str]:
    try:
        return p.finish()
    except AssertionError:
        p.proc.kill()
        raise


def test_run_on_a_terminal_prints_a_table_cut_to_its_width(
    env: dict[str, str], tmp_path: Path, finish_pty: list[Pty]
) -> None:
    """A person sees index, status, bytes, URL and error, one row each, within the width."""
    long_url = "test://x/" + "long-segment/" * 12 + "end"
    targets = write(tmp_path / "t.txt", "test://ok/1", "test://fail/2", long_url)
    p = Pty(env, "run", "--fetch", "cli_fetch:counting", targets, cols=60)
    finish_pty.append(p)
    code, screen = _shown(p)
    assert code == 1, screen
    rows = [line for line in screen.splitlines() if not line.startswith("batch: ")]
    header = next(i for i, line in enumerate(rows) if line.startswith("IDX"))
    table = rows[header : header + 4]
    assert table[0].split() == ["IDX", "STATUS", "BYTES", "URL", "ERROR"]
    assert table[1].split()[:2] == ["0", "done"]
    assert int(table[1].split()[2]) > 0  # the stored size, in bytes
    assert table[2].split()[:3] == ["1", "failed", "-"]
    assert "failed on purpose (hint: it is a test)"[:10] in table[2]
    assert table[3].split()[:2] == ["2", "done"]
    assert "…" in table[3]  # the long URL was cut, not wrapped
    assert all(len(line) <= 60 for line in table), table
    assert '"idx"' not in screen  # no JSON for people
    assert "partial, 3/3 target(s) stored, 1 failed" in screen


def test_run_piped_or_with_json_prints_the_same_json_lines(
    env: dict[str, str], tmp_path: Path, finish_pty: list[Pty]
) -> None:
    """Scripts keep working: piped output is JSON lines, and --json gives them on a TTY."""
    targets = write(tmp_path / "t.txt", "test://ok/1", "test://fail/2")
    piped = cli(env, "run", "--fetch", "cli_fetch:counting", targets)
    assert piped.returncode == 1
    assert [t["status"] for t in lines(piped.stdout)] == ["done", "failed"]
    assert lines(piped.stdout)[0]["result"] == {
        "content": "content of test://ok/1",
        "meta": {"len": 11},
    }
    # The same job again (reused), on a terminal with --json: the same lines, byte for byte.
    p = Pty(env, "run", "--json", "--no-progress", "--fetch", "cli_fetch:counting", targets)
    finish_pty.append(p)
    code, screen = _shown(p)
    assert code == 1
    out = [line for line in screen.splitlines() if line.startswith("{")]
    assert out == piped.stdout.splitlines()
    assert "IDX" not in screen


def test_run_output_writes_each_result_to_a_file_per_target(
    env: dict[str, str], tmp_path: Path
) -> None:
    """--output DIR: one file per stored result (binary decoded), none for a failed target."""
    page = tmp_path / "page.html"
    page.write_text("<p>caf\u00e9</p>\n", encoding="utf-8")
    blob = tmp_path / "logo.png"
    blob.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    targets = write(
        tmp_path / "t.txt", page.as_uri(), blob.as_uri(), (tmp_path / "missing").as_uri()
    )
    out_dir = tmp_path / "out" / "pages"
    done = cli(env, "run", targets, "--output", str(out_dir))
    assert done.returncode == 1, done.stderr
    assert len(lines(done.stdout)) == 3  # piped: the JSON lines as ever
    assert sorted(p.name for p in out_dir.iterdir()) == ["00-page.html", "01-logo.png.bin"]
    assert (out_dir / "00-page.html").read_text(encoding="utf-8") == "<p>caf\u00e9</p>\n"
    assert (out_dir / "01-logo.png.bin").read_bytes() == blob.read_bytes()
    assert f"2 result file(s) in {out_dir}" in done.stderr
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    refused = cli(env, "run", targets, "--output", str(blocked / "sub"))
    assert refused.returncode == 2
    assert "--output" in refused.stderr


def test_run_output_names_relative_file_urls_after_their_last_segment(
    env: dict[str, str], tmp_path: Path
) -> None:
    """`file:todo.txt` is written as NN-todo.txt, like any URL: never with its scheme."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "todo.txt").write_text("a")
    (tmp_path / "sub" / "notes.txt").write_text("b")
    (tmp_path / "sub" / "todo.txt").write_text("c")
    # (Not tmp_path/todo.txt again: made absolute, file:todo.txt names that very file.)
    targets = write(
        tmp_path / "t.txt",
        "file:todo.txt",
        "file:sub/notes.txt",
        (tmp_path / "sub" / "todo.txt").as_uri(),
    )
    done = cli(env, "run", targets, "--output", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "00-todo.txt",
        "01-notes.txt",
        "02-todo.txt",
    ]


def test_relative_file_urls_name_the_file_in_the_folder_run_from(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The same targets file run from two folders on one $BATCH_DB: each run reads its own
    folder's file. Submitted as written, the second reused the first's job (the key was
    the URL's text) and showed, and wrote, the other folder's content."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "my notes.txt").write_text(f"notes of {name}")
    targets = write(tmp_path / "t.txt", "file:my%20notes.txt", '{"url": "file:./my%20notes.txt?x"}')
    for name in ("a", "b"):
        done = cli(env, "run", targets, "--output", "out", cwd=tmp_path / name)
        assert done.returncode == 0, done.stderr
        assert "reused" not in done.stderr
        first, second = lines(done.stdout)
        assert first["url"] == (tmp_path / name / "my notes.txt").as_uri()
        assert second["url"] == (tmp_path / name / "my notes.txt").as_uri() + "?x"
        assert first["result"]["content"] == f"notes of {name}"
        assert (tmp_path / name / "out" / "00-my_20notes.txt").read_text() == f"notes of {name}"
    again = cli(env, "run", targets, cwd=tmp_path / "a")  # from the first folder: its job
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stderr
    assert lines(again.stdout)[0]["result"]["content"] == "notes of a"
    # Written both ways in one file, it is one file named twice: a duplicate.
    both = write(
        tmp_path / "both.txt", "file:my%20notes.txt", (tmp_path / "a" / "my notes.txt").as_uri()
    )
    done = cli(env, "run", both, cwd=tmp_path / "a")
    assert done.returncode == 2
    assert "both.txt:2" in _one_line_error(done)


def _watched_job(env: dict[str, str]) -> Iterator[tuple[batch.Runner, Any, str]]:
    from batch.testing import ScriptedFetch

    fetch = ScriptedFetch()
    gates = [fetch.gate("test://a"), fetch.gate("test://b")]
    with dcache.DB.open(env["BATCH_DB"]) as db, batch.Runner(db, fetch) as runner:
        try:
            job_id, _ = runner.submit(
                "web:alice", "web", [{"url": "test://a"}, {"url": "test://b"}]
            )
            gates[0].wait_entered()
            yield runner, gates, job_id
        finally:
            fetch.release_all()


def test_status_watch_redraws_the_table_on_a_terminal_until_the_job_ends(
    env: dict[str, str], finish_pty: list[Pty]
) -> None:
    """--watch follows a job drained elsewhere, redrawing in place, and exits 0 when done."""
    for runner, gates, job_id in _watched_job(env):
        p = Pty(env, "status", job_id, "--watch", "--interval", "0.05", cols=100)
        finish_pty.append(p)
        p.read_until("0/2 target(s)")
        assert "running" in p.seen
        gates[0].open()
        p.read_until("1/2 target(s)")
        gates[1].open()
        code, screen = _shown(p)
        assert code == 0, screen
        assert "done, 2/2 target(s) stored" in screen
        assert "\x1b[J" in screen  # cleared and redrawn in place, not scrolled
        redraws = screen.count("\x1b[J")
        assert redraws >= 3
        up = f"\x1b[{2 + 1 + 2}F"  # header (2 lines) + table header + 2 targets
        assert up in screen
        assert runner.job(job_id) is not None


def test_status_watch_piped_prints_a_line_per_change_then_the_table(
    env: dict[str, str],
) -> None:
    """Piped, --watch prints one summary line per change and the final table; --json one
    object per change, results left out and their sizes given."""
    import queue

    for json_mode in (False, True):
        env_i = dict(env)
        env_i["BATCH_DB"] = env["BATCH_DB"].replace(".sqlite3", f"-{json_mode}.sqlite3")
        for _runner, gates, job_id in _watched_job(env_i):
            extra = ["--json"] if json_mode else []
            proc = spawn(env_i, "status", job_id, "--watch", "--interval", "0.05", *extra)
            got: queue.Queue[str] = queue.Queue()
            assert proc.stdout is not None
            reader = threading.Thread(
                target=lambda: [got.put(line) for line in proc.stdout], daemon=True
            )
            reader.start()
            try:
                first = got.get(timeout=30)
                gates[0].open()
                second = got.get(timeout=30)
                gates[1].open()
                assert proc.wait(timeout=30) == 0
                reader.join(10)
            finally:
                proc.kill()
            rest = []
            while not got.empty():
                rest.append(got.get())
            if json_mode:
                states = [json.loads(x) for x in [first, second, *rest]]
                assert states[0]["job"]["status"] == "running"
                assert states[0]["targets"][0]["status"] == "running"
                assert states[-1]["job"]["status"] == "done"
                assert all(t["result"] is None for t in states[-1]["targets"])
                assert states[-1]["targets"][0]["bytes"] > 0
            else:
                assert first.startswith(f"job {job_id}: running, 0/2")
                assert second.startswith(f"job {job_id}: running, 1/2")
                text = "".join(rest)
                assert f"job {job_id}: done, 2/2" in text
                assert "IDX  STATUS  BYTES  URL" in text


def test_read_only_commands_open_the_store_not_a_runner(env: dict[str, str]) -> None:
    """status, jobs and cancel register no owner and reap nobody's jobs (a Runner would)."""
    with dcache.DB.open(env["BATCH_DB"]) as db:
        ids = []
        for name in ("one", "two"):
            outcome = db.submit(
                job_id=batch.new_job_id(),
                caller=f"web:{name}",
                caller_class="web",
                idem_key=name,
                targets=[dcache.NewTarget("test://a")],
                ttl=dt.timedelta(hours=1),
                jobs_per_caller=1,
                jobs_total=8,
                owner="ghost-owner-without-a-heartbeat-row",
            )
            ids.append(outcome.job.id)
        for args in (
            ["status", ids[0]],
            ["status", ids[0], "--json"],
            ["jobs"],
            ["jobs", "--live", "--json"],
            ["cancel", ids[0]],
        ):
            done = cli(env, *args)
            assert done.returncode == 0, (args, done.stderr)
        assert [o for o in db.owners() if o.present] == []  # no owner row registered
        assert [getattr(db.get_job(i), "status", None) for i in ids] == ["cancelled", "running"]
        # What a Runner does on start, for contrast: it registers itself as an owner.
        with batch.Runner(db, lambda t: batch.Result("x")):
            assert [o for o in db.owners() if o.present] != []


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_read_only_commands_leave_an_older_schema_untouched(
    env: dict[str, str], tmp_path: Path, backend: str
) -> None:
    """An operator's newer CLI must not migrate production under its older workers (they
    would refuse to start): status, jobs and cancel change no schema, and say who may."""
    from conftest import backend_url
    from sqlalchemy import inspect as sa_inspect
    from sqlalchemy import select, text

    from dcache._schema import meta

    url = backend_url(backend, tmp_path)
    env = {**env, "BATCH_DB": url}

    def state(db: dcache.DB) -> tuple[Any, list[str]]:
        with db.engine.connect() as conn:
            version = conn.execute(
                select(meta.c.value).where(meta.c.key == "schema_version")
            ).scalar()
            columns = sorted(c["name"] for c in sa_inspect(conn).get_columns("batch_target"))
        return version, columns

    with dcache.DB.open(url) as db:
        if backend != "sqlite":
            wipe(db)
        with batch.Runner(db, lambda t: batch.Result("x")) as runner:
            job_id, _ = runner.submit("old", "cli", [{"url": "test://a"}])
            runner.wait(job_id, timeout=30)
        with db.engine.begin() as conn:
            conn.execute(text("ALTER TABLE batch_target DROP COLUMN result_bytes"))
            conn.execute(text("UPDATE dcache_meta SET value = '2' WHERE value = '3'"))
        before = state(db)
        assert before[0] == "2" and "result_bytes" not in before[1]
        try:
            for args in (["status", job_id], ["jobs"], ["jobs", "--live"], ["cancel", job_id]):
                done = cli(env, *args)
                line = _one_line_error(done)
                assert done.returncode == 1, (args, line)
                assert "schema version 2, older than" in line, line
                assert state(db) == before, args
        finally:
            dcache.DB.open(url).close()  # a writer upgrades it back
        assert state(db)[0] == str(dcache.SCHEMA_VERSION)
    assert cli(env, "status", job_id).returncode == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"], indirect=True)
def test_a_schema_of_another_version_is_told_as_such_not_as_an_unreachable_server(
    env: dict[str, str], tmp_path: Path, backend: str
) -> None:
    """A newer schema read "cannot reach the database ...; check that a PostgreSQL server
    is running" (on SQLite: "check that the folder exists"): advice that sends the operator
    the wrong way. It names the versions and the fix, and exits 1 (a retry will not do)."""
    from conftest import backend_url

    url = backend_url(backend, tmp_path)
    env = {**env, "BATCH_DB": url}
    targets = write(tmp_path / "t.txt", "test://a")
    with dcache.DB.open(url) as db:
        if backend != "sqlite":
            wipe(db)
        v = str(dcache.SCHEMA_VERSION)
        with db.engine.begin() as conn:
            conn.exec_driver_sql(f"UPDATE dcache_meta SET value = '99' WHERE value = '{v}'")
        try:
            for args in (["jobs"], ["run", "--fetch", "cli_fetch:counting", targets]):
                done = cli(env, *args)
                line = _one_line_error(done)
                assert done.returncode == 1, (args, line)
                assert f"schema version 99, newer than this batch-dcache's {v}" in line, line
                assert "upgrade batch-dcache" in line, line
                assert "reach" not in line and "folder" not in line and "server" not in line
            with db.engine.begin() as conn:
                conn.exec_driver_sql("UPDATE dcache_meta SET value = '2' WHERE value = '99'")
            done = cli(env, "jobs")
            line = _one_line_error(done)
            assert done.returncode == 1, line
            assert f"schema version 2, older than this batch-dcache's {v}" in line, line
            assert "batch purge" in line, line  # a writer of this version upgrades it
            assert "reach" not in line and "folder" not in line
        finally:
            with db.engine.begin() as conn:
                conn.exec_driver_sql(f"UPDATE dcache_meta SET value = '{v}'")


def test_a_sqlite_url_naming_a_folder_or_a_file_that_is_not_a_database_says_so(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Both got "check that the folder exists and that you may write there": the folder
    existed, the file was readable; the URL names the wrong thing (exit 2, as a bad --db)."""
    targets = write(tmp_path / "t.txt", "test://a")
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"these are my notes, not a database\n" * 100)
    content = junk.read_bytes()
    for args in (["jobs"], ["status", "0" * 32], ["run", "--fetch", "cli_fetch:counting", targets]):
        done = cli(env, *args, "--db", f"sqlite:///{junk}")
        line = _one_line_error(done)
        assert done.returncode == 2, (args, line)
        assert "is not a SQLite database" in line, line
        assert "folder" not in line
        done = cli(env, *args, "--db", f"sqlite:///{tmp_path}")
        line = _one_line_error(done)
        assert done.returncode == 2, (args, line)
        assert f"{str(tmp_path)!r} is a folder, not a database file" in line, line
        assert f"sqlite:///{tmp_path / 'batch.sqlite3'}" in line, line
    assert junk.read_bytes() == content


def test_read_only_commands_build_no_runner(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, a spy on Runner.__init__ sees no runner built by status, jobs, cancel."""
    built: list[object] = []
    real_init = batch.Runner.__init__

    def spy(self: batch.Runner, *args: Any, **kw: Any) -> None:
        built.append(self)
        real_init(self, *args, **kw)

    monkeypatch.setenv("BATCH_DB", env["BATCH_DB"])
    with dcache.DB.open(env["BATCH_DB"]) as db, batch.Runner(db, lambda t: batch.Result("x")) as r:
        job_id, _ = r.submit("web:a", "web", [{"url": "test://a"}])
        r.wait(job_id, timeout=10)
    monkeypatch.setattr(batch.Runner, "__init__", spy)
    for args in (["status", job_id], ["status", job_id, "--watch"], ["jobs"], ["cancel", job_id]):
        _cli.main(args)
    assert built == []
    assert "already done" in capsys.readouterr().err
    monkeypatch.syspath_prepend(str(DATA))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"test://b\n")))
    assert _cli.main(["run", "--fetch", "cli_fetch:counting", "-"]) == 0
    assert len(built) == 1  # run drains: it does build one


def test_a_busy_caller_is_told_which_job_holds_the_cap_and_until_when(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The message names the job at the cap, its lease end, and the commands that help."""
    fetch = _Blocking()
    with dcache.DB.open(env["BATCH_DB"]) as db, batch.Runner(db, fetch) as runner:
        try:
            holder, _ = runner.submit("cli", "cli", [{"url": "test://a"}])
            job = runner.job(holder)
            assert job is not None and job.expires_at is not None
            targets = write(tmp_path / "t.txt", "test://other")
            busy = cli(env, "run", "--fetch", "cli_fetch:counting", targets)
            assert busy.returncode == 75, busy.stderr
            assert "caller 'cli' is busy" in busy.stderr
            assert f"job {holder} is running (0/1 target(s) stored" in busy.stderr
            assert "lease until " + job.expires_at.strftime("%Y-%m-%d") in busy.stderr
            assert f"batch status --watch {holder}" in busy.stderr
            assert f"batch cancel {holder}" in busy.stderr
            assert "Traceback" not in busy.stderr
        finally:
            fetch.gate.set()


def test_a_caller_held_by_a_dead_runs_job_is_told_its_runner_stopped_and_to_cancel(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A SIGKILLed ``run`` leaves its job running until a runner watches it for a whole
    staleness window, which no short CLI run does: the busy message must say the holder's
    runner stopped beating and that ``batch cancel ID`` frees the caller."""
    targets = write(tmp_path / "t.txt", "test://x/a", "test://x/b")
    proc = spawn(env, "run", "--fetch", "cli_fetch:blocking", targets)
    try:
        until(lambda: _started(tmp_path, "a"))
    finally:
        proc.kill()  # SIGKILL: no handler runs, the job stays running
        proc.communicate(timeout=30)
    holder = only_job(env)
    assert holder.status == "running"
    other = write(tmp_path / "u.txt", "test://y")
    busy = cli(env, "run", "--fetch", "cli_fetch:counting", other)
    assert busy.returncode == 75, busy.stderr
    assert "stopped" not in busy.stderr  # it beat a moment ago: no verdict yet
    # An hour later (moved in the database rather than waited for): no beat since.
    with sqlite3.connect(make_url(env["BATCH_DB"]).database or "") as conn:
        conn.execute(
            "UPDATE batch_owner SET heartbeat_at = datetime(heartbeat_at, '-1 hour'),"
            " stale_at = datetime(stale_at, '-1 hour')"
        )
    busy = cli(env, "run", "--fetch", "cli_fetch:counting", other)
    assert busy.returncode == 75, busy.stderr
    line = _one_line_error(busy)
    assert f"job {holder.id} is running" in line
    assert "its runner stopped beating" in line
    assert f"batch cancel {holder.id}" in line
    # Its runner's row gone altogether (a runner that stopped and removed it): the same.
    with sqlite3.connect(make_url(env["BATCH_DB"]).database or "") as conn:
        conn.execute("DELETE FROM batch_owner")
    busy = cli(env, "run", "--fetch", "cli_fetch:counting", other)
    assert busy.returncode == 75, busy.stderr
    assert "its runner stopped beating" in _one_line_error(busy)
    # And the advice works: cancel it, run again.
    assert cli(env, "cancel", holder.id).returncode == 0
    again = cli(env, "run", "--fetch", "cli_fetch:counting", other)
    assert again.returncode == 0, again.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_role_that_may_not_create_the_store_is_told_so(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A role without CREATE on the schema (PostgreSQL 15's default for any role but the
    database's owner) was told to check that the server is running; it is told what to
    grant."""
    from conftest import backend_url
    from sqlalchemy import create_engine, text

    admin_url = make_url(backend_url("postgresql", tmp_path))
    suffix = os.urandom(4).hex()
    role, database = f"batch_noperm_{suffix}", f"batch_noperm_{suffix}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
            conn.execute(text(f"CREATE DATABASE {database}"))
        with create_engine(
            admin_url.set(database=database), isolation_level="AUTOCOMMIT"
        ).connect() as conn:
            conn.execute(text(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}"))
        url = admin_url.set(username=role, password=None, database=database)
        done = cli(env, "run", "-", "--db", url.render_as_string(), stdin="test://a\n")
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "permission denied" in line
        assert "is running" not in line
        assert f"may not create the store's tables in {database!r}" in line
        assert f"createdb -O {role}" in line or "GRANT" in line
        # The store made by its owner, the role may not read it: told what to grant.
        dcache.DB.open(admin_url.set(database=database).render_as_string(False)).close()
        done = cli(env, "jobs", "--db", url.render_as_string())
        assert done.returncode == 1, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "permission denied for table" in line
        assert "may not create" not in line
        assert "GRANT it CONNECT on the database and SELECT, INSERT, UPDATE, DELETE" in line
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


def test_an_unreachable_database_names_the_url_and_what_to_check(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Which URL (password hidden), why, and what to check; exit 75 when worth a retry."""
    port = _closed_port()
    url = f"postgresql+psycopg://someone:Pw-secret@127.0.0.1:{port}/nothing"
    for args in (["jobs"], ["status", "f" * 32], ["cancel", "f" * 32], ["run", "-"]):
        done = cli(env, *args, "--db", url, stdin="test://a\n")
        assert done.returncode == 75, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert (
            f"cannot reach the database postgresql+psycopg://someone:***@127.0.0.1:{port}/nothing"
        )
        assert f"postgresql+psycopg://someone:***@127.0.0.1:{port}/nothing" in line
        assert (
            f"check that a PostgreSQL server is running and accepts connections on 127.0.0.1:{port}"
            in line
        )
        assert "Pw-secret" not in line
    mysql = cli(env, "jobs", "--db", f"mysql+pymysql://root:Pw-secret@127.0.0.1:{port}/x")
    assert mysql.returncode == 75
    assert (
        f"MySQL/MariaDB server is running and accepts connections on 127.0.0.1:{port}"
        in mysql.stderr
    )
    sqlite = cli(
        env, "run", "-", "--db", f"sqlite:///{tmp_path}/no/such/folder/x.sqlite3", stdin="test://a"
    )
    assert sqlite.returncode != 0
    assert f"check that the folder '{tmp_path}/no/such/folder' exists" in sqlite.stderr
    # A read-only command creates nothing: there is no store there, and it says why.
    sqlite = cli(env, "jobs", "--db", f"sqlite:///{tmp_path}/no/such/folder/x.sqlite3")
    assert sqlite.returncode == 2
    assert "no batch store at" in sqlite.stderr
    assert f"the folder '{tmp_path}/no/such/folder' does not exist" in sqlite.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_a_missing_database_on_a_live_server_says_to_create_it(
    env: dict[str, str], backend: str
) -> None:
    """A server that answers but lacks the database: the message says which name to create."""
    base = SERVER_URLS[backend]
    scheme_host, _, rest = base.rpartition("/")
    query = "?" + rest.split("?", 1)[1] if "?" in rest else ""
    url = f"{scheme_host}/no_such_db_for_batch_cli{query}"
    done = cli(env, "jobs", "--db", url)
    # 1, not 75 ("retry later"): a retry will not create the database.
    assert done.returncode == 1, done.stderr
    assert "check the database name 'no_such_db_for_batch_cli' (create it first)" in done.stderr


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_an_unknown_user_is_a_failure_that_says_to_check_the_user(
    env: dict[str, str], backend: str
) -> None:
    """Refused at login: exit 1 with advice about the user, not about the database name."""
    url = make_url(SERVER_URLS[backend]).set(username="no_such_user_for_batch_cli")
    done = cli(env, "jobs", "--db", url.render_as_string(hide_password=False))
    assert done.returncode == 1, done.stderr
    assert "check the user name and password in the URL" in done.stderr
    assert "create it first" not in done.stderr


def test_completion_scripts_are_generated_and_valid(tmp_path: Path) -> None:
    """bash and zsh scripts come from the parser, parse cleanly, and complete commands."""
    import shutil

    scripts = {}
    for shell in ("bash", "zsh"):
        done = subprocess.run(
            [sys.executable, "-m", "batch", "completion", shell],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        scripts[shell] = tmp_path / f"batch.{shell}"
        scripts[shell].write_text(done.stdout)
        assert "--watch" in done.stdout
        assert "--output" in done.stdout
    check = subprocess.run(["bash", "-n", str(scripts["bash"])], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    probe = (
        f"source {scripts['bash']}; "
        'COMP_WORDS=(batch st); COMP_CWORD=1; _shtab_batch; echo "${COMPREPLY[*]}"; '
        'COMP_WORDS=(batch run --ou); COMP_CWORD=2; _shtab_batch; echo "${COMPREPLY[*]}"; '
        'COMP_WORDS=(batch completion ""); COMP_CWORD=2; _shtab_batch; echo "${COMPREPLY[*]}"'
    )
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == ["status", "--output", "bash zsh"], done.stderr
    if shutil.which("zsh") is None:
        if os.environ.get("CI"):
            pytest.fail("zsh is not installed (apt-get install zsh)")
        pytest.skip("zsh is not installed")
    check = subprocess.run(["zsh", "-n", str(scripts["zsh"])], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "#compdef batch" in scripts["zsh"].read_text()


@pytest.mark.parametrize(
    "command", ["run", "status", "cancel", "jobs", "purge", "serve", "completion"]
)
def test_every_command_has_help_with_examples(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batch COMMAND --help` reads like a man page: what it does, then examples."""
    assert _cli.main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "examples:" in text
    examples = text.split("examples:", 1)[1]
    assert f"batch {command}" in examples
    assert _cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    for heading in ("commands:", "environment:", "exit statuses:", "examples:"):
        assert heading in top


def test_tables_show_stored_text_inert_and_within_the_width() -> None:
    """Escape sequences in stored text cannot drive the terminal; wide characters count
    two columns."""
    from batch import _cli_show

    hostile = batch.TargetStatus(
        idx=0,
        url="test://\x1b]0;owned\x07/\u5b57\u5b57\u5b57\u5b57\u5b57\u5b57\u5b57\u5b57",
        status="failed",
        result=None,
        error="boom\x1b[2J\nsecond line\u200b",
        hint="",
    )
    for width in (30, 50, 200):
        rows = _cli_show.target_rows([hostile], width)
        assert all("\x1b" not in row and "\x07" not in row and "\n" not in row for row in rows)
        assert all(_cli_show.display_width(row) <= max(width, 30) for row in rows), rows
    wide = _cli_show.target_rows([hostile], 200)[1]
    assert "\\x1b]0;owned\\x07" in wide
    assert "boom\\x1b[2J second line" in wide
    assert _cli_show.fit("\u5b57" * 10, 7) == "\u5b57" * 3 + "…"
    job = batch.Job(
        id="j1",
        status="failed",
        error="restart\x1b[2J",
        targets_total=1,
        targets_done=1,
        finished_at=None,
        caller="ev\x1b]0;pwned\x07il",
        caller_class="x\x9b31m",
    )
    for width in (None, 40, 200):  # piped (None) as on a terminal
        lines = _cli_show.job_lines(job, [hostile], width)
        assert all(not any(c in line for c in "\x1b\x07\x9b\n") for line in lines), lines
    head = _cli_show.job_lines(job, [], None)
    assert "caller ev\\x1b]0;pwned\\x07il (x\\x9b31m)" in head[1]
    assert "(restart\\x1b[2J)" in head[0]


def test_the_cli_runs_without_the_optional_extras(tmp_path: Path) -> None:
    """The README's first command runs on `pip install -e .` alone: no Flask, Jinja2, tqdm
    or shtab is imported unless the command needs it."""
    code = (
        "import sys\n"
        "for name in ('flask', 'jinja2', 'werkzeug', 'tqdm', 'shtab', 'prometheus_client'):\n"
        "    sys.modules[name] = None  # importing it now raises ImportError\n"
        "from batch._cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    data = Path(__file__).parent / "data" / "offline.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCH_")}
    env["BATCH_DB"] = f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
    done = subprocess.run(
        [sys.executable, "-c", code, "run", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).parent.parent,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert all(t["status"] == "done" for t in lines(done.stdout))
    completion = subprocess.run(
        [sys.executable, "-c", code, "completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert completion.returncode == 2
    assert "pip install 'batch-dcache[cli]'" in completion.stderr


def test_status_json_is_written_a_result_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``status --json`` prints what one read with every result would (byte for byte),
    but reads and writes the results one at a time: memory holds about one of them."""
    import tracemalloc

    url = f"sqlite:///{tmp_path / 'big.sqlite3'}"
    size = 1 << 20  # characters of each result; 2 MiB of UTF-8 ("é")

    def fetch(target: batch.Target) -> batch.Result:
        if target.url.endswith("/bad"):
            raise batch.FetchError("nope", hint="a hint ü")
        return batch.Result("é" * size, {"url": target.url, "ü": ["😀"]})

    urls = [f"https://example.org/{i}" for i in range(8)] + ["https://example.org/bad"]
    with dcache.DB.open(url) as db, batch.Runner(db, fetch) as runner:
        job_id, _ = runner.submit("alice", "cli", [{"url": u} for u in urls])
        assert runner.wait(job_id, timeout=60) is not None
        found = runner.status(job_id)
        assert found is not None
        job, targets = found
        expected = json.dumps(
            {"job": job.to_json(), "targets": [t.to_json() for t in targets]}, ensure_ascii=False
        )
        del found, targets
    monkeypatch.setenv("BATCH_DB", url)
    out = tmp_path / "status.json"
    with out.open("w", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        tracemalloc.start()
        try:
            assert _cli.main(["status", job_id, "--json"]) == 0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert out.read_text("utf-8") == expected + "\n"
    assert json.loads(expected)["targets"][8]["status"] == "failed"
    # Eight results of 2 MiB (UTF-8) each: one read holding them all peaks far above this.
    assert peak < 8 * (2 * size), f"peak {peak / 2**20:.1f} MiB"


def _status_json(
    url: str, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    """``batch status JOB --json`` in this process: its exit status and its stdout."""
    monkeypatch.setenv("BATCH_DB", url)
    out = tmp_path / "status.json"
    with out.open("w", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        code = _cli.main(["status", job_id, "--json"])
    return code, out.read_text("utf-8")


def test_status_json_of_a_running_job_shows_it_as_the_runner_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed while a target is in flight: the stored results, the target in flight as
    ``running`` and the rest ``pending``, exactly as one read through the runner shows."""
    url = f"sqlite:///{tmp_path / 'running.sqlite3'}"
    started, go = threading.Event(), threading.Event()

    def fetch(target: batch.Target) -> batch.Result:
        if target.url.endswith("/2"):
            started.set()
            assert go.wait(30)
        return batch.Result(f"body of {target.url}", {"n": target.url[-1]})

    with dcache.DB.open(url) as db, batch.Runner(db, fetch) as runner:
        job_id, _ = runner.submit(
            "alice", "cli", [{"url": f"https://example.org/{i}"} for i in range(4)]
        )
        assert started.wait(30)
        try:
            found = runner.status(job_id)
            assert found is not None
            job, targets = found
            expected = json.dumps(
                {"job": job.to_json(), "targets": [t.to_json() for t in targets]},
                ensure_ascii=False,
            )
            code, text = _status_json(url, job_id, tmp_path, monkeypatch)
        finally:
            go.set()
        assert runner.wait(job_id, timeout=30) is not None
    assert (code, text) == (0, expected + "\n")
    shown = json.loads(text)
    assert shown["job"]["status"] == "running"
    assert [t["status"] for t in shown["targets"]] == ["done", "done", "running", "pending"]
    assert shown["targets"][1]["result"]["content"] == "body of https://example.org/1"


def _finished_job(url: str, n: int) -> str:
    with dcache.DB.open(url) as db, batch.Runner(db, lambda t: batch.Result(t.url)) as runner:
        job_id, _ = runner.submit(
            "alice", "cli", [{"url": f"https://example.org/{i}"} for i in range(n)]
        )
        assert runner.wait(job_id, timeout=30) is not None
    return job_id


def _before_result_read(monkeypatch: pytest.MonkeyPatch, nth: int, act: Callable[[], None]) -> None:
    """Run ``act`` (a real change to the database) just before the CLI's ``nth`` read of
    one target's result."""
    read = _cli.StoreReader.result
    calls = 0

    def result(self: _cli.StoreReader, job: str, idx: int) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            act()
        return read(self, job, idx)

    monkeypatch.setattr(_cli.StoreReader, "result", result)


def test_status_json_ends_its_line_and_fails_when_the_job_lapses_midway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job is purged (its lease really lapsed) after two results were written: the
    line is ended unfinished, stderr says why, and the exit status is 1."""
    url = f"sqlite:///{tmp_path / 'lapse.sqlite3'}"
    job_id = _finished_job(url, 4)

    def lapse() -> None:
        later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=365)
        with dcache.DB.open(url) as other:
            assert other.purge_expired(later) == 1

    _before_result_read(monkeypatch, 3, lapse)
    code, text = _status_json(url, job_id, tmp_path, monkeypatch)
    assert code == _cli.EXIT_FAILED
    assert text.endswith("\n") and text.count("\n") == 1
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert text.count('"content"') == 2
    assert "lapsed while its results were read" in capsys.readouterr().err


def test_status_json_ends_its_line_when_the_database_fails_midway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read fails (the targets' table is gone) after one result was written: the line is
    ended, the error is the usual one-line database error, and the exit status is 1."""
    url = f"sqlite:///{tmp_path / 'broken.sqlite3'}"
    job_id = _finished_job(url, 3)

    def break_it() -> None:
        with contextlib.closing(sqlite3.connect(tmp_path / "broken.sqlite3")) as conn:
            conn.execute("DROP TABLE batch_target")

    _before_result_read(monkeypatch, 2, break_it)
    code, text = _status_json(url, job_id, tmp_path, monkeypatch)
    assert code == _cli.EXIT_FAILED
    assert text.endswith("\n") and text.count("\n") == 1
    assert text.count('"content"') == 1
    err = capsys.readouterr().err
    assert "database error on sqlite:///" in err and "batch_target" in err
