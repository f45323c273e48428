"""Fixtures the self-tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: the toy plugin's distribution (kvtoy: a correct platform, worker and runner, and broken siblings)
TOY = Path(__file__).parent / "toy_plugin"


@pytest.fixture
def toy_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The toy plugin importable by the pytest and vLLM processes a test starts (``PYTHONPATH``),
    which keep vLLM's caches where the suites' runs do (``VLLM_CACHE_ROOT``)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TOY), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(Path.cwd() / ".vllm-cache")))
    return TOY
