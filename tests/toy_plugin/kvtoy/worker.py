"""The toy plugin's own vLLM worker: its own specs for full attention, its own pool."""

from vllm.model_executor.layers.attention import Attention
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.gpu_worker import Worker

from pytest_kvconform.backends.vllm import VllmBackend


class ToyWorker(Worker):
    """Prices full-attention layers itself (K + V of its KV heads, in the cache dtype); other
    layers report their own specs. Its pool: one buffer per KV cache tensor of the engine's config."""

    def get_kv_cache_spec(self):
        block = self.cache_config.block_size
        specs = {}
        for name, layer in self.compilation_config.static_forward_context.items():
            if isinstance(layer, Attention) and type(layer) is Attention and layer.sliding_window is None:
                specs[name] = FullAttentionSpec(
                    block_size=block,
                    num_kv_heads=layer.num_kv_heads,
                    head_size=layer.head_size,
                    dtype=layer.kv_cache_torch_dtype,
                )
            else:
                spec = layer.get_kv_cache_spec(self.vllm_config)
                if spec is not None:
                    specs[name] = spec
        return specs

    def initialize_from_config(self, kv_cache_config):
        tensors = kv_cache_config.kv_cache_tensors
        if tensors and hasattr(tensors[0], "layers"):  # vLLM 0.32+: views of one backing allocation
            self.kv_caches = [bytearray(max(t.size for t in tensors))]
        else:  # before: one allocation per tensor, shared by its layers
            self.kv_caches = [bytearray(t.size) for t in tensors]


class PoolPerTensorWorker(ToyWorker):
    """A historical class of bug (tpu-inference #2366): a buffer per KV cache tensor where the
    tensors alias one allocation, so the pool holds several times the blocks' bytes."""

    def initialize_from_config(self, kv_cache_config):
        self.kv_caches = [bytearray(t.size) for t in kv_cache_config.kv_cache_tensors]


class StateAsAttentionWorker(ToyWorker):
    """A historical class of bug (vllm-metal before #229): every layer billed as attention, the
    hybrid's state layers included."""

    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()
        attention = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
        return {name: attention for name in specs}


class ToyWorkerVllm(VllmBackend):
    name = "toy-worker"
    worker = ToyWorker


class PoolPerTensorVllm(ToyWorkerVllm):
    name = "toy-pool-per-tensor"
    worker = PoolPerTensorWorker


class StateAsAttentionVllm(ToyWorkerVllm):
    name = "toy-state-as-attention"
    worker = StateAsAttentionWorker
