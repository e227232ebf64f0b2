"""Benchmarks of the DeepPart planner (``python bench/planner.py``)."""
