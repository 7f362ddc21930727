"""Berth benchmarks. Run all with ``make bench`` (``python -m bench``)."""
