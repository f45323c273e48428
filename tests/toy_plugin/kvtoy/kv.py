"""The toy plugin's backends: its own KV sizing code, checked against the reference."""

import dataclasses
from typing import ClassVar

from kvtoy.device import padded_head_dim
from pytest_kvconform.backends.base import ReferenceBackend
from pytest_kvconform.model import PoolAllocation
from pytest_kvconform.reference.specs import AttentionSpec
from pytest_kvconform.requirements import MLA, Declines, InputKind


def _not_dense_gqa(scenario):
    model, rt = scenario.model, scenario.runtime
    attn = model.attention if model is not None else None
    return attn is None or attn.kind != "gqa" or set(model.layers) != {"A"} or rt.kv_cache_dtype != "auto"


#: what the toy runner does not build
NOT_DENSE_GQA = InputKind("not_dense_gqa", "anything but dense GQA layers in the model dtype", _not_dense_gqa)


class ToyBackend(ReferenceBackend):
    """Its model runner builds the specs of dense GQA models; it has a pool; its kernel takes
    vllm-metal's block split, but never for MLA models."""

    name = "toy"
    declines = ReferenceBackend.declines.without("allocation") | Declines(
        {
            ("layer_specs", NOT_DENSE_GQA): "the toy runner builds dense GQA layers in the model dtype only",
            ("kernel_block", MLA): "MLA models never take the toy paged kernel",
        }
    )
    #: deliberate delegation: reported as inherited (declared), never as passed
    inherits: ClassVar[dict[str, str]] = {
        "kernel_block": "the toy kernel takes vllm-metal's block split (super())"
    }

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def notes(self) -> list[str]:
        return [f"toy device: {self.device}"]

    def layer_specs(self, scenario):  # the plugin's get_kv_cache_spec (dense GQA only: declared)
        model, rt = scenario.model, scenario.runtime
        attn = model.attention
        block = self.choose_block_size(scenario).block_size
        heads = max(1, attn.num_kv_heads // rt.tensor_parallel_size)  # KV heads replicated below TP
        v = None if attn.head_dim_v in (None, attn.head_dim) else attn.head_dim_v
        head = padded_head_dim(attn.head_dim)  # the device's head layout (kvtoy.device)
        spec = AttentionSpec("full_attention", block, heads, head, model.dtype, head_size_v=v)
        return {f"model.layers.{i}.self_attn": spec for i in range(len(model.layers))}

    def kernel_block_size(self, block_size, scenario=None):
        return super().kernel_block_size(block_size)

    def allocate_kv_cache(self, plan, num_blocks, scenario):
        pool = bytearray(num_blocks * plan.bytes_per_block)  # the toy device's memory
        return PoolAllocation(num_blocks, plan.bytes_per_block, len(pool), handle=pool)

    def check_kv_cache_config(self, allocation, num_blocks, scenario):
        if num_blocks > allocation.num_blocks:
            raise ValueError(
                f"Engine KV cache config requests {num_blocks} blocks but the Metal paged "
                f"pool was allocated with {allocation.num_blocks}."
            )


class MlaBilledKV(ToyBackend):
    """A historical bug: its spec bills an MLA layer K+V (2x the latent, vllm-metal before #233)."""

    name = "toy-mla-kv"
    declines = ToyBackend.declines.without("layer_specs")

    def layer_specs(self, scenario):
        return {
            name: dataclasses.replace(spec, head_size_v=spec.head_size)
            if isinstance(spec, AttentionSpec) and spec.is_mla and spec.cache_role == "kv"
            else spec
            for name, spec in ReferenceBackend.layer_specs(self, scenario).items()
        }


class NoGuard(ToyBackend):
    """Accepts an engine config larger than its pool (vllm-metal before #527)."""

    name = "toy-no-guard"

    def check_kv_cache_config(self, allocation, num_blocks, scenario):
        return None


class KernelFailsToLoad(ToyBackend):
    """Its kernel library cannot load here: a failure, not a skip."""

    name = "toy-broken-kernel"

    def kernel_block_size(self, block_size, scenario=None):
        raise RuntimeError("cannot load libtoy_paged_attention.so")
