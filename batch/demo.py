"""A real batch, offline, on the SQLite default: ``python -m batch.demo``.

It writes a few local pages into a temporary folder, submits them (plus one that does not
exist) as ``file://`` targets to a runner on ``sqlite:///batch.sqlite3``, waits for the
job, and prints each target's outcome as a JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import dcache

from ._runner import Runner
from ._values import Result, Target
from .fetchers import Fetcher

_file_fetcher = Fetcher(schemes=("file",))


def fetch_file(target: Target) -> Result:
    """Read a ``file://`` URL: the content, with its type, size and path as metadata."""
    return _file_fetcher(target)


def main(argv: list[str] | None = None) -> int:
    """Run the demo batch; exit 0 once the job has finished (one target fails on purpose)."""
    args = sys.argv[1:] if argv is None else argv
    url = args[0] if args else "sqlite:///batch.sqlite3"
    with tempfile.TemporaryDirectory(prefix="batch-demo-") as tmp:
        pages = []
        for i, body in enumerate(["alpha\nbeta\n", "gamma\ndelta\n", "épsilon ζ\n"]):
            page = Path(tmp, f"page{i}.txt")
            page.write_text(body, encoding="utf-8")
            pages.append(page.as_uri())
        targets: list[object] = [{"url": u} for u in pages]
        targets.append({"url": pages[0], "options": {"grep": "beta"}})
        targets.append({"url": Path(tmp, "missing.txt").as_uri()})
        with dcache.DB.open(url) as db, Runner(db, fetch_file) as runner:
            job_id, reused = runner.submit("demo", "script", targets)
            print(f"job {job_id} ({'reused' if reused else 'new'}) on {url}", file=sys.stderr)
            job = runner.wait(job_id, timeout=60)
            found = runner.status(job_id)
            assert job is not None and found is not None
            for t in found[1]:
                print(json.dumps(t.to_json(), ensure_ascii=False))
            print(
                f"job {job.id}: {job.status}, {job.targets_done}/{job.targets_total} "
                "targets stored",
                file=sys.stderr,
            )
            return 0 if job.terminal else 1


if __name__ == "__main__":
    raise SystemExit(main())
