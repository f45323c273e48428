"""Repository-level pytest setup: pytester for the plugin's self-tests, hypothesis profiles."""

import os

from hypothesis import settings

pytest_plugins = ["pytester"]

# hypothesis registers and loads its own "ci" profile when it detects CI; "dev" is for quick loops.
settings.register_profile("dev", max_examples=20)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
