"""JSON encoding for HTTP answers: orjson when installed (extra ``[fast]``), else the stdlib.

Both produce the same document: UTF-8, no white space, non-ASCII kept as is, NaN and
infinities refused. Stored results never pass through here (they are spliced in as
stored, see :mod:`batch.flask`); this encodes the small rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["ENCODER", "dumps", "dumps_stdlib"]


def dumps_stdlib(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON, with the standard library."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


try:
    import orjson
except ImportError:  # pragma: no cover - the [fast] extra is optional
    dumps: Callable[[Any], bytes] = dumps_stdlib
    ENCODER = "json"
else:
    dumps = orjson.dumps
    ENCODER = "orjson"
