"""SELECT in a docstring is prose, not a statement (used by tests/test_sql_source.py)."""

n = 3
PLAIN = "SELECT 1"
FORMATTED = f"PRAGMA x = {n}"
MESSAGE = "select is lower case in prose"
