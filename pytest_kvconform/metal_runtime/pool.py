"""A KV pool allocated the way vllm-metal allocates its caches.

vllm-project/vllm-metal @ 211a1e4: ``MetalPagedKVCache`` (``vllm_metal/attention/caches/kv_cache.py``),
``MLAPagedLatentCache`` and ``GDNPagedStateCache``, sized by ``ModelCachePolicy`` in
``vllm_metal/v1/cache_policy.py`` (``get_cache_block_size_bytes``, ``estimate_one_sequence_kv_bytes``):

* attention layer: K and V ``[num_blocks, block_size, kv_heads, head_dim]`` in the model dtype;
* MLA layer: one latent ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (no V: 1x);
* state layer (GDN/Mamba/short-conv): ``num_state_slots`` slots of a conv state in the model
  dtype and, except for short-conv, a recurrent state (fp32 where asked; vllm-metal forces fp32
  for GDN, vllm-metal#243 and #579).

All byte figures are read back from the allocated arrays (``nbytes``), never from a formula, so
the pool can check formula-based sizing elsewhere. Geometry is given as plain ints and dtype
names; :func:`layers_from_scenario` reads a neutral :class:`~pytest_kvconform.scenario.Scenario`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from ..scenario import Scenario, StateGeometry

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
LAYER_KINDS = ("attention", "mla", "state")


def _mx_dtype(name: str) -> mx.Dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class PoolLayer:
    """One cache-owning layer: ``attention`` (K+V), ``mla`` (one latent) or ``state`` (slots)."""

    kind: str
    dtype: str = "bfloat16"
    num_kv_heads: int = 0
    head_dim: int = 0
    head_dim_v: int | None = None
    kv_lora_rank: int = 0
    rope_dim: int = 0
    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    recurrent_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"layer kind {self.kind!r}; expected one of {', '.join(LAYER_KINDS)}")
        _mx_dtype(self.dtype)
        if self.kind == "attention" and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise ValueError(f"attention layer needs num_kv_heads and head_dim >= 1, got {self}")
        if self.kind == "mla" and self.kv_lora_rank + self.rope_dim <= 0:
            raise ValueError(f"mla layer needs kv_lora_rank + rope_dim >= 1, got {self}")
        if self.kind == "state":
            if not self.conv_shape and not self.recurrent_shape:
                raise ValueError("state layer needs a conv_shape and/or a recurrent_shape")
            if self.recurrent_shape:
                _mx_dtype(self.recurrent_dtype)

    @property
    def is_paged(self) -> bool:
        return self.kind != "state"


def attention_layer(num_kv_heads: int, head_dim: int, dtype: str, head_dim_v: int | None = None) -> PoolLayer:
    return PoolLayer("attention", dtype, num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v)


def mla_layer(kv_lora_rank: int, rope_dim: int, dtype: str) -> PoolLayer:
    return PoolLayer("mla", dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)


def state_layer(
    conv_shape: Sequence[int],
    dtype: str,
    recurrent_shape: Sequence[int] = (),
    recurrent_dtype: str = "float32",
) -> PoolLayer:
    return PoolLayer(
        "state", dtype, conv_shape=tuple(conv_shape), recurrent_shape=tuple(recurrent_shape),
        recurrent_dtype=recurrent_dtype,
    )  # fmt: skip


class KVPool:
    """Per-layer caches really allocated with ``mx.zeros`` (and evaluated)."""

    def __init__(
        self, layers: Sequence[PoolLayer], num_blocks: int, block_size: int, num_state_slots: int = 1
    ) -> None:
        if num_blocks < 0 or block_size <= 0 or num_state_slots < 0:
            raise ValueError(
                f"num_blocks={num_blocks} and num_state_slots={num_state_slots} must be >= 0, "
                f"block_size={block_size} >= 1"
            )
        self.layers = tuple(layers)
        self.num_blocks, self.block_size, self.num_state_slots = num_blocks, block_size, num_state_slots
        #: per layer: {"k","v"} (attention), {"latent"} (mla) or {"conv","recurrent"} (state)
        self.caches: list[dict[str, mx.array]] = []
        for layer in self.layers:
            dt = _mx_dtype(layer.dtype)
            if layer.kind == "attention":
                dv = layer.head_dim_v or layer.head_dim
                arrays = {
                    "k": mx.zeros((num_blocks, block_size, layer.num_kv_heads, layer.head_dim), dtype=dt),
                    "v": mx.zeros((num_blocks, block_size, layer.num_kv_heads, dv), dtype=dt),
                }
            elif layer.kind == "mla":
                latent = layer.kv_lora_rank + layer.rope_dim
                arrays = {"latent": mx.zeros((num_blocks, block_size, latent), dtype=dt)}
            else:
                arrays = {}
                if layer.conv_shape:
                    arrays["conv"] = mx.zeros((num_state_slots, *layer.conv_shape), dtype=dt)
                if layer.recurrent_shape:
                    rdt = _mx_dtype(layer.recurrent_dtype)
                    arrays["recurrent"] = mx.zeros((num_state_slots, *layer.recurrent_shape), dtype=rdt)
            mx.eval(*arrays.values())
            self.caches.append(arrays)

    # ------------------------------------------------------------------ sizes (all from nbytes)

    def bytes_held(self) -> int:
        """Sum of ``nbytes`` over every allocated array."""
        return sum(a.nbytes for arrays in self.caches for a in arrays.values())

    def bytes_per_block(self) -> int:
        """Bytes of one block: the nbytes of a one-block slice, summed over the paged layers.

        Read from a one-block slice of each allocated array, so it works for ``num_blocks >= 1``.
        """
        if self.num_blocks == 0:
            return KVPool([x for x in self.layers if x.is_paged], 1, self.block_size, 0).bytes_per_block()
        return sum(
            a[:1].nbytes
            for layer, arrays in zip(self.layers, self.caches, strict=True)
            if layer.is_paged
            for a in arrays.values()
        )

    def bytes_per_token(self) -> int:
        return self.bytes_per_block() // self.block_size

    def state_bytes(self) -> int:
        """Bytes of all state slots (``num_state_slots`` per state layer)."""
        return sum(
            a.nbytes
            for layer, arrays in zip(self.layers, self.caches, strict=True)
            if not layer.is_paged
            for a in arrays.values()
        )

    def state_bytes_per_slot(self) -> int:
        if self.num_state_slots == 0:
            return KVPool([x for x in self.layers if not x.is_paged], 0, self.block_size, 1).state_bytes()
        return self.state_bytes() // self.num_state_slots

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def check_kv_cache_config(self, num_blocks: int) -> None:
        """The pool cannot grow: an engine KV cache config of more blocks than it holds is an
        error (vllm-metal ``ModelCachePolicy.initialize_kv_cache``, PR #527); fewer is fine."""
        if num_blocks > self.num_blocks:
            raise ValueError(
                f"Engine KV cache config requests {num_blocks} blocks but the Metal paged pool was "
                f"allocated with {self.num_blocks}. vllm-metal sizes its pool from available Metal memory "
                "and cannot grow it afterwards. If --num-gpu-blocks-override is set, lower or remove it; "
                "otherwise this is a capacity-accounting bug, please report it."
            )

    # ------------------------------------------------------------------ sizing helpers

    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, per_block_bytes: int) -> int:
        """Whole blocks that fit in ``budget_bytes`` (``max(0, budget // per_block)``)."""
        if per_block_bytes <= 0:
            raise ValueError(f"per_block_bytes must be >= 1, got {per_block_bytes}")
        return max(0, budget_bytes // per_block_bytes)

    @classmethod
    def one_sequence_bytes(cls, max_model_len: int, block_size: int, layers: Sequence[PoolLayer]) -> int:
        """Bytes for one ``max_model_len`` sequence: the block-aligned token count
        ``cdiv(max_model_len, block_size) * block_size`` in every paged layer, plus one state slot
        per state layer. Measured on a one-block, one-slot pool that is really allocated.
        """
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        probe = cls(layers, 1, block_size, 1)
        blocks = -(-max_model_len // block_size)
        return blocks * probe.bytes_per_block() + probe.state_bytes()

    @classmethod
    def from_scenario(
        cls,
        scenario: Scenario,
        num_blocks: int,
        block_size: int,
        *,
        scale_layers: int = 1,
        scale_heads: int = 1,
        num_state_slots: int = 1,
        include_state: bool = True,
    ) -> KVPool:
        """A pool for a scenario's model; see :func:`layers_from_scenario` for the scaling."""
        layers = layers_from_scenario(
            scenario, scale_layers=scale_layers, scale_heads=scale_heads, include_state=include_state
        )
        return cls(layers, num_blocks, block_size, num_state_slots)


# --------------------------------------------------------------------------- from a scenario


def _state_shapes(state: StateGeometry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv, recurrent) per-slot shapes of one state layer, in the config's own terms."""
    rows = state.conv_kernel - 1
    if state.kind == "gdn":
        conv = state.num_key_heads * state.key_head_dim * 2 + state.num_value_heads * state.value_head_dim
        return (rows, conv), (state.num_value_heads, state.value_head_dim, state.key_head_dim)
    if state.kind == "mamba2":
        conv = state.intermediate_size + 2 * state.n_groups * state.d_state
        return (rows, conv), (state.n_heads, state.head_dim, state.d_state)
    if state.kind == "mamba1":
        return (rows, state.intermediate_size), (state.intermediate_size, state.d_state)
    if state.kind == "kda":
        return (rows, 3 * state.num_heads * state.head_dim), (state.num_heads, state.head_dim, state.head_dim)
    if state.kind == "short_conv":
        return (rows, state.conv_dim), ()
    raise ValueError(f"unknown state kind {state.kind!r}")


def layers_from_scenario(
    scenario: Scenario, *, scale_layers: int = 1, scale_heads: int = 1, include_state: bool = True
) -> list[PoolLayer]:
    """Pool layers for a model-level scenario.

    ``scale_layers`` keeps ``cdiv(n, scale_layers)`` layers of each kind (attention and state);
    ``scale_heads`` divides KV heads (and GDN/Mamba heads) keeping at least one, so a big model
    keeps its per-layer shape at a size the CPU can allocate. The recurrent state dtype is the
    state's ``ssm_dtype``, else the runtime's ``mamba_ssm_cache_dtype``, else fp32 for GDN (what
    vllm-metal forces, vllm-metal#579) and the model dtype otherwise.
    """
    model = scenario.model
    if model is None:
        raise ValueError(f"{scenario.name}: a spec-level scenario has no model geometry for a pool")
    if scale_layers < 1 or scale_heads < 1:
        raise ValueError(f"scale_layers={scale_layers} and scale_heads={scale_heads} must be >= 1")
    out: list[PoolLayer] = []
    attn = model.attention
    if attn is not None and model.num_attention_layers:
        kinds: list[PoolLayer] = []  # one per attention layer, in layer order
        for code in model.layers:
            if code not in "ASLXP":
                continue
            if attn.kind == "mla":
                kinds.append(mla_layer(attn.kv_lora_rank, attn.qk_rope_head_dim, model.dtype))
            else:  # full-attention layers may have their own head size and KV heads (Gemma 4)
                g = attn.for_layer("full_attention" if code in "AP" else "other")
                heads = max(1, g.num_kv_heads // scale_heads)
                kinds.append(attention_layer(heads, g.head_dim, model.dtype, g.head_dim_v))
        for layer in [k for i, k in enumerate(kinds) if k not in kinds[:i]]:  # each geometry, scaled
            out.extend([layer] * -(-kinds.count(layer) // scale_layers))
    state = model.state
    n_state = -(-model.num_state_layers // scale_layers)
    if include_state and state is not None and n_state:
        if scale_heads > 1:
            import dataclasses

            fields = ("num_key_heads", "num_value_heads", "n_heads", "num_heads")
            state = dataclasses.replace(
                state, **{f: max(1, getattr(state, f) // scale_heads) for f in fields if getattr(state, f)}
            )
        conv, rec = _state_shapes(state)
        rdt = state.ssm_dtype if state.ssm_dtype != "auto" else scenario.runtime.mamba_ssm_cache_dtype
        if rdt == "auto":
            rdt = "float32" if state.kind == "gdn" else model.dtype
        out.extend([state_layer(conv, model.dtype, rec, rdt)] * n_state)
    return out
