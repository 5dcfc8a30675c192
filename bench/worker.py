"""One measurement in a fresh process: a ``Spec`` as JSON on stdin, rows as JSON on stdout.

``python -m bench.worker < spec.json`` prints ``BENCH-RESULT {"rows": [...]}`` per
measurement (``{"error": ...}`` when one failed); stdin may also hold a list of specs.
The parent runs every measurement this way so that no row inherits another's caches,
threads or heap (``--pack`` trades some of that for speed).
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback

from bench._env import Spec

MARK = "BENCH-RESULT "


def main() -> int:
    doc = json.loads(sys.stdin.read())
    from bench import _cases

    if isinstance(doc, dict) and doc.get("case") == "memory-setup":
        print(_cases.memory_setup(Spec.from_json(json.dumps(doc))))
        return 0
    # One spec, or a list of them (``--quick`` packs several measurements per process).
    specs = doc if isinstance(doc, list) else [doc]
    failed = 0
    for i, d in enumerate(specs):
        spec = Spec.from_json(json.dumps(d))
        gc.collect()
        t0 = time.monotonic()
        try:
            out: dict[str, object] = {"rows": _cases.run(spec)}
        except Exception as exc:
            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            failed += 1
        out.update(index=i, seconds=time.monotonic() - t0)
        print(MARK + json.dumps(out), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
