"""Each TP-, speculation-, window-, DCP- and dtype-dependent rule, broken in a backend, fails some
packaged scenario's ``[expect]`` (numbers derived by hand in docs/scenario-derivations.md, not by
the reference): the packaged scenarios reach every one of these rules."""

from __future__ import annotations

from pathlib import Path

import pytest

RULES_SUITE = str(
    Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites" / "test_kvconform_rules.py"
)

BROKEN = '''
import dataclasses
from unittest import mock

from pytest_kvconform.backends.base import ReferenceBackend


class Broken(ReferenceBackend):
    """Plans ``changed(scenario)`` instead of the scenario (the rest of the reference is intact)."""

    def changed(self, scenario):
        raise NotImplementedError

    def plan(self, scenario):
        return super().plan(self.changed(scenario))


class IgnoresTensorParallel(Broken):
    name = "ignores-tp"
    def changed(self, s):
        return s.with_runtime(tensor_parallel_size=1)


class NoExtraGroups(ReferenceBackend):  # Mamba2 groups not replicated for head shards
    name = "no-extra-groups"
    def plan(self, scenario):
        with mock.patch("pytest_kvconform.reference.mamba.extra_groups_for_head_shards", lambda n, tp: 0):
            return super().plan(scenario)


class IgnoresDcp(Broken):
    name = "ignores-dcp"
    def changed(self, s):
        return s.with_runtime(decode_context_parallel_size=1)


class IgnoresSpeculation(Broken):
    name = "ignores-speculation"
    def changed(self, s):
        return s.with_runtime(num_speculative_tokens=0)


class WindowsAsFull(Broken):
    name = "windows-as-full"
    def changed(self, s):
        model = dataclasses.replace(s.model, layers=s.model.layers.replace("S", "A"))
        return dataclasses.replace(s, model=model)


class Fp8AsModelDtype(Broken):
    name = "fp8-as-model-dtype"
    def changed(self, s):
        fp8 = s.runtime.kv_cache_dtype == "fp8"
        return s.with_runtime(kv_cache_dtype="auto") if fp8 else s
'''


@pytest.mark.parametrize(
    ("backend", "caught"),
    [
        (
            "IgnoresTensorParallel",
            {"qwen2.5-3b-instruct-tp4", "granite-4.0-h-tiny-tp4", "granite-4.0-h-small-tp8"},
        ),
        ("NoExtraGroups", {"granite-4.0-h-tiny-tp4", "granite-4.0-h-small-tp8"}),
        ("IgnoresDcp", {"deepseek-v3-dcp8"}),
        ("IgnoresSpeculation", {"qwen3.5-35b-a3b-mtp1", "qwen3-next-80b-a3b-mtp2-tp4"}),
        ("WindowsAsFull", {"gemma-3-27b-it", "gpt-oss-20b"}),
        ("Fp8AsModelDtype", {"deepseek-v3-fp8"}),
    ],
)
def test_a_broken_rule_fails_a_packaged_expectation(
    pytester: pytest.Pytester, backend: str, caught: set
) -> None:
    pytester.makepyfile(broken=BROKEN)
    pytester.syspathinsert()
    result = pytester.runpytest(
        RULES_SUITE,
        f"--kvconform-backend=broken:{backend}",
        "-k",
        "test_expectations",
        "-p",
        "no:cacheprovider",
    )
    failed = {
        line.split("[", 1)[1].split("]", 1)[0]
        for line in result.stdout.lines
        if line.startswith("FAILED") and "test_expectations[" in line
    }
    assert caught <= failed, result.stdout.str()[-2000:]
