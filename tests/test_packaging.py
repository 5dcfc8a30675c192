"""What a wheel of the project carries and does once installed.

Every other test runs the source tree (an editable install), which would not notice a
wheel without the dashboard's templates, its static files or ``py.typed``: an app
installed from the wheel would answer the dashboard with a 500. The wheel is built from a
copy of the tree (so no ``build/`` is left in it), offline, by the setuptools the test
extras install, and run from its own files in a child process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("batch", "dcache")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _package_files() -> set[str]:
    """The source tree's files of the packages, as wheel paths: what the wheel's build
    copies (the same ``_IGNORE`` rule)."""
    found = set()
    for pkg in PACKAGES:
        for folder, dirs, files in os.walk(REPO / pkg):
            ignored = _IGNORE(folder, dirs + files)
            dirs[:] = [d for d in dirs if d not in ignored]
            rel = Path(folder).relative_to(REPO)
            found.update((rel / f).as_posix() for f in files if f not in ignored)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=_IGNORE)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--quiet", "--wheel-dir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    # setuptools warns of a folder it might leave out of a later build (it did so for the
    # dashboard's assets before the packages were found rather than listed).
    assert "would be ignored" not in build.stdout + build.stderr
    (found,) = out.glob("batch_dcache-*.whl")
    return found


def test_the_wheel_carries_every_file_of_both_packages(wheel: Path) -> None:
    """Modules, the dashboard's templates and static files, and both ``py.typed``."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entries = zf.read(entry_points).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packaged = {n for n in names if n.split("/")[0] in PACKAGES}
    expected = _package_files()
    assert packaged == expected
    for needed in (
        "batch/py.typed",
        "dcache/py.typed",
        "batch/templates/dashboard/jobs.html",
        "batch/static/dashboard/dashboard.js",
    ):
        assert needed in packaged
    assert "batch = batch.__main__:main" in entries  # the `batch` command
    assert "[pytest11]" in entries and "batch.testing = batch.testing" in entries  # the fixtures
    assert "Requires-Dist: SQLAlchemy" in metadata


def test_an_app_runs_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    """Unpacked on its own path, ahead of the source tree: a job drains, the dashboard
    renders from the packaged templates and serves its packaged script."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    script = f"""
import batch, batch.flask, dcache
from flask import Flask

site = {str(site)!r}
assert batch.__file__.startswith(site) and dcache.__file__.startswith(site), batch.__file__
store = dcache.DB.memory()
with batch.Runner(store, lambda target: batch.Result("ok " + target.url)) as runner:
    job_id, _ = runner.submit("alice", "gold", [{{"url": "https://example.com/a"}}])
    assert runner.wait(job_id, timeout=30).status == "done"
    app = Flask(__name__)
    app.register_blueprint(batch.flask.dashboard(runner, lambda request: True))
    client = app.test_client()
    page = client.get("/batch/jobs/" + job_id)
    assert page.status_code == 200, page.status_code
    assert job_id in page.get_data(as_text=True)
    asset = client.get("/batch/static/dashboard.js")
    assert asset.status_code == 200 and len(asset.get_data()) > 0
    asset.close()
print("served from", batch.__file__)
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,  # not the repository: its packages must not be found instead
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"served from {site}")
