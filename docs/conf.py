"""Sphinx configuration: Markdown pages (MyST), the reference from the docstrings (autodoc,
Google style), every code example run by the doctest builder.

Build: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``; examples:
``python -m sphinx -W --keep-going -n -b doctest docs docs/_build/doctest``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "batch + dcache"
author = "the batch-dcache authors"
copyright = "the batch-dcache authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "batch + dcache"
html_static_path: list[str] = []

# The reference: every public name, in the order of the source, typed signatures.
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autoclass_content = "class"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The build runs offline (CI has no network), so there is no intersphinx: names from the
# standard library and the dependencies are shown, not linked. Everything of our own must
# resolve (-n).
nitpick_ignore_regex = [
    (r"py:.*", r"(datetime|threading|logging|collections|typing|types|re|os|ssl|socket)\..*"),
    (r"py:.*", r"(sqlalchemy|flask|werkzeug|prometheus_client|attrs|attr|pytest|_pytest)\..*"),
    (r"py:.*", r"(ipaddress|urllib|http|email|json|queue|concurrent|enum|pathlib|sqlite3)\..*"),
    (r"py:class", r"(Engine|Connection|Request|Response|Flask|Blueprint|Logger|Event)"),
    (r"py:class", r"(P|R|T|_R|ParamSpec|TypeVar|Literal|Any|Callable|Iterator|Sequence)"),
    (r"py:class", r"(Mapping|Iterable|Self|TypeAlias|IPv4Address|IPv6Address)"),
    (r"py:class", r"(timedelta|datetime|Pool|Path|FrameType|Lock)"),
    (r"py:class", r"(NoneType|Ellipsis|EllipsisType|builtins\..*)"),
    (r"py:mod", r"(secrets|ipaddress|time|threading|logging|json|sqlite3)"),
    (r"py:func", r"time\..*"),
    (r"py:class", r"(batch|dcache)\._\w+\..*"),  # a private base class (show-inheritance)
]


def _fix_docstring(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    # ``Target``s is not valid reStructuredText (an inline literal must end at a word
    # boundary); batch/_values.py says it in normalize_targets' docstring.
    for i, line in enumerate(lines):
        lines[i] = line.replace("``Target``s", "``Target`` objects")


def setup(app: object) -> None:
    app.connect("autodoc-process-docstring", _fix_docstring)  # type: ignore[attr-defined]

# Examples: each page's code runs in its own namespace, in a folder of its own, against a
# memory store or a SQLite file there, and (in the tutorial's last part) the PostgreSQL
# server named by DCACHE_TEST_POSTGRES_URL when it is set.
doctest_global_setup = f"""
import os as _os, sys as _sys
_sys.path.insert(0, {str(ROOT)!r})
_PG = _os.environ.get("BATCH_DOCS_POSTGRES_URL")
"""
doctest_test_doctest_blocks = ""  # only the explicit testcode / doctest directives run
os.environ.setdefault("BATCH_DOCS_BUILD", "1")
