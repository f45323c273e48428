"""A toy plugin whose worker, like vllm-metal's ``MetalWorker``, builds its model runner in
``init_device`` and its own model in ``load_model`` (from the model's config.json, as mlx-lm reads
its model arguments; no weights): none of vLLM's layers exist, and every size it reports is its
own code's. Broken siblings: one wrong formula each, in the runner's specs, its allocation, and
the worker's memory probe.

Wired as a plugin's CI would (docs/plugins.md)::

    pytest --kvconform-backend=vllm \\
        --kvconform-backend-option=platform=kvtoy.platform:ToyPlatform \\
        --kvconform-backend-option=worker=kvtoy.runner:RunnerWorker
"""

from pathlib import Path

import torch
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.worker.worker_base import WorkerBase


class ToyLayer:
    """One attention layer of the toy's own model: its KV heads, head size and window."""

    def __init__(self, num_kv_heads, num_heads, head_dim, sliding_window):
        self.num_kv_heads, self.num_heads = num_kv_heads, num_heads
        self.head_dim, self.sliding_window = head_dim, sliding_window


def toy_model(hf_config):
    """The toy's model arguments from the config.json: a dense GQA transformer whose layers slide
    where ``layer_types`` says (else every layer is full)."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kinds = getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    window, kv_heads = getattr(hf_config, "sliding_window", None), hf_config.num_key_value_heads
    windows = [window if kind == "sliding_attention" else None for kind in kinds]
    return [ToyLayer(kv_heads, heads, head_dim, w) for w in windows]


class ToyModelRunner:
    """Built by ``RunnerWorker.init_device``; its model by ``load_model``."""

    def __init__(self, vllm_config, device):
        self.vllm_config, self.device = vllm_config, device
        self.layers = None
        self.kv_caches = {}

    def load_model(self):
        self.layers = toy_model(self.vllm_config.model_config.hf_config)

    def get_kv_cache_spec(self):
        cache, model = self.vllm_config.cache_config, self.vllm_config.model_config
        dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
        specs = {}
        for i, layer in enumerate(self.layers):
            common = dict(block_size=cache.block_size, num_kv_heads=self.kv_heads(layer),
                          head_size=layer.head_dim, dtype=dtype)  # fmt: skip
            name = f"model.layers.{i}.self_attn"
            if layer.sliding_window:
                specs[name] = SlidingWindowSpec(sliding_window=layer.sliding_window, **common)
            else:
                specs[name] = FullAttentionSpec(**common)
        return specs

    def kv_heads(self, layer):
        return layer.num_kv_heads

    def initialize_kv_cache(self, kv_cache_config):
        """One backing allocation per KVCacheTensor, a view per layer (its ``layer_stride`` apart)."""
        for tensor in kv_cache_config.kv_cache_tensors:
            size = self.backing_bytes(tensor, kv_cache_config)
            backing = torch.empty(size, dtype=torch.int8, device="meta")
            for i, name in enumerate(tensor.layers):
                self.kv_caches[name] = backing[tensor.offset + i * tensor.layer_stride :]

    def backing_bytes(self, tensor, kv_cache_config):
        return tensor.size


class RunnerWorker(WorkerBase):
    """Like vllm-metal's worker: the runner in ``init_device``, the model in ``load_model``."""

    def init_device(self):
        self.device = torch.device("cpu")  # the toy's device is its host
        self.model_runner = self.runner_class(self.vllm_config, self.device)

    runner_class = ToyModelRunner

    def load_model(self):
        self.model_runner.load_model()

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self):
        """The engine's budget: ``--kv-cache-memory-bytes``."""
        return int(self.cache_config.kv_cache_memory_bytes)

    def initialize_from_config(self, kv_cache_config):
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self):
        return None


class WeightsRunner(ToyModelRunner):
    """Loads its weights with its model, as vllm-metal's runner does through mlx-lm: offline,
    with only a config.json in the model's folder, its ``load_model`` cannot run (the profile
    ``kvtoy.profile:ToyMetalProfile`` replaces it)."""

    def load_model(self):
        self.weights = (Path(self.vllm_config.model_config.model) / "model.safetensors").read_bytes()
        super().load_model()


class WeightsRunnerWorker(RunnerWorker):
    runner_class = WeightsRunner


class GqaAsMhaRunner(ToyModelRunner):
    """Caches a K and a V for every query head (grouped-query attention priced as multi-head)."""

    def kv_heads(self, layer):
        return layer.num_heads


class OneBlockShortRunner(ToyModelRunner):
    """Its pool holds one block fewer than the engine planned (an off-by-one in its allocator)."""

    def backing_bytes(self, tensor, kv_cache_config):
        return tensor.size - tensor.size // kv_cache_config.num_blocks


class GqaAsMhaWorker(RunnerWorker):
    runner_class = GqaAsMhaRunner


class OneBlockShortWorker(RunnerWorker):
    runner_class = OneBlockShortRunner


class DeviceMemoryWorker(RunnerWorker):
    """Reports what its device has free at gpu_memory_utilization and never reads
    --kv-cache-memory-bytes."""

    def determine_available_memory(self):
        return int(self.init_snapshot.free_memory * self.cache_config.gpu_memory_utilization)
