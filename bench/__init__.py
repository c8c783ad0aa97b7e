"""The benchmarks users re-run (``python -m bench.<name> --help``), each printing a table with its same-run anchors;
results and the commands that made them are in ``bench/RESULTS.md``."""
