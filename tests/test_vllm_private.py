"""The vllm backend's private vLLM symbols, checked per release; its options checked when built."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_every_private_symbol_is_where_the_installed_release_has_it() -> None:
    from pytest_kvconform.backends.vllm.private import check_all
    from pytest_kvconform.backends.vllm.runtime import installed_vllm_version

    assert check_all(installed_vllm_version()) == []


def test_a_moved_symbol_is_one_line_naming_it_and_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the backend used to decline silently (a planning function a release no longer has),
    a moved symbol fails with one line naming the symbol, the release and the table."""
    from pytest_kvconform.backends.vllm import private

    private.locate.cache_clear()
    planning = importlib.import_module(
        next(m for m in private.PLANNING if importlib.util.find_spec(m) is not None)
    )
    monkeypatch.delattr(planning, "_check_enough_kv_cache_memory")
    with pytest.raises(private.VllmPrivateApiError) as info:
        private.locate("_check_enough_kv_cache_memory", "0.32.0")
    private.locate.cache_clear()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("vLLM 0.32.0: private symbol _check_enough_kv_cache_memory is not in ")
    assert message.endswith("pytest_kvconform/backends/vllm/private.py lists what it expects")


def test_a_stand_in_whose_signature_moved_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_kvconform.backends.vllm import private

    private.locate.cache_clear()
    planning = importlib.import_module(
        next(m for m in private.PLANNING if importlib.util.find_spec(m) is not None)
    )
    monkeypatch.setattr(planning, "_check_enough_kv_cache_memory", lambda vllm_config, kv_cache_spec: None)
    with pytest.raises(private.VllmPrivateApiError, match=r"takes \(vllm_config, kv_cache_spec\), the vllm "
                       r"backend's stand-in expects \(available_memory, "):  # fmt: skip
        private.locate("_check_enough_kv_cache_memory", "0.32.0")
    private.locate.cache_clear()


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("worker=nocolon", "*worker='nocolon': expected 'package.module:ClassName'*"),
        ("platform=not_a_package.platform:P", "*platform='not_a_package.platform:P': no package named "
         "'not_a_package' is installed*"),
    ],
)  # fmt: skip
def test_a_bad_backend_option_is_a_usage_error_not_a_rejection(
    pytester: pytest.Pytester, option: str, message: str
) -> None:
    """``worker=nocolon`` used to be reported as a sizing rejection of every scenario."""
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest_subprocess("--kvconform-backend=vllm", f"--kvconform-backend-option={option}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if line.strip()]) == 1
