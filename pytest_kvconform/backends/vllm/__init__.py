"""The ``vllm`` backend: real vLLM code answering each sizing rule, on an explicit platform.

One module per job: ``runtime`` (the one import of vLLM), ``api`` (every call whose spelling
changed between releases), ``platform`` (whose ``Platform`` hooks run), ``configs`` (offline
config.json writers, one per architecture), ``offline`` (the scenario's ``VllmConfig``),
``worker`` (the worker built without a device), ``specs`` (spec conversion and per-spec rules),
``hybrid`` (block alignment, state shapes), ``planning`` (unification, grouping, pool and
admission) and ``backend`` (:class:`VllmBackend`). None imports vLLM at module import time.
"""

from .backend import VllmBackend
from .offline import build_vllm_config

__all__ = ["VllmBackend", "build_vllm_config"]
