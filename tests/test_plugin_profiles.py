"""Plugin profiles (pytest_kvconform/backends/vllm/profiles): their stubs never answer a size, and
the built-in profiles' declarations and known departures name the plugin function they come from.
The profiles themselves run in their plugins' venvs (scripts/test.sh, run_plugin)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

import pytest_kvconform
from pytest_kvconform.backends.registry import BUILTINS
from pytest_kvconform.backends.vllm.profiles import stubs
from pytest_kvconform.backends.vllm.profiles.stubs import DistributionAlias, Stub, StubReached
from pytest_kvconform.conformance import load_xfails
from pytest_kvconform.scenario import load_scenario

XFAILS = Path(pytest_kvconform.__file__).parent / "xfails"
PROFILES = {
    # backend: (profile module, the plugin's package, names its reasons must cite one of)
    "tpu-inference": ("tpu_inference", "tpu_inference", ("TpuPlatform.", "KVCacheManager.", "TPUWorker.")),
    "vllm-rbln": ("vllm_rbln", "vllm_rbln", ("vllm_rbln/", "RBLNWorker.", "RblnPlatform.")),
    "vllm-ascend": ("vllm_ascend", "vllm_ascend", ("vllm_ascend/", "NPUPlatform.")),
}


@pytest.fixture
def clean_imports():
    """Stub modules and finders installed by a test are gone afterwards."""
    modules, meta_path = dict(sys.modules), list(sys.meta_path)
    yield
    sys.meta_path[:] = meta_path
    for name in set(sys.modules) - set(modules):
        del sys.modules[name]


def test_a_stub_answers_what_its_profile_states_and_no_number(clean_imports: None) -> None:
    stubs.install((Stub("kvconform_fake_npu", "a device library this host lacks",
                        {"get_soc_version": lambda: 223, "npu.device_count": lambda: 0}),))  # fmt: skip
    import kvconform_fake_npu  # type: ignore[import-not-found]
    from kvconform_fake_npu.ops import paged  # type: ignore[import-not-found]  # any submodule imports

    assert kvconform_fake_npu.get_soc_version() == 223
    assert kvconform_fake_npu.npu.device_count() == 0

    @paged.jit  # a decorator keeps what it decorates
    def kernel() -> int:
        return 1

    class Handle(kvconform_fake_npu.Handle):  # a stub's class can be subclassed
        pass

    assert kernel() == 1 and Handle() is not None
    answer = kvconform_fake_npu.mem_get_info(0)
    for use in (int, float, lambda v: v * 2, lambda v: v + 1, lambda v: v < 3, len, list):
        with pytest.raises(StubReached, match=r"kvconform_fake_npu\.mem_get_info\(\)"):
            use(answer)


def test_an_installed_module_is_never_stubbed(clean_imports: None) -> None:
    import json

    stubs.install((Stub("json", "pretend"),))
    assert sys.modules["json"] is json and json.dumps(1) == "1"


def test_a_distribution_alias_answers_importlib_metadata(clean_imports: None) -> None:
    stubs.install((), (DistributionAlias("kvconform-alias-probe", "0.30.0+cpu", "the plugin asks for it"),))
    assert importlib.metadata.version("kvconform-alias-probe") == "0.30.0+cpu"
    assert importlib.metadata.version("pytest") == pytest.__version__  # others are untouched


@pytest.mark.parametrize("backend", sorted(PROFILES))
def test_each_plugin_is_a_builtin_profile_with_its_install_script(backend: str) -> None:
    module, package, _ = PROFILES[backend]
    target, hint = BUILTINS[backend]
    assert target.startswith(f"pytest_kvconform.backends.vllm.profiles.{module}:")
    assert f"scripts/install-{backend}.sh" in hint
    profile = importlib.import_module(target.partition(":")[0])
    cls = getattr(profile, target.partition(":")[2])
    assert cls.registers_process_wide  # each patches vLLM: built in a process of its own
    assert cls.platform.startswith(package) and cls.worker.startswith(package)
    assert all(stub.why for stub in cls.stubs)


@pytest.mark.parametrize("backend", sorted(PROFILES))
def test_every_known_departure_names_its_field_and_the_plugins_function(backend: str) -> None:
    entries = load_xfails(XFAILS / f"{backend}.toml", backend)
    assert entries
    assert not load_xfails(XFAILS / f"{backend}.toml", "vllm")  # none leaks to another backend
    cites = PROFILES[backend][2]
    for entry in entries:
        assert any(name in entry.reason for name in cites), entry.reason
        assert entry.field and entry.field != "*", entry
        assert entry.test.startswith("test_") or entry.when is not None, entry
    assert len({(e.rule, e.test, e.when, e.field) for e in entries}) == len(entries)
    # the engine's budget is the budget: the check every plugin gets, and two of the three depart
    budget = [e for e in entries if e.test == "test_available_memory[*]"]
    assert (backend != "vllm-ascend") == bool(budget), backend


def test_deliberate_departures_are_marked_and_cite_the_plugins_own_words() -> None:
    rbln = load_xfails(XFAILS / "vllm-rbln.toml", "vllm-rbln")
    ascend = load_xfails(XFAILS / "vllm-ascend.toml", "vllm-ascend")
    deliberate = {e.reason for e in [*rbln, *ascend] if e.deliberate}
    assert any("patched_mla_get_kv_cache_spec" in r for r in deliberate)  # RBLN's 768-byte fp8 row
    assert any("RBLNSlidingWindowSpec" in r for r in deliberate)  # one block per sliding request
    assert any("refresh_block_size" in r for r in deliberate)  # Ascend's block 128
    assert not any(e.deliberate for e in ascend if "#7393" in e.reason)  # a bug, reported upstream


def test_profiles_decline_what_the_plugin_refuses_to_start_with() -> None:
    from pytest_kvconform.backends.vllm.profiles.vllm_ascend import VllmAscendBackend
    from pytest_kvconform.backends.vllm.profiles.vllm_rbln import VllmRblnBackend

    rbln, ascend = VllmRblnBackend.declines, VllmAscendBackend.declines
    assert "get_attn_backend_cls" in (rbln.reason("layer_specs", load_scenario("gemma-4-31b-it")) or "")
    assert "FlashAttnMLAImpl" in (rbln.reason("plan", load_scenario("deepseek-v3-fp8")) or "")
    assert rbln.reason("plan", load_scenario("deepseek-v3.2-fp8-ds-mla")) is None  # its own packed row
    assert rbln.reason("allocation", load_scenario("gemma-3-27b-it")) is not None  # window 1024 > block 16
    assert rbln.reason("allocation", load_scenario("gemma-3-1b-it-rbln-cr03")) is None  # block 1024
    assert "MambaSpec" in (rbln.reason("allocation", load_scenario("qwen3.5-4b")) or "")
    assert ascend.reason("layer_specs", load_scenario("qwen3.5-4b")) is None  # its hybrid specs are checked
    assert "TurboQuant" in (
        ascend.reason("allocation", load_scenario("llama-3.1-8b-instruct-turboquant-k8v4")) or ""
    )
    from pytest_kvconform.backends.vllm.backend import VllmBackend

    def families(declines: object) -> set[str]:
        return {key for key in declines.entries if isinstance(key, str)}  # type: ignore[attr-defined]

    for declines in (rbln, ascend):  # no profile declines a whole rule family of its own
        assert families(declines) == families(VllmBackend.declines)


@pytest.mark.parametrize("backend", ["vllm-rbln", "vllm-ascend"])
def test_without_the_plugin_the_backend_says_how_to_install_it(backend: str) -> None:
    package = PROFILES[backend][1]
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    from pytest_kvconform.backends.registry import BackendError, build_backend

    with pytest.raises(BackendError, match=rf"failed to start: .*install-{backend}\.sh"):
        build_backend(backend)
