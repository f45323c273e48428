"""A model's config.json read as a ``kv-scenario/1`` scenario, offline.

The inverse of the ``vllm`` backend's config writers (backends/vllm/configs.py): each reader knows
one family's spelling of the KV geometry across the transformers versions vLLM 0.23 ... 0.33 pin
(``layer_types`` or the older ``sliding_window_pattern``, ``full_attention_interval``,
``full_attn_idxs``; ``torch_dtype`` or transformers 5's ``dtype``) and records, for every field,
the config.json key it came from. :func:`scenario_toml` renders the scenario with those keys as
comments; a key whose meaning is ambiguous is a :class:`ConfigError` naming it, never a guess.
Nothing here imports vLLM or transformers, and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .scenario import ScenarioError


class ConfigError(ScenarioError):
    """A config.json this module cannot read: the message names the file and the key."""


#: A field's value and the config.json key it came from (``a + b``: derived from both).
Sourced = tuple[Any, str]


@dataclass
class ReadConfig:
    """What a reader found in one config.json: each field with the key it came from."""

    model: dict[str, Sourced] = field(default_factory=dict)
    attention: dict[str, Sourced] = field(default_factory=dict)
    state: dict[str, Sourced] = field(default_factory=dict)


class _Config:
    """One config.json (its ``text_config`` for a multimodal wrapper): keys read with their path."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
        self.data, self.source, self.prefix = data, source, prefix

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def key(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str, default: Any = None) -> Sourced:
        return self.data.get(key, default), self.key(key)

    def need(self, key: str, kind: type = int) -> Sourced:
        """A required key of type ``kind`` (bool is not an int here)."""
        value = self.data.get(key)
        if value is None:
            raise ConfigError(self.source, self.key(key), "missing: the family's config.json spells it here")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(self.source, self.key(key), f"expected {kind.__name__}, got {value!r}")
        return value, self.key(key)

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.source, self.key(key), problem)


Reader = Callable[[_Config, ReadConfig], None]
#: architecture -> reader(config, read): fills ``read`` (the common fields are read before)
READERS: dict[str, Reader] = {}


def reader(*architectures: str) -> Callable[[Reader], Reader]:
    def register(fn: Reader) -> Reader:
        for arch in architectures:
            READERS[arch] = fn
        return fn

    return register


# ---------------------------------------------------------------------------- shared pieces


