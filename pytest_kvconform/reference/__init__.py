"""The reference: every KV-cache sizing rule of vLLM 0.33.0 (and vllm-metal), in pure Python.

One module per rule family, each function citing the vLLM source it mirrors. Standard
library only, so any backend can be checked against it without importing vLLM.
"""

from .plan import plan

#: The vLLM release whose rules the reference mirrors.
VLLM_TARGET = "0.33.0"

__all__ = ["VLLM_TARGET", "plan"]
