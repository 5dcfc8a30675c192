"""The documentation site: it builds with warnings as errors, every example in it runs, every
public name is in its reference, and the README's quickstart runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REQUIRE_SERVERS, SERVER_URLS, _check_server

import batch
import batch.events
import batch.fetchers
import batch.flask
import batch.testing
import dcache

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
NOT_OURS = {"http-api.md"}  # written alongside, by the HTTP API's owner

# Two Sphinx builds of a few seconds each.
pytestmark = pytest.mark.slow

pytest.importorskip("sphinx", reason="the docs toolchain: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs toolchain: pip install -e '.[docs]'")
pytest.importorskip("furo", reason="the docs toolchain: pip install -e '.[docs]'")


def sphinx(builder: str, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``sphinx-build -W --keep-going -n -b BUILDER docs OUT``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", builder]
        + [str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=ROOT,
        check=False,
    )


@pytest.fixture(scope="module")
def html(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("html")
    done = sphinx("html", out)
    assert done.returncode == 0, done.stdout + done.stderr
    yield out


def test_the_site_builds_with_warnings_as_errors(html: Path) -> None:
    """A broken reference, an unknown name or a bad docstring fails the build, not the reader."""
    for page in (
        "index.html",
        "tutorial/script.html",
        "tutorial/flask.html",
        "tutorial/workers.html",
        "howto/gunicorn.html",
        "howto/pgbouncer.html",
        "howto/operate.html",
        "howto/testing.html",
        "howto/webhooks.html",
        "cli.html",
        "guarantees.html",
        "http-api.html",
        "reference/index.html",
    ):
        assert (html / page).is_file(), page
    assert (html / "_images" / "dashboard-jobs.png").is_file()


@pytest.mark.parametrize(
    ("module", "page"),
    [
        (batch, "batch"),
        (batch.flask, "flask"),
        (batch.fetchers, "fetchers"),
        (batch.events, "events"),
        (batch.testing, "testing"),
        (dcache, "dcache"),
    ],
)
def test_every_public_name_is_in_the_reference(html: Path, module: object, page: str) -> None:
    """Each name in a module's ``__all__`` has its entry, generated from its docstring."""
    text = (html / "reference" / f"{page}.html").read_text(encoding="utf-8")
    names: list[str] = list(module.__all__)  # type: ignore[attr-defined]
    missing = []
    for name in names:
        if module is batch and name in ("StoreError", "StoreUnavailableError", "events"):
            where, owner = (html / "reference" / "dcache.html"), "dcache"
            if name == "events":
                where, owner = (html / "reference" / "events.html"), "batch.events"
                name = ""
            found = where.read_text(encoding="utf-8")
            anchor = f'id="{owner}.{name}"' if name else f'id="module-{owner}"'
            if anchor not in found:
                missing.append(f"{owner}.{name}")
            continue
        if f'id="{module.__name__}.{name}"' not in text:  # type: ignore[attr-defined]
            missing.append(name)
    assert missing == []


def test_the_guarantees_page_is_the_readmes_section(html: Path) -> None:
    """One text for both: the site includes the README's Guarantees as they stand."""
    section = README.read_text(encoding="utf-8").split("## Guarantees", 1)[1]
    first = re.search(r"`(test_\w+)`", section)
    assert first is not None
    assert first.group(1) in (html / "guarantees.html").read_text(encoding="utf-8")


def test_every_example_in_the_docs_runs(tmp_path: Path) -> None:
    """The doctest builder runs every example, checking its output, against memory stores,
    SQLite files, scripted fetches and (where a page says PostgreSQL) the test server."""
    env = {}
    try:
        _check_server("postgresql")  # fails here in CI when the server is down
    except pytest.skip.Exception:
        pass  # locally without PostgreSQL: those pages fall back to SQLite files
    else:
        env["BATCH_DOCS_POSTGRES_URL"] = SERVER_URLS["postgresql"]
    done = sphinx("doctest", tmp_path / "doctest", **env)
    report = (tmp_path / "doctest" / "output.txt").read_text(encoding="utf-8")
    assert done.returncode == 0, report + done.stdout + done.stderr
    counts = re.search(r"(\d+) tests\n\s+0 failures in tests", report)
    assert counts is not None, report
    assert int(counts.group(1)) >= 25, report
    assert "0 failures in setup code" in report
    assert "0 failures in cleanup code" in report
    if REQUIRE_SERVERS:
        assert "BATCH_DOCS_POSTGRES_URL" in env
        assert not re.search(r"[1-9]\d* tests? skipped", report), report


def test_no_python_example_escapes_the_doctest(tmp_path: Path) -> None:
    """A plain ```python block would be shown but never run: every one is a testcode."""
    plain = []
    for page in DOCS.rglob("*.md"):
        if page.name in NOT_OURS or "_build" in page.parts:
            continue
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if re.match(r"^\s*```+\s*(python|py|pycon)\b", line):
                plain.append(f"{page.relative_to(DOCS)}:{lineno}")
    assert plain == []


def test_the_readmes_quickstart_runs(tmp_path: Path) -> None:
    """The quickstart a newcomer copies runs as written, with the kit's scripted fetch in
    place of the network (the only line changed)."""
    text = README.read_text(encoding="utf-8")
    quickstart = text.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", quickstart, re.S)
    assert code is not None
    source = code.group(1)
    line = "from batch.fetchers import fetch"
    assert line in source
    source = source.replace(
        line, "from batch.testing import ScriptedFetch; fetch = ScriptedFetch()"
    )
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0 done 32", "1 done 32"]
    assert (tmp_path / "batch.sqlite3").exists()
