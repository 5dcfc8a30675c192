"""The suite's own parallel runs (``pytest -n``): a test that restarts a shared server runs
alone, while the others still run side by side (tests/conftest.py, _whole_server_turn)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="pytest-xdist: pip install -e '.[dev]'")

TESTS = Path(__file__).resolve().parent

TRIAL = """
import os, time
from pathlib import Path

import pytest

def _hold(name):
    with Path(os.environ["TURN_LOG"]).open("a") as log:
        log.write(f"{name} start {time.monotonic()}\\n")
    time.sleep(0.4)
    with Path(os.environ["TURN_LOG"]).open("a") as log:
        log.write(f"{name} end {time.monotonic()}\\n")

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    _hold(f"plain{i}")

@pytest.mark.whole_server
def test_alone():
    _hold("alone")
"""


def test_a_whole_server_test_runs_alone_while_the_others_run_side_by_side(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_trial.py").write_text(TRIAL)
    log = tmp_path / "turns.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TURN_LOG=str(log), PYTHONPATH=str(TESTS))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "-p", "conftest", "-p", "no:cacheprovider"]
        + ["-c", os.devnull, "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base")]
        + ["-q", str(tmp_path / "test_trial.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    spans: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        name, _, at = line.split()
        spans.setdefault(name, []).append(float(at))
    assert len(spans) == 9, spans
    a0, a1 = spans.pop("alone")
    for name, (s0, s1) in spans.items():
        assert s1 <= a0 or s0 >= a1, f"{name} ran while the whole-server test did"
    # Not vacuous: the plain tests did overlap one another.
    ordered = sorted(spans.values())
    assert any(b[0] < a[1] for a, b in zip(ordered, ordered[1:])), ordered
