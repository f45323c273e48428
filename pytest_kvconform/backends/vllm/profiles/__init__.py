"""Profiles: a vLLM hardware plugin driven end to end by the ``vllm`` backend.

A profile is a :class:`~pytest_kvconform.backends.vllm.VllmBackend` subclass naming a plugin's
``Platform`` and worker, plus every shim the plugin needs to run on a CPU host without its
device. The shims live only in the profile's module, each named and explained there; the core
path (``backend.py``, ``layers.py``, ``worker.py``) knows nothing of them.

* :mod:`.tpu_inference`: tpu-inference (vLLM's TPU plugin), ``--kvconform-backend=tpu-inference``.

A profile module imports nothing of its plugin at import time.
"""
