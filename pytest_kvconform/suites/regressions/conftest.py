"""Fixtures of the regression suites."""

from __future__ import annotations

from typing import Any

import pytest
from syrupy.extensions.json import JSONSnapshotExtension


@pytest.fixture
def golden(snapshot: Any, kv_backend: Any, request: pytest.FixtureRequest) -> Any:
    """The snapshot fixture with sorted, diff-friendly JSON (one file per test).

    Goldens are the reference's plans: ``--snapshot-update`` with another backend is refused.
    """
    if request.config.getoption("update_snapshots") and kv_backend.name != "reference":
        pytest.fail(f"--snapshot-update writes goldens from the reference only, not {kv_backend.name!r}")
    return snapshot.with_defaults(extension_class=JSONSnapshotExtension)