def _gqa(cfg: _Config, read: ReadConfig, *, head_dim_from_hidden: bool = False) -> None:
    """Query and KV heads and the head size: ``head_dim``, or ``hidden_size // num_attention_heads``
    where the config has none (or where the family's attention always derives it)."""
    heads = cfg.need("num_attention_heads")
    kv = cfg.get("num_key_value_heads")
    read.attention["kind"] = ("gqa", "")
    read.attention["num_attention_heads"] = heads
    read.attention["num_kv_heads"] = kv if kv[0] is not None else (heads[0], heads[1])
    if cfg.has("head_dim") and not head_dim_from_hidden:
        read.attention["head_dim"] = cfg.need("head_dim")
        return
    hidden = cfg.need("hidden_size")
    if hidden[0] % heads[0]:
        raise cfg.error("hidden_size", f"{hidden[0]} is not a whole number of {heads[0]} heads")
    read.attention["head_dim"] = (hidden[0] // heads[0], f"{hidden[1]} / {heads[1]}")


def _mla(cfg: _Config, read: ReadConfig) -> None:
    read.attention["kind"] = ("mla", "")
    read.attention["kv_lora_rank"] = cfg.need("kv_lora_rank")
    read.attention["qk_rope_head_dim"] = cfg.need("qk_rope_head_dim")


def _codes(values: list[Any], names: Mapping[str, str], cfg: _Config, key: str) -> str:
    """A per-layer list spelled with the family's names, as layer codes."""
    bad = sorted({str(v) for v in values} - set(names))
    if bad:
        raise cfg.error(key, f"unknown layer kind(s) {', '.join(bad)}; known: {', '.join(names)}")
    return "".join(names[v] for v in values)


def _layer_types(
    cfg: _Config, read: ReadConfig, names: Mapping[str, str], spelling: str = "layer_types"
) -> bool:
    """The per-layer list ``spelling`` (``layer_types``, or a family's ``layers_block_type``), if
    the config has it: True when read."""
    if not cfg.has(spelling):
        return False
    values, key = cfg.get(spelling)
    _check_length(cfg, read, len(values), key)
    read.model["layers"] = (_codes(values, names, cfg, "layer_types"), key)
    return True


def _check_length(cfg: _Config, read: ReadConfig, length: int, key: str) -> None:
    layers = read.model["num_hidden_layers"][0]
    if length != layers:
        raise ConfigError(cfg.source, key, f"{length} entries for num_hidden_layers = {layers}")


def _every_layer(read: ReadConfig, code: str, why: str) -> None:
    read.model["layers"] = (code * read.model["num_hidden_layers"][0], why)


def _window(cfg: _Config, read: ReadConfig) -> None:
    if "S" in read.model["layers"][0]:
        read.attention["sliding_window"] = cfg.need("sliding_window")


def _ssm_dtype(cfg: _Config, read: ReadConfig, key: str) -> None:
    """The state's SSM dtype a config states (``auto``: the model dtype)."""
    value = cfg.data.get(key)
    if value is not None and value != read.model["dtype"][0]:
        read.state["ssm_dtype"] = (value, cfg.key(key))


# ---------------------------------------------------------------------------- the families

DENSE_SLIDING = {"sliding_attention": "S", "full_attention": "A"}


@reader("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
def dense(cfg: _Config, read: ReadConfig) -> None:
    """Every layer full attention, or per ``layer_types``; a ``sliding_window`` without them slides
    every layer (vLLM's ``Attention`` takes ``CacheConfig.sliding_window``: Mistral-7B-v0.1).
    Qwen2/3 gate the window with ``use_sliding_window`` (transformers drops it when false); with
    it on, which layers slide depends on ``max_window_layers``: an error without ``layer_types``."""
    _gqa(cfg, read)
    if _layer_types(cfg, read, DENSE_SLIDING):
        return _window(cfg, read)
    qwen = read.model["architecture"][0].startswith("Qwen")
    if qwen and cfg.data.get("use_sliding_window"):
        raise cfg.error("use_sliding_window", "true without layer_types: which layers slide is ambiguous")
    if cfg.has("sliding_window") and not qwen:
        _every_layer(read, "S", f"{cfg.key('sliding_window')} (every layer)")
        return _window(cfg, read)
    _every_layer(read, "A", "(no layer_types nor sliding_window: every layer full)")


@reader("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
def gemma2_3(cfg: _Config, read: ReadConfig) -> None:
    """``layer_types``; before it, Gemma 2 alternated from a sliding layer 0 and Gemma 3 made every
    ``sliding_window_pattern``-th layer full (``Gemma3TextConfig``'s default 6 where the file has
    none: google/gemma-3-27b-it's)."""
    _gqa(cfg, read)
    if not _layer_types(cfg, read, DENSE_SLIDING):
        n = read.model["num_hidden_layers"][0]
        if read.model["architecture"][0] == "Gemma2ForCausalLM":
            read.model["layers"] = (
                "".join("S" if i % 2 == 0 else "A" for i in range(n)),
                "(Gemma 2: even layers slide)",
            )
        else:
            every, key = cfg.need("sliding_window_pattern") if cfg.has("sliding_window_pattern") else (6, "")
            key = key or cfg.key("sliding_window_pattern") + " (absent: Gemma3TextConfig's default 6)"
            read.model["layers"] = ("".join("A" if (i + 1) % every == 0 else "S" for i in range(n)), key)
    if not cfg.has("max_position_embeddings") and read.model["architecture"][0] != "Gemma2ForCausalLM":
        key = cfg.key("max_position_embeddings") + " (absent: Gemma3TextConfig's default 131072)"
        read.model["max_position_embeddings"] = (131072, key)
    _window(cfg, read)


@reader("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
def gemma4(cfg: _Config, read: ReadConfig) -> None:
    """``layer_types`` and the full layers' ``global_head_dim`` / ``num_global_key_value_heads``
    (the latter read by transformers only with ``attention_k_eq_v``)."""
    _gqa(cfg, read)
    if not _layer_types(cfg, read, DENSE_SLIDING):
        raise cfg.error("layer_types", "missing: Gemma 4 lists each layer's kind")
    _window(cfg, read)
    sliding = read.attention
    if cfg.has("global_head_dim") and cfg.data["global_head_dim"] != sliding["head_dim"][0]:
        sliding["global_head_dim"] = cfg.need("global_head_dim")
    if cfg.data.get("attention_k_eq_v") and cfg.has("num_global_key_value_heads"):
        heads = cfg.need("num_global_key_value_heads")
        if heads[0] != sliding["num_kv_heads"][0]:
            sliding["num_global_kv_heads"] = heads


@reader("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
def deepseek_mla(cfg: _Config, read: ReadConfig) -> None:
    """MLA on every layer: the latent is ``kv_lora_rank + qk_rope_head_dim`` values a token."""
    _mla(cfg, read)
    if cfg.has("index_head_dim"):
        raise cfg.error(
            "index_head_dim",
            "a sparse indexer: the architecture is DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM",
        )
    _every_layer(read, "A", "(MLA on every layer)")


@reader("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
def deepseek_sparse_mla(cfg: _Config, read: ReadConfig) -> None:
    """MLA plus the DSA lightning indexer's key cache on every layer (``index_head_dim``)."""
    _mla(cfg, read)
    read.attention["indexer_head_dim"] = cfg.need("index_head_dim")
    _every_layer(read, "A", "(MLA on every layer)")


def _mamba2_fields(cfg: _Config, read: ReadConfig, **keys: str) -> None:
    read.state["kind"] = ("mamba2", "")
    for name, key in keys.items():
        read.state[name] = cfg.need(key)


@reader("GraniteMoeHybridForCausalLM")
def granite_moe_hybrid(cfg: _Config, read: ReadConfig) -> None:
    """``layer_types`` of attention/mamba (transformers 5: full_attention/linear_attention, or the
    alias ``layers_block_type``); Mamba2's inner width ``mamba_expand * hidden_size`` and its
    ``mamba_d_head`` (``"auto"``: that width over ``mamba_n_heads``); the attention's head size is
    always ``hidden_size / num_attention_heads`` (GraniteMoeHybridAttention)."""
    _gqa(cfg, read, head_dim_from_hidden=True)
    names = {"attention": "A", "mamba": "M", "full_attention": "A", "linear_attention": "M"}
    if not (_layer_types(cfg, read, names) or _layer_types(cfg, read, names, "layers_block_type")):
        raise cfg.error("layer_types", "missing: Granite 4.0-H lists each layer's kind")
    auto = cfg.data.get("mamba_d_head") == "auto"
    fields = dict(n_heads="mamba_n_heads", d_state="mamba_d_state", n_groups="mamba_n_groups",
                  conv_kernel="mamba_d_conv", **({} if auto else {"head_dim": "mamba_d_head"}))  # fmt: skip
    _mamba2_fields(cfg, read, **fields)
    expand, hidden = cfg.need("mamba_expand"), cfg.need("hidden_size")
    width = expand[0] * hidden[0]
    read.state["intermediate_size"] = (width, f"{expand[1]} * {hidden[1]}")
    if auto:
        heads = read.state["n_heads"]
        read.state["head_dim"] = (
            width // heads[0],
            f"mamba_d_head auto: {expand[1]} * {hidden[1]} / {heads[1]}",
        )
    if cfg.has("mamba_chunk_size"):
        read.state["chunk_size"] = cfg.need("mamba_chunk_size")


@reader("NemotronHForCausalLM")
def nemotron_h(cfg: _Config, read: ReadConfig) -> None:
    """``hybrid_override_pattern``: ``M`` Mamba2, ``*`` attention, ``-`` MLP and ``E`` MoE (no KV
    cache); transformers 5 spells it ``layers_block_type`` (or ``layer_types``) of
    linear_attention/full_attention/mlp/moe. The Mamba2 width is ``mamba_num_heads * mamba_head_dim``."""
    _gqa(cfg, read)
    names = {"linear_attention": "M", "full_attention": "A", "mlp": "-", "moe": "-"}
    if not any(_layer_types(cfg, read, names, key) for key in ("layers_block_type", "layer_types")):
        pattern, key = cfg.need("hybrid_override_pattern", str)
        _check_length(cfg, read, len(pattern), key)
        read.model["layers"] = (
            _codes(list(pattern), {"M": "M", "*": "A", "-": "-", "E": "-"}, cfg, key),
            key,
        )
    _mamba2_fields(cfg, read, n_heads="mamba_num_heads", head_dim="mamba_head_dim", d_state="ssm_state_size",
                   n_groups="n_groups", conv_kernel="conv_kernel")  # fmt: skip
    heads, dim = read.state["n_heads"], read.state["head_dim"]
    read.state["intermediate_size"] = (heads[0] * dim[0], f"{heads[1]} * {dim[1]}")
    _ssm_dtype(cfg, read, "mamba_ssm_cache_dtype")
    for key in ("chunk_size", "mamba_chunk_size"):
        if cfg.has(key):
            read.state["chunk_size"] = cfg.need(key)


GDN_LAYERS = {"full_attention": "A", "linear_attention": "M"}


@reader("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
def qwen_gdn(cfg: _Config, read: ReadConfig) -> None:
    """``layer_types`` of full/linear attention, or the older ``full_attention_interval`` (every
    N-th layer full); the Gated DeltaNet state's ``linear_*`` heads and ``mamba_ssm_dtype``."""
    _gqa(cfg, read)
    if not _layer_types(cfg, read, GDN_LAYERS):
        every, key = cfg.need("full_attention_interval")
        n = read.model["num_hidden_layers"][0]
        read.model["layers"] = ("".join("A" if (i + 1) % every == 0 else "M" for i in range(n)), key)
    read.state["kind"] = ("gdn", "")
    for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
        read.state[name] = cfg.need("linear_" + name)
    read.state["conv_kernel"] = cfg.need("linear_conv_kernel_dim")
    _ssm_dtype(cfg, read, "mamba_ssm_dtype")


@reader("KimiLinearForCausalLM")
def kimi_linear(cfg: _Config, read: ReadConfig) -> None:
    """MLA full-attention layers and KDA state layers, each listed 1-based in ``linear_attn_config``."""
    _mla(cfg, read)
    linear, key = cfg.need("linear_attn_config", dict)
    sub = _Config(linear, cfg.source, key + ".")
    n = read.model["num_hidden_layers"][0]
    kda, full = set(sub.need("kda_layers", list)[0]), set(sub.need("full_attn_layers", list)[0])
    if kda & full or kda | full != set(range(1, n + 1)):
        raise sub.error("kda_layers", f"with full_attn_layers, not every layer 1 ... {n} exactly once")
    read.model["layers"] = ("".join("M" if i + 1 in kda else "A" for i in range(n)), f"{key}.kda_layers")
    read.state["kind"] = ("kda", "")
    read.state["num_heads"] = sub.need("num_heads")
    read.state["head_dim"] = sub.need("head_dim")
    read.state["conv_kernel"] = sub.need("short_conv_kernel_size")


@reader("Lfm2ForCausalLM")
def lfm2(cfg: _Config, read: ReadConfig) -> None:
    """``layer_types`` of conv/full_attention, or the older ``full_attn_idxs``; the short conv is
    ``conv_dim`` (else the hidden size) wide over ``conv_L_cache`` taps; the attention's head size
    is ``hidden_size / num_attention_heads`` (Lfm2Attention)."""
    _gqa(cfg, read, head_dim_from_hidden=True)
    if not _layer_types(cfg, read, {"full_attention": "A", "conv": "M"}):
        full, key = cfg.need("full_attn_idxs", list)
        n = read.model["num_hidden_layers"][0]
        read.model["layers"] = ("".join("A" if i in full else "M" for i in range(n)), key)
    read.state["kind"] = ("short_conv", "")
    read.state["conv_dim"] = cfg.need("conv_dim") if cfg.has("conv_dim") else cfg.need("hidden_size")
    read.state["conv_kernel"] = cfg.need("conv_L_cache")


@reader("JambaForCausalLM")
def jamba(cfg: _Config, read: ReadConfig) -> None:
    """Layer i is attention when ``i % attn_layer_period == attn_layer_offset``, else Mamba (v1)."""
    _gqa(cfg, read, head_dim_from_hidden=True)
    period, offset = cfg.need("attn_layer_period"), cfg.need("attn_layer_offset")
    n = read.model["num_hidden_layers"][0]
    layers = "".join("A" if i % period[0] == offset[0] else "M" for i in range(n))
    read.model["layers"] = (layers, f"{period[1]}, {offset[1]}")
    expand, hidden = cfg.need("mamba_expand"), cfg.need("hidden_size")
    read.state["kind"] = ("mamba1", "")
    read.state["intermediate_size"] = (expand[0] * hidden[0], f"{expand[1]} * {hidden[1]}")
    read.state["d_state"] = cfg.need("mamba_d_state")
    read.state["conv_kernel"] = cfg.need("mamba_d_conv")


@reader("BertModel")
def bert(cfg: _Config, read: ReadConfig) -> None:
    """An encoder: no layer holds a KV cache (vLLM's ``EncoderOnlyAttention``)."""
    _gqa(cfg, read)
    _every_layer(read, "-", "(encoder-only: no KV cache)")


# ---------------------------------------------------------------------------- the whole file


def config_path(path: str | Path) -> Path:
    """``path`` itself when it is a file, its ``config.json`` when it is a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(str(path), "path", "no config.json there")
    return p


def is_config_path(item: str | Path) -> bool:
    """Whether ``item`` names a config.json (a ``.json`` file) or a directory holding one."""
    p = Path(item)
    return (p.is_file() and p.suffix == ".json") or (p.is_dir() and (p / "config.json").is_file())


def scenario_files(path: str | Path) -> list[Path]:
    """What ``path`` names as scenarios: itself (a scenario file, a config.json or a model
    directory), or a folder's ``*.toml`` files and the model directories a level down."""
    p = Path(path)
    if not p.is_dir() or is_config_path(p):
        return [p]
    return sorted(p.glob("*.toml")) + sorted(q.parent for q in p.glob("*/config.json"))


def read_config(path: str | Path, dtype: str | None = None) -> ReadConfig:
    """The KV geometry of the config.json at ``path`` (a file or a model directory), served in
    ``dtype`` (``vllm serve --dtype``; ``None`` or ``auto``: the config's own, see :func:`_dtype`)."""
    file = config_path(path)
    source = str(file)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(source, "json", f"not a JSON file: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(source, "json", "not a JSON object")
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConfigError(source, "architectures", "missing: the model class vLLM would load")
    # the vllm backend's writers mark a config written as another class of the same layers
    # (backends/vllm/configs.py): read as the model it stands for
    arch = data.get("kvconform_substitutes") or archs[0]
    read_family = READERS.get(arch)
    if read_family is None:
        raise ConfigError(
            source, "architectures", f"{arch!r} is not known; known: {', '.join(sorted(READERS))}"
        )
    text = data.get("text_config")
    cfg = _Config(text, source, "text_config.") if isinstance(text, dict) else _Config(data, source)
    read = ReadConfig()
    read.model["architecture"] = (arch, "architectures[0]" if arch == archs[0] else "kvconform_substitutes")
    served = dtype not in (None, "auto")
    read.model["dtype"] = (dtype, "--dtype") if served else _dtype(cfg, _Config(data, source))
    read.model["num_hidden_layers"] = _num_layers(cfg)
    if cfg.has("max_position_embeddings"):
        read.model["max_position_embeddings"] = cfg.need("max_position_embeddings")
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        for where in (cfg, _Config(data, source)):
            if where.data.get(key):
                read.model["num_nextn_predict_layers"] = where.need(key)
    read_family(cfg, read)
    return read


def _num_layers(cfg: _Config) -> Sourced:
    """``num_hidden_layers``, or the length of the per-layer list that replaces it (transformers 5's
    NemotronHConfig: ``layers_block_type``)."""
    if cfg.has("num_hidden_layers"):
        return cfg.need("num_hidden_layers")
    for key in ("layers_block_type", "hybrid_override_pattern"):
        if cfg.has(key):
            return len(cfg.data[key]), f"len({cfg.key(key)})"
    return cfg.need("num_hidden_layers")


def _dtype(cfg: _Config, top: _Config) -> Sourced:
    """``torch_dtype`` (transformers 4) or ``dtype`` (transformers 5), of the text config or the file:
    what ``--dtype auto`` serves, but for a float32 model, which vLLM serves in the platform's first
    supported dtype (``_resolve_auto_dtype`` in vllm/config/model.py, vLLM 0.32): that is the
    platform's choice, so ``--dtype`` must say it."""
    for where in (cfg, top):
        for key in ("torch_dtype", "dtype"):
            if where.has(key):
                value = where.need(key, str)
                if value[0] in ("float32", "float"):
                    problem = "--dtype auto serves it in the platform's first supported dtype"
                    problem += " (vLLM's _resolve_auto_dtype); give --dtype"
                    raise where.error(key, f"{value[0]}: {problem}")
                return value
    raise top.error("torch_dtype", "missing (nor dtype): give --dtype")


#: ``vllm serve`` options -> the ``[runtime]`` key each sets (an ``int`` or a ``str`` value)
SERVE_OPTIONS: dict[str, tuple[str, type]] = {
    "--dtype": ("dtype", str),  # the [model]'s dtype, not a [runtime] key
    "--block-size": ("block_size", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--pipeline-parallel-size": ("pipeline_parallel_size", int),
    "--decode-context-parallel-size": ("decode_context_parallel_size", int),
    "--max-model-len": ("max_model_len", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--num-speculative-tokens": ("num_speculative_tokens", int),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", int),
    "--num-gpu-blocks-override": ("num_gpu_blocks_override", int),
    "--mamba-cache-mode": ("mamba_cache_mode", str),
    "--mamba-cache-dtype": ("mamba_cache_dtype", str),
    "--mamba-ssm-cache-dtype": ("mamba_ssm_cache_dtype", str),
}


#: ``vllm serve``'s switches besides :data:`SERVE_OPTIONS`
SERVE_FLAGS = ("--async-scheduling", "--disable-hybrid-kv-cache-manager", "--kv-cache-dtype-skip-layers")

#: A model directory's ``vllm serve`` options (one line, as a bug report gives them): read with its
#: config.json wherever the directory is a scenario; options given on a command line win.
SERVE_ARGS_FILE = "vllm-serve-args"


def _dest(option: str) -> str:
    return "serve_" + option.removeprefix("--").replace("-", "_")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``vllm serve``'s sizing options, spelled as it spells them; one not given is left to the
    scenario (a config.json: the engine's default)."""
    group = p.add_argument_group("vllm serve options (the scenario's [runtime], and --dtype its [model])")
    for option, (key, kind) in SERVE_OPTIONS.items():
        group.add_argument(option, dest=_dest(option), type=kind, metavar=key.upper(),
                           help=f"[model] {key}" if key == "dtype" else f"[runtime] {key}")  # fmt: skip
    flag = "--async-scheduling"
    group.add_argument(
        flag,
        dest=_dest(flag),
        default=None,
        action=argparse.BooleanOptionalAction,
        help="max_concurrent_batches: the pipeline's stages + 1 with, the stages without",
    )
    flag = "--disable-hybrid-kv-cache-manager"
    group.add_argument(flag, dest=_dest(flag), action="store_true", default=None,
                       help="[runtime] disable_hybrid_kv_cache_manager")  # fmt: skip
    flag = "--kv-cache-dtype-skip-layers"
    group.add_argument(flag, dest=_dest(flag), metavar="LAYERS",
                       help="comma-separated layer indices or sliding_window")  # fmt: skip


def parsed_serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The values of the options :func:`add_serve_args` parsed into ``args`` (:func:`serve_settings`)."""
    options = (*SERVE_OPTIONS, *SERVE_FLAGS)
    return serve_settings({option: getattr(args, _dest(option), None) for option in options})


class _ArgsFileParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise ValueError(message)


def serve_args_file(path: str | Path) -> dict[str, Any]:
    """The settings of the :data:`SERVE_ARGS_FILE` beside the config.json at ``path`` ({} if none);
    a bad option is a :class:`ConfigError` naming the file."""
    file = config_path(path).parent / SERVE_ARGS_FILE
    if not file.is_file():
        return {}
    parser = _ArgsFileParser(prog=SERVE_ARGS_FILE, add_help=False)
    add_serve_args(parser)
    try:
        args = parser.parse_args(shlex.split(file.read_text(encoding="utf-8"), comments=True))
    except ValueError as exc:
        raise ConfigError(str(file), "options", str(exc)) from None
    return parsed_serve_settings(args)


def serve_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Values of the ``vllm serve`` options given (``None``: left to the engine), keyed by the
    ``[runtime]`` key each sets (``dtype``: the [model]'s; a stated ``block_size`` is a
    ``--block-size``): ``--async-scheduling`` / ``--no-async-scheduling`` are
    ``max_concurrent_batches`` at pipeline size 1, ``--disable-hybrid-kv-cache-manager`` and
    ``--kv-cache-dtype-skip-layers`` pass through."""
    runtime = {SERVE_OPTIONS[o][0]: v for o, v in options.items() if o in SERVE_OPTIONS and v is not None}
    if options.get("--async-scheduling") is not None:
        pp = runtime.get("pipeline_parallel_size", 1)
        runtime["max_concurrent_batches"] = pp + 1 if options["--async-scheduling"] else pp
    if options.get("--disable-hybrid-kv-cache-manager"):
        runtime["disable_hybrid_kv_cache_manager"] = True
    if options.get("--kv-cache-dtype-skip-layers"):
        runtime["kv_cache_dtype_skip_layers"] = tuple(options["--kv-cache-dtype-skip-layers"].split(","))
    return runtime


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _lines(values: Mapping[str, Sourced]) -> list[str]:
    return [f"{k} = {_toml_value(v)}" + (f"  # {key}" if key else "") for k, (v, key) in values.items()]


def scenario_toml(path: str | Path, runtime: Mapping[str, Any] | None = None, name: str | None = None) -> str:
    """The ``kv-scenario/1`` TOML of the config.json at ``path``: each model field commented with
    the key it came from; ``runtime`` (``[runtime]`` keys, e.g. from :func:`serve_settings`) as
    given over those of the model directory's :data:`SERVE_ARGS_FILE`, the rest left to the engine's
    defaults (``max_model_len``: the config's ``max_position_embeddings``, as ``vllm serve``
    derives it)."""
    settings = {**serve_args_file(path), **(runtime or {})}
    read = read_config(path, settings.pop("dtype", None))
    file = config_path(path)
    model = dict(read.model)
    arch = model.pop("architecture")
    if "max_model_len" not in settings:
        derived = model.get("max_position_embeddings")
        if derived is None:
            raise ConfigError(str(file), "max_position_embeddings", "missing: give --max-model-len")
        settings["max_model_len"] = derived[0]
    title = name or file.parent.name or arch[0]
    out = ['schema = "kv-scenario/1"', f"name = {_toml_value(title)}", "", "[model]"]
    out += _lines({"architecture": arch, **model})
    out.append(f"sources = [{_toml_value(str(file))}]")
    out += ["", "[model.attention]", *_lines(read.attention)]
    if read.state:
        out += ["", "[model.state]", *_lines(read.state)]
    out += ["", "[runtime]  # vllm serve's options; a key not here is the engine's default"]
    out += [f"{k} = {_toml_value(v)}" for k, v in settings.items()]
    return "\n".join(out) + "\n"


def load_config_scenario(path: str | Path, runtime: Mapping[str, Any] | None = None) -> Any:
    """The scenario of the config.json at ``path`` (see :func:`scenario_toml`)."""
    from .scenario import parse_scenario

    return parse_scenario(scenario_toml(path, runtime), str(config_path(path)))


__all__ = ["READERS", "SERVE_OPTIONS", "ConfigError", "ReadConfig", "config_path", "is_config_path",
           "load_config_scenario", "read_config", "scenario_toml", "serve_settings"]  # fmt: skip
