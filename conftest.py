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
