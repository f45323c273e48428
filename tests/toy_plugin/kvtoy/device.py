"""The toy devices' shared runtime: one setting for the whole process, as real plugins have
(tpu-inference replaces vLLM's layers and registers its spec classes when it starts)."""

#: every toy runner in the process pads head_dim to a multiple of this
HEAD_DIM_ALIGN = 1


def padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // HEAD_DIM_ALIGN) * HEAD_DIM_ALIGN
