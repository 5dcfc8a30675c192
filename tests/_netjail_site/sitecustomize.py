"""Jail a Python child of the test suite like its parent (see ``tests/_netjail.py``).

The suite puts this folder first on ``PYTHONPATH`` and sets ``BATCH_NETJAIL=1``; every
Python process it starts then imports this module at start-up and installs the jail.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("BATCH_NETJAIL") == "1":
    _tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, _tests)
    try:
        import _netjail

        _netjail.install()
    finally:
        sys.path.remove(_tests)
