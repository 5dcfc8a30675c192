"""One SQL source: statements are built from the Core tables; SQL text lives in one module.

``dcache/_sql.py`` says why each remaining piece of text exists (SQLite's PRAGMAs and
transaction control, MySQL's server variables and catalog, ``ADD COLUMN``). Anywhere
else in the library a string that reads like a statement is a second statement of the
schema, which this test refuses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {ROOT / "dcache" / "_sql.py"}
STATEMENT = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|PRAGMA|BEGIN|COMMIT|ROLLBACK|SAVEPOINT|ALTER|CREATE|"
    r"DROP|SET|WITH|EXPLAIN|LOCK|TRUNCATE|REPLACE)\s+\S"
)


def _sources() -> list[Path]:
    return sorted(p for pkg in ("dcache", "batch") for p in (ROOT / pkg).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _statements_in(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # its parts are read with it
            skip.update(id(v) for v in node.values)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
            text = "".join(str(p) for p in parts)
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            text = node.value
        else:
            continue
        if STATEMENT.match(text):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:60]!r}")
    return found


def test_sql_text_lives_in_one_module() -> None:
    found = [hit for p in _sources() if p not in ALLOWED for hit in _statements_in(p)]
    assert not found, "SQL text outside dcache/_sql.py:\n" + "\n".join(found)


def test_the_check_sees_sql_text() -> None:
    """The scanner itself finds statements in plain and f-strings, and skips docstrings."""
    assert _statements_in(ROOT / "dcache" / "_sql.py")
    src = ROOT / "tests" / "data" / "sql_text_sample.py"
    if not src.exists():
        pytest.fail(f"{src} is missing")
    hits = _statements_in(src)
    assert [h.split(": ", 1)[1] for h in hits] == ["'SELECT 1'", "'PRAGMA x = '"]


# -- statuses --------------------------------------------------------------------------------

STATUS_NAMES = {"queued", "running", "done", "failed", "partial", "cancelled", "pending"}
DELIVERY_NAMES = {"pending", "delivered", "failed"}


def _status_literals_in(source: str, name: str) -> list[str]:
    """String constants that spell a job, target or notification status, outside the
    bodies of the enums that define them (``dcache._schema.Status`` and ``Delivery``)."""
    tree = ast.parse(source, name)
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in ("Status", "Delivery"):
            skip.update(id(n) for n in ast.walk(node))
    return [
        f"{name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in STATUS_NAMES | DELIVERY_NAMES
        and id(node) not in skip
    ]


def test_statuses_are_spelled_only_by_their_enums() -> None:
    """The schema, the SQL, the values, the HTTP API and the CLI name a status through
    ``dcache.Status`` (or ``dcache.Delivery`` for notifications), never as a literal."""
    import dcache

    assert {s.value for s in dcache.Status} == STATUS_NAMES
    assert {s.value for s in dcache.Delivery} == DELIVERY_NAMES
    found = [
        hit
        for p in _sources()
        for hit in _status_literals_in(p.read_text(), str(p.relative_to(ROOT)))
    ]
    assert not found, "status spelled outside its enum:\n" + "\n".join(found)


def test_the_check_sees_status_literals() -> None:
    sample = '''
class Status:
    DONE = "done"

def f(row):
    """Whether it is "done"."""
    return {"status": "failed"} if row.status == "running" else Status.DONE
'''
    hits = _status_literals_in(sample, "sample.py")
    assert sorted(h.split(": ", 1)[1] for h in hits) == ["'failed'", "'running'"]
