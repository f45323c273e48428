"""The toy plugin's own vLLM worker: its own specs for full attention, its own pool; and broken
siblings, each one historical class of bug."""

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, get_kv_quant_mode
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.utils import customize_attention_spec

from pytest_kvconform.backends.vllm import VllmBackend


class ToyWorker(Worker):
    """Prices full-attention layers itself, as vLLM core's ``Attention.get_kv_cache_spec`` does
    (K and V of its KV heads in the cache dtype, with the quantization's scales); other layers
    report their own specs. Its pool: one backing allocation, a view per layer into it."""

    def get_kv_cache_spec(self):
        specs = {}
        for name, layer in get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase).items():
            if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                continue  # it reads its target layer's cache
            spec = (
                self.full_attention_spec(layer)
                if _is_full_attention(layer)
                else layer.get_kv_cache_spec(self.vllm_config)
            )
            if isinstance(spec, AttentionSpec):  # the kernel's own packing (TurboQuant, MLA)
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            if spec is not None:
                specs[name] = spec
        return specs

    def full_attention_spec(self, layer):
        return FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            head_size_v=layer.head_size_v,
            dtype=self.kv_cache_dtype_of(layer),
            kv_quant_mode=get_kv_quant_mode(layer.kv_cache_dtype),
        )

    def kv_cache_dtype_of(self, layer):
        return layer.kv_cache_torch_dtype

    def initialize_from_config(self, kv_cache_config):
        """vLLM 0.32's layout: every KVCacheTensor places its layers in one backing allocation of
        ``size`` bytes (vllm/v1/worker/utils.py ``allocate_kv_cache``); the toy device's memory is
        ``meta``."""
        tensors = kv_cache_config.kv_cache_tensors
        backing = torch.empty(self.backing_bytes(kv_cache_config), dtype=torch.int8, device="meta")
        self.kv_caches = {
            name: backing[t.offset + i * t.layer_stride :] for t in tensors for i, name in enumerate(t.layers)
        }

    def backing_bytes(self, kv_cache_config):
        tensors = kv_cache_config.kv_cache_tensors  # none for a model without a KV cache
        return tensors[0].size if tensors else 0


def _is_full_attention(layer):
    return type(layer) is Attention and layer.sliding_window is None and layer.attn_type == "decoder"


class OneBlockShortWorker(ToyWorker):
    """Its pool holds one block fewer than the engine's config (an off-by-one in its own
    allocator, like a null block taken out of the pool twice)."""

    def backing_bytes(self, kv_cache_config):
        size, blocks = kv_cache_config.kv_cache_tensors[0].size, kv_cache_config.num_blocks
        return size - size // blocks


class PoolPerTensorWorker(ToyWorker):
    """A historical class of bug (tpu-inference #2366): a buffer per KV cache tensor where the
    tensors share one allocation, so the pool holds several times the blocks' bytes."""

    def initialize_from_config(self, kv_cache_config):
        self.kv_caches = [
            torch.empty(t.size, dtype=torch.int8, device="meta") for t in kv_cache_config.kv_cache_tensors
        ]


class StateAsAttentionWorker(ToyWorker):
    """A historical class of bug (vllm-metal before #229): every layer billed as attention, the
    hybrid's state layers included."""

    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()
        attention = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
        return {name: attention for name in specs}


class Fp8AtModelDtypeWorker(ToyWorker):
    """Prices a quantized attention cache at the model's dtype (2 B per element for fp8)."""

    def kv_cache_dtype_of(self, layer):
        return self.model_config.dtype


class SizesFromTheDeviceWorker(ToyWorker):
    """Reports what its device has free at gpu_memory_utilization and never reads
    --kv-cache-memory-bytes (as tpu-inference 0.32 and vllm-rbln 0.12 do: docs/findings.md)."""

    def determine_available_memory(self):
        return int(self.init_snapshot.free_memory * self.cache_config.gpu_memory_utilization)


class ToyWorkerVllm(VllmBackend):
    name = "toy-worker"
    worker = ToyWorker


class PoolPerTensorVllm(ToyWorkerVllm):
    name = "toy-pool-per-tensor"
    worker = PoolPerTensorWorker


class StateAsAttentionVllm(ToyWorkerVllm):
    name = "toy-state-as-attention"
    worker = StateAsAttentionWorker
