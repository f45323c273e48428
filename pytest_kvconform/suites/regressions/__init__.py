"""Snapshot regressions of the reported KV-sizing bugs."""
