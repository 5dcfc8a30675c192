"""Benchmarks of the batch runner and its store against the floors they are judged by.

``python -m bench`` runs every measurement in a fresh process, several repeats in a
shuffled order, and prints one markdown table of medians with the ratio of each row to its
floor (the same writes on the raw driver, naive SQLAlchemy Core, or a smaller workload).
``python -m bench --help`` lists the options; ``bench/README.md`` explains the rows.
"""
