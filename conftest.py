"""Repository-level pytest setup: pytester for the plugin's self-tests, hypothesis profiles."""

import contextlib
import importlib
import os

from hypothesis import settings

pytest_plugins = ["pytester"]

# pytester's in-process runs restore sys.modules afterwards, and a C extension imported inside one
# (numpy, mlx: the allocation suite's) cannot be imported a second time in this process. Import
# them here, so that they outlive every inner run.
for _module in ("numpy", "mlx.core"):
    with contextlib.suppress(ImportError):
        importlib.import_module(_module)

# hypothesis registers and loads its own "ci" profile when it detects CI; "dev" is for quick loops.
settings.register_profile("dev", max_examples=20)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


def pytest_ignore_collect(collection_path, config):
    """The main job, ``pytest --kvconform-backend=X`` from the repository root, runs the conformance
    suites only: the plugin's own tests (``tests/``) are collected when no backend is selected (the
    README's test command) or when named on the command line."""
    if config.args_source != config.ArgsSource.TESTPATHS or not config.getoption("kvconform_backend"):
        return None
    tests = config.rootpath / "tests"
    return True if collection_path == tests or tests in collection_path.parents else None
