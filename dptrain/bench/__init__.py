"""Benchmarks run as ``python -m dptrain bench <suite>``; each suite is a module with main(argv)."""
