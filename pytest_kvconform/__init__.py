"""pytest-kvconform: conformance and regression harness for KV-cache sizing in vLLM backends."""

__version__ = "0.1.0"
