"""Benchmarks; they run only with --benchmark-only."""
