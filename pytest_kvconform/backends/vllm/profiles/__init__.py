"""Profiles: a vLLM hardware plugin driven end to end by the ``vllm`` backend on a CPU host.

A profile is a :class:`.profile.PluginProfile`: the plugin's ``Platform`` and worker, and what the
plugin needs to run without its device (its environment, the device libraries it imports as
:class:`.stubs.Stub` s, how its worker builds its runner, what it patches), each named and
explained in the profile's module; the core path (``backend.py``, ``layers.py``, ``worker.py``)
knows nothing of them. docs/plugins.md shows a whole one.

* :mod:`.tpu_inference`: tpu-inference 0.32, ``--kvconform-backend=tpu-inference``;
* :mod:`.vllm_rbln`: vllm-rbln 0.12, ``--kvconform-backend=vllm-rbln``;
* :mod:`.vllm_ascend`: vllm-ascend 0.23, ``--kvconform-backend=vllm-ascend``.

A profile module imports nothing of its plugin at import time.
"""
