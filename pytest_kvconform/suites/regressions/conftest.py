"""Fixtures of the regression suites.

Goldens per release: a golden is the reference's plan under the judged release's rules
(``--kvconform-vllm``). The newest rules' goldens are in ``__snapshots__/``; a release lacking a
change that alters them (``pytest_kvconform.regressions.GOLDEN_CHANGES``: vLLM 0.27 and 0.28 lack
``null_block_reserved``) reads its own set from ``__snapshots_before_<change>__/``, one JSON
extension per folder (:func:`golden_extension`). Every run compares the backend with the judged
release's set and the reference of each other folder's release with that folder's set, so
``--snapshot-update`` (reference only) writes every set; each set is also held to the scenario
files' ``[expect]`` (and ``[expect.before.<change>]``) tables by
``test_kvconform_expectations.test_golden_agrees_with_its_expect``, whatever the judged release.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

from pytest_kvconform.regressions import Goldens, golden_dirname, golden_folders


@functools.cache
def golden_extension(folder: str) -> type[JSONSnapshotExtension]:
    """The JSON extension (sorted, one file per test) that keeps its snapshots in ``folder``
    beside the test module, ``<folder>/<module>/<test>.json`` (one class per folder: syrupy finds
    unused snapshots per extension class and folder)."""
    if folder == "__snapshots__":
        return JSONSnapshotExtension

    def dirname(cls: type, *, test_location: Any) -> str:
        return str(Path(test_location.filepath).parent / folder / test_location.basename)

    name = "JSON" + "".join(part.title() for part in folder.strip("_").split("_")) + "Extension"
    return type(name, (JSONSnapshotExtension,), {"snapshot_dirname": folder, "dirname": classmethod(dirname)})


@pytest.fixture
def golden(snapshot: Any, kv_backend: Any, kv_reference: Any, request: pytest.FixtureRequest) -> Goldens:
    """The snapshot fixture with sorted, diff-friendly JSON (one file per test), in the folder of
    the judged release's goldens, plus one per other folder (``regressions.Goldens``: those are
    held to their own release's reference, so that every set is checked, and used, on every run).

    Goldens are the reference's plans: ``--snapshot-update`` with another backend is refused.
    """
    if request.config.getoption("update_snapshots") and kv_backend.name != "reference":
        pytest.fail(f"--snapshot-update writes goldens from the reference only, not {kv_backend.name!r}")
    judged = golden_dirname(kv_reference.release)
    return Goldens(
        snapshot.with_defaults(extension_class=golden_extension(judged)),
        [(release, snapshot.with_defaults(extension_class=golden_extension(folder)))
         for folder, release in golden_folders().items() if folder != judged],
    )  # fmt: skip
