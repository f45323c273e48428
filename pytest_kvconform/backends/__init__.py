"""Backends: adapters checked against the reference (reference, vllm, metal, third-party)."""
