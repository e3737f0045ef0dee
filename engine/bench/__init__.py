"""`python -m engine.bench NAME --json`: each benchmark measures zigzag and a baseline in one run.

A benchmark module exposes `add_arguments(parser)` and `run(args) -> Iterable[Row]`. Rows are printed as
one JSON object per line (architecture §7).
"""
