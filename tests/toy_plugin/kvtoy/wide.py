"""A toy plugin that changes its process when it starts, so it runs in a process of its own."""

import threading

from kvtoy import device
from kvtoy.kv import ToyBackend
from pytest_kvconform.model import PoolAllocation


class DeviceBuffer:
    """The wide device's pool: like a JAX array or a worker, it cannot be pickled (a lock)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._lock = threading.Lock()

    def blocks(self, block_bytes: int) -> int:
        return self.nbytes // block_bytes


class WideHeadBackend(ToyBackend):
    """A device whose kernel reads heads of 256 elements: starting it pads the head_dim of every
    toy runner in the process (as tpu-inference pads head_dim to 128 for its kernel)."""

    name = "toy-wide-heads"
    registers_process_wide = "sets kvtoy.device.HEAD_DIM_ALIGN = 256 for every toy runner in its process"

    def __init__(self, device_name: str = "cpu") -> None:
        super().__init__(device_name)
        device.HEAD_DIM_ALIGN = 256

    def allocate_kv_cache(self, plan, num_blocks, scenario):
        pool = DeviceBuffer(num_blocks * plan.bytes_per_block)
        return PoolAllocation(num_blocks, plan.bytes_per_block, pool.nbytes, handle=pool)

    def check_kv_cache_config(self, allocation, num_blocks, scenario):
        if not isinstance(allocation.handle, DeviceBuffer):
            raise TypeError(f"not this device's pool: {allocation.handle!r}")
        if num_blocks > allocation.handle.blocks(allocation.bytes_per_block):
            raise ValueError(
                f"Engine KV cache config requests {num_blocks} blocks but the Metal paged "
                f"pool was allocated with {allocation.num_blocks}."
            )
