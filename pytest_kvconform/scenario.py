"""The neutral scenario model and its ``kv-scenario/1`` TOML loader.

A :class:`Scenario` holds the KV-relevant architecture of one model plus the runtime
settings it is served with. It imports only the standard library.

Two forms are accepted (see ``docs/scenario-format.md``):

* the *model-level* form: ``[model]`` with a layer string, ``[model.attention]`` and
  ``[model.state]`` geometry, which the reference turns into per-layer specs;
* the *spec-level* form: ``[[layer_specs]]`` tables with explicit per-layer geometry
  (block size, heads, dtype, shapes, packed bytes), for probes that no real config
  produces, such as the TurboQuant LCM case of vllm#40128.

Every problem in a file raises :class:`ScenarioError`, which names the file, the key
and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from importlib import resources
from pathlib import Path
from typing import Any

from .model import KVPlan

SCHEMA = "kv-scenario/1"

#: One character per decoder layer in ``[model].layers``.
LAYER_CODES = {
    "A": "full attention (K+V, or the MLA latent)",
    "S": "sliding-window attention ([model.attention].sliding_window)",
    "L": "chunked local attention ([model.attention].attention_chunk_size)",
    "X": "cross attention (reserves max_num_batched_tokens)",
    "M": "state layer ([model.state])",
    "P": "attention and state in the same layer (parallel hybrid)",
    "-": "no per-request cache (MLP/MoE only)",
}
ATTENTION_KINDS = ("gqa", "mla")
STATE_KINDS = ("mamba1", "mamba2", "gdn", "kda", "short_conv")
#: ``kv_cache_dtype`` strings of vLLM 0.33 (``vllm/config/cache.py``, ``CacheDType``).
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
    "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
    "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact",
    "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
    "nvfp4", "nvfp4_4over6",
)  # fmt: skip
MODEL_DTYPES = ("float16", "bfloat16", "float32")
#: ``MambaDType`` of vLLM 0.33.
MAMBA_DTYPES = ("auto", "float16", "bfloat16", "float32")
MAMBA_CACHE_MODES = ("none", "align", "all")
#: ``[runtime]`` keys whose default is the engine's, by release and model kind: a file that does
#: not state one leaves it *unset* (:attr:`RuntimeSettings.unset`) and the plan gives it what
#: ``vllm serve`` sets (``reference.defaults``; docs/engine-defaults.md). Until then it holds the
#: format's own value (the field default).
DEFAULTED = ("mamba_cache_mode", "max_concurrent_batches")
#: ``SpeculativeConfig.method`` values the format names (vllm/config/speculative.py); ``auto``:
#: ``mtp`` when the model ships MTP modules (``num_nextn_predict_layers``), else ``ngram``.
SPECULATIVE_METHODS = ("auto", "mtp", "eagle", "eagle3", "ngram", "draft_model")
#: Page-size unification policies (``reference/unify.py``).
UNIFY_POLICIES = ("pad-to-max", "scale-only", "lcm")
SPEC_KINDS = ("full_attention", "sliding_window", "chunked_local", "cross_attention", "mla", "mamba")
#: torch dtype names a spec-level layer may use, with their element sizes.
SPEC_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1, "float8_e4m3fn": 1}


class ScenarioError(ValueError):
    """A scenario file or value is malformed; the message names the file and the key."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {key}: {problem}")


@dataclass(frozen=True)
class AttentionGeometry:
    """``[model.attention]``: the per-layer attention geometry (one for the whole model)."""

    kind: str = "gqa"
    num_kv_heads: int = 0
    head_dim: int = 0
    head_dim_v: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    indexer_head_dim: int = 0
    indexer_layers: str | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    num_attention_heads: int = 0  # query heads; only the Metal runtime needs them
    #: Gemma 4's ``global_head_dim`` / ``num_global_key_value_heads``: the head size and KV heads
    #: of the full-attention layers when they differ from the sliding ones (None: the same)
    global_head_dim: int | None = None
    num_global_kv_heads: int | None = None
    #: attention sinks (gpt-oss: a learned per-head logit; no KV of its own): what an attention
    #: backend must support (``AttentionBackend.supports_sink``)
    sinks: bool = False

    @property
    def is_heterogeneous(self) -> bool:
        """Whether full-attention layers have their own head size or KV heads."""
        return self.global_head_dim is not None or self.num_global_kv_heads is not None

    def for_layer(self, kind: str) -> AttentionGeometry:
        """The geometry of one layer of spec ``kind``: full-attention layers take the global head
        size and KV heads (transformers' ``Gemma4TextConfig.per_layer_config``), the others these."""
        if kind != "full_attention" or not self.is_heterogeneous:
            return self
        return dataclasses.replace(
            self, head_dim=self.global_head_dim or self.head_dim,
            num_kv_heads=self.num_global_kv_heads or self.num_kv_heads,
            global_head_dim=None, num_global_kv_heads=None,
        )  # fmt: skip


@dataclass(frozen=True)
class StateGeometry:
    """``[model.state]``: Mamba/GDN/KDA/short-conv geometry, in the config's own terms."""

    kind: str
    conv_kernel: int
    ssm_dtype: str = "auto"
    intermediate_size: int = 0  # mamba1, mamba2
    n_groups: int = 0  # mamba2
    n_heads: int = 0  # mamba2
    head_dim: int = 0  # mamba2, kda
    d_state: int = 0  # mamba1, mamba2
    num_key_heads: int = 0  # gdn
    num_value_heads: int = 0  # gdn
    key_head_dim: int = 0  # gdn
    value_head_dim: int = 0  # gdn
    num_heads: int = 0  # kda
    conv_dim: int = 0  # short_conv
    #: mamba1, mamba2: the kernel's chunk of tokens (HF ``mamba_chunk_size`` or ``chunk_size``;
    #: ``ModelConfig.get_mamba_chunk_size``, 2048 when the config has neither); 0: not stated.
    #: Read only by ``mamba_cache_mode = "all"``, which aligns the block to it.
    chunk_size: int = 0


@dataclass(frozen=True)
class ModelGeometry:
    """``[model]``: what vLLM would read from the HF config."""

    architecture: str
    dtype: str
    num_hidden_layers: int
    layers: str
    attention: AttentionGeometry | None = None
    state: StateGeometry | None = None
    num_nextn_predict_layers: int = 0  # MTP modules the checkpoint ships
    #: the context length vLLM derives from the HF config (``max_position_embeddings``); what
    #: ``[runtime] max_model_len = -1`` starts auto-fit from (0: not stated)
    max_position_embeddings: int = 0
    hf_id: str = ""
    sources: tuple[str, ...] = ()
    confidence: str = ""
    notes: str = ""

    @functools.cached_property
    def num_attention_layers(self) -> int:
        return sum(c in "ASLXP" for c in self.layers)

    @functools.cached_property
    def num_state_layers(self) -> int:
        return sum(c in "MP" for c in self.layers)

    @property
    def is_hybrid(self) -> bool:
        return self.num_state_layers > 0 and self.num_attention_layers > 0

    @property
    def use_mla(self) -> bool:
        return self.attention is not None and self.attention.kind == "mla"


@dataclass(frozen=True)
class LayerSpecEntry:
    """One ``[[layer_specs]]`` table of the spec-level form (``count`` identical layers)."""

    kind: str
    count: int = 1
    block_size: int = 16
    num_kv_heads: int = 1
    head_size: int = 0
    head_size_v: int | None = None
    dtype: str = "bfloat16"
    state_content_bytes: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    num_speculative_blocks: int = 0


@dataclass(frozen=True)
class RuntimeSettings:
    """``[runtime]``: what the server is started with."""

    max_model_len: int = 4096
    #: ``max_model_len = -1`` (or ``"auto"``) in the file: vLLM's ``original_max_model_len == -1``,
    #: ``_auto_fit_max_model_len`` picks the length; ``max_model_len`` then holds the length vLLM
    #: derives, the model's ``max_position_embeddings``
    auto_fit_max_model_len: bool = False
    tensor_parallel_size: int = 1
    #: ``--pipeline-parallel-size``: the layers split over stages (``get_pp_indices``), one worker each
    pipeline_parallel_size: int = 1
    block_size: int = 16
    user_specified_block_size: bool = False
    kernel_block_alignment: int = 16
    extra_block_alignment: int = 1
    kv_cache_dtype: str = "auto"
    #: ``--kv-cache-dtype-skip-layers`` (``CacheConfig.kv_cache_dtype_skip_layers``): layer indices
    #: (``"0"``) or ``"sliding_window"`` kept at the model dtype; the engine adds TurboQuant's
    #: boundary layers of a dense model (``reference.hybrid.skip_layers``)
    kv_cache_dtype_skip_layers: tuple[str, ...] = ()
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_cache_mode: str = "none"
    num_speculative_tokens: int = 0
    speculative_method: str = "auto"
    decode_context_parallel_size: int = 1
    #: ``(name, torch dtype)`` pairs a platform adds with ``register_kv_cache_dtype`` (vLLM 0.33).
    registered_kv_cache_dtypes: tuple[tuple[str, str], ...] = ()
    kv_cache_memory_bytes: int = 8 << 30
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int = 2048
    max_concurrent_batches: int = 1
    unify_policy: str = "pad-to-max"
    #: ``--disable-hybrid-kv-cache-manager`` (``SchedulerConfig.disable_hybrid_kv_cache_manager``):
    #: local-attention layers are planned as full attention (``unify_hybrid_kv_cache_specs``)
    disable_hybrid_kv_cache_manager: bool = False
    #: ``--max-num-seqs`` (``SchedulerConfig.max_num_seqs``); None: the engine's default
    max_num_seqs: int | None = None
    #: ``--additional-config`` (``VllmConfig.additional_config``, read by a platform plugin), as
    #: canonical JSON text of a table; :attr:`additional_config_dict` is the table
    additional_config: str = "{}"
    #: ``(name, value)`` environment variables set only while the backend runs (a plugin's switches)
    env: tuple[tuple[str, str], ...] = ()
    #: The keys of :data:`DEFAULTED` the scenario file does not state (sorted): the engine's
    #: default applies (``reference.defaults.engine_defaults``); their values above are the
    #: format's until then. Settings built in code state every key.
    unset: tuple[str, ...] = ()

    @property
    def additional_config_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.additional_config))


@dataclass(frozen=True)
class Scenario:
    """One (model, runtime) pair, plus what the harness must reproduce."""

    name: str
    runtime: RuntimeSettings
    model: ModelGeometry | None = None
    layer_specs: tuple[LayerSpecEntry, ...] = ()
    expect: Mapping[str, Any] = field(default_factory=dict)
    expect_external: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<scenario>"
    #: ``[expect.before.<change>]``: per change of ``reference.releases.CHANGES``, the values its
    #: fields take under the releases that lack that change (:meth:`expect_for`)
    expect_before: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: the engine defaults given to its unset settings (``reference.defaults``), one line each:
    #: ``key = value: why``, naming the vLLM function that sets it
    defaults_applied: tuple[str, ...] = ()

    @property
    def is_spec_level(self) -> bool:
        return self.model is None

    def with_runtime(self, **changes: Any) -> Scenario:
        """A copy with runtime settings changed (``kvconform plan --set``); validated."""
        known = {f.name for f in dataclasses.fields(RuntimeSettings)} - {"unset"}
        for key in changes:
            if key not in known:
                raise ScenarioError(
                    self.source, f"runtime.{key}", "unknown key; expected one of " + ", ".join(sorted(known))
                )
        if "block_size" in changes:  # as in a file: setting it is passing --block-size
            changes.setdefault("user_specified_block_size", True)
        changes["unset"] = tuple(k for k in self.runtime.unset if k not in changes)  # now stated
        runtime = dataclasses.replace(self.runtime, **changes)
        _check_runtime(runtime, self.source)
        _check_model_runtime(runtime, self.model, self.source)
        return dataclasses.replace(self, runtime=runtime, expect={}, expect_external={}, expect_before={})

    def expect_for(self, release: Any) -> dict[str, tuple[str, Any]]:
        """The ``[expect]`` values under ``release`` (a ``RuleSet``: anything with ``has(change)``),
        each with the table it comes from: ``field -> (table, value)``.

        ``[expect]`` states the newest rules; for every change the release lacks, the fields of
        ``[expect.before.<change>]`` replace those values. When the release lacks several changes
        that both state a field, the table of the oldest change wins: the releases before an older
        change are the ones that also lack every newer change. A table of ``rejects`` (the
        kind of refusal vLLM rejects the plan with) replaces every value: then the only one is
        ``"rejects"``; a table of fields after a rejection (a setting newer releases refuse)
        replaces the rejection.
        """
        from .reference.releases import CHANGES  # stdlib only; imported late (reference imports us)

        values = {key: ("expect", value) for key, value in self.expect.items()}
        for change in reversed(CHANGES):  # newest first, so that the oldest change's table wins
            if change.name in self.expect_before and not release.has(change.name):
                table = f"expect.before.{change.name}"
                older = {k: (table, v) for k, v in self.expect_before[change.name].items()}
                values = older if REJECTS in values or REJECTS in older else {**values, **older}
        return values


# --------------------------------------------------------------------------- loading


def packaged_scenario_names() -> list[str]:
    """Names (file stems) of the scenarios shipped in ``pytest_kvconform/scenarios``."""
    root = resources.files("pytest_kvconform") / "scenarios"
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load a packaged scenario by name (``granite-4.0-h-tiny``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml" and not path.exists():
        root = resources.files("pytest_kvconform") / "scenarios"
        candidate = root / f"{name_or_path}.toml"
        if not candidate.is_file():
            raise ScenarioError(
                str(name_or_path),
                "name",
                "not a file and not a packaged scenario; packaged: " + ", ".join(packaged_scenario_names()),
            )
        return parse_scenario(candidate.read_text(encoding="utf-8"), f"{name_or_path}.toml")
    if not path.is_file():
        raise ScenarioError(str(path), "path", "no such file")
    return parse_scenario(path.read_text(encoding="utf-8"), str(path))


class WrittenFloat(float):
    """A TOML float that keeps its text, so an ``[expect]`` value is compared to the precision it
    is written in (:func:`expected_value_matches`)."""

    text: str

    def __new__(cls, text: str) -> WrittenFloat:
        self = super().__new__(cls, text)
        self.text = text.replace("_", "")
        return self

    def __getnewargs__(self) -> tuple[str]:  # pickles (to an isolated backend's process) keep the text
        return (self.text,)


def expected_value_matches(want: Any, got: Any) -> bool:
    """An ``[expect]`` value against a plan's: exact, a float to the decimal places it is written
    in (``28.8`` matches 28.8 or 28.75, never 28.805; ``0.080`` needs 0.080, rounding half to even)."""
    if not isinstance(want, float):
        return bool(got == want)
    if isinstance(got, bool) or not isinstance(got, int | float):
        return False
    written = Decimal(want.text if isinstance(want, WrittenFloat) else repr(want))
    if not written.is_finite():
        return bool(got == want)
    return Decimal(got).quantize(Decimal(1).scaleb(written.as_tuple().exponent), ROUND_HALF_EVEN) == written


def parse_scenario(text: str, source: str = "<string>") -> Scenario:
    """Parse and validate ``kv-scenario/1`` TOML text."""
    try:
        data = tomllib.loads(text, parse_float=WrittenFloat)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(source, "<toml>", f"not valid TOML ({exc})") from None
    # only [expect] keeps the written text; the model and runtime hold plain floats
    return scenario_from_dict({k: v if k == "expect" else _plain(v) for k, v in data.items()}, source)


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def scenario_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Scenario:
    """Build a validated :class:`Scenario` from already-parsed TOML tables."""
    r = _Reader(data, source, "")
    schema = r.str("schema")
    if schema != SCHEMA:
        raise ScenarioError(source, "schema", f"expected {SCHEMA!r}, got {schema!r}")
    name = r.str("name")
    r.done(allowed={"schema", "name", "model", "runtime", "layer_specs", "expect"})
    if ("model" in data) == ("layer_specs" in data):
        raise ScenarioError(source, "model", "expected exactly one of [model] or [[layer_specs]]")
    model = _read_model(r.table("model"), source) if "model" in data else None
    specs = _read_layer_specs(data["layer_specs"], source) if "layer_specs" in data else ()
    runtime = _read_runtime(r.table("runtime", required=False), source)
    if runtime.auto_fit_max_model_len:  # vLLM derives max_model_len from the model, then auto-fits
        if model is None or not model.max_position_embeddings:
            raise ScenarioError(
                source, "runtime.max_model_len",
                "-1 (auto-fit) needs [model] max_position_embeddings (the length vLLM derives)",
            )  # fmt: skip
        runtime = dataclasses.replace(runtime, max_model_len=model.max_position_embeddings)
    _check_model_runtime(runtime, model, source)
    expect = dict(r.table("expect", required=False).data)
    external = expect.pop("external", {})
    if not isinstance(external, Mapping):
        raise ScenarioError(source, "expect.external", "expected a table")
    for key in external:
        if key != "source" and key not in KVPlan.field_names():
            raise ScenarioError(
                source, f"expect.external.{key}", "unknown key; expected a KVPlan field name or source"
            )
    before = _read_expect_before(expect.pop("before", {}), expect, source)
    if REJECTS in expect:
        _check_rejects(expect, "expect", source)
    for key in expect:
        if key not in (*KVPlan.field_names(), REJECTS):
            raise ScenarioError(source, f"expect.{key}", "unknown key; expected a KVPlan field name")
    return Scenario(
        name=name, runtime=runtime, model=model, layer_specs=specs,
        expect=expect, expect_external=dict(external), source=source, expect_before=before,
    )  # fmt: skip


#: The ``[expect]`` (or ``[expect.before.<change>]``) key that says the plan is rejected, and of
#: which kind (``rejections.KINDS``): by every release (or by the releases lacking the change).
REJECTS = "rejects"


def _check_rejects(values: Mapping[str, Any], where: str, source: str) -> None:
    """``rejects`` stands alone in its table and names a kind of refusal."""
    from .rejections import KINDS

    if len(values) > 1:
        raise ScenarioError(source, f"{where}.{REJECTS}", "expected alone: a rejected plan has no fields")
    if values[REJECTS] not in KINDS:
        raise ScenarioError(
            source, f"{where}.{REJECTS}",
            f"expected a kind of refusal, one of {', '.join(KINDS)}; got {values[REJECTS]!r}",
        )  # fmt: skip


def _read_expect_before(before: Any, expect: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """``[expect.before.<change>]`` tables: ``<change>`` a name of ``reference.releases.CHANGES``,
    each key a KVPlan field that ``[expect]`` also states (the value under the newest rules;
    any field when ``[expect]`` is ``rejects`` alone: the plan of the releases before a refusal),
    or ``rejects`` alone: the kind of refusal those releases reject the plan with
    (``pytest_kvconform.rejections.KINDS``)."""
    from .reference.releases import CHANGES  # stdlib only; imported late (reference imports us)

    if not isinstance(before, Mapping):
        raise ScenarioError(source, "expect.before", "expected a table of [expect.before.<change>] tables")
    names = [c.name for c in CHANGES]
    out: dict[str, dict[str, Any]] = {}
    for change, values in before.items():
        where = f"expect.before.{change}"
        if change not in names:
            raise ScenarioError(source, where, "unknown change; expected one of " + ", ".join(names))
        if not isinstance(values, Mapping) or not values:
            raise ScenarioError(source, where, "expected a non-empty table of KVPlan fields")
        if REJECTS in values:
            _check_rejects(values, where, source)
            out[change] = dict(values)
            continue
        for key in values:
            if key not in KVPlan.field_names():
                raise ScenarioError(source, f"{where}.{key}", "unknown key; expected a KVPlan field name")
            if key not in expect and REJECTS not in expect:
                raise ScenarioError(
                    source, f"{where}.{key}", "not in [expect]; state its value under the newest rules there"
                )
        out[change] = dict(values)
    return out


_REQUIRED = object()


class _Reader:
    """Typed access to one TOML table; every error names ``source`` and the dotted key."""

    def __init__(self, data: Any, source: str, prefix: str) -> None:
        if not isinstance(data, Mapping):
            raise ScenarioError(source, prefix or "<root>", "expected a table")
        self.data, self.source, self.prefix = data, source, prefix

    def key(self, k: str) -> str:
        return f"{self.prefix}.{k}" if self.prefix else k

    def fail(self, k: str, problem: str) -> ScenarioError:
        return ScenarioError(self.source, self.key(k), problem)

    def _get(self, k: str, kind: type, what: str, default: Any) -> Any:
        """The value at ``k`` if it has type ``kind``; ``default`` when absent (unless required)."""
        if k not in self.data:
            if default is _REQUIRED:
                raise self.fail(k, f"missing; expected {what}")
            return default
        v = self.data[k]
        if (isinstance(v, bool) and kind is not bool) or not isinstance(v, kind):
            raise self.fail(k, f"expected {what}, got {type(v).__name__} {v!r}")
        return v

    def str(self, k: str, default: Any = _REQUIRED, choices: tuple[str, ...] = ()) -> Any:
        v = self._get(k, str, "a string", default)
        if choices and k in self.data and v not in choices:
            raise self.fail(k, f"expected one of {', '.join(choices)}; got {v!r}")
        return v

    def int(self, k: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        """An integer >= ``minimum``; ``default=None`` makes the key optional."""
        v = self._get(k, int, "an integer", default)
        if k in self.data and v < minimum:
            raise self.fail(k, f"expected an integer >= {minimum}, got {v}")
        return v

    def bool(self, k: str, default: bool) -> bool:
        return self._get(k, bool, "true or false", default)

    def table(self, k: str, required: bool = True) -> _Reader:
        if k not in self.data:
            if required:
                raise self.fail(k, "missing; expected a table")
            return _Reader({}, self.source, self.key(k))
        return _Reader(self.data[k], self.source, self.key(k))

    def done(self, allowed: set[str]) -> None:
        for k in self.data:
            if k not in allowed:
                raise self.fail(k, "unknown key; expected one of " + ", ".join(sorted(allowed)))


def _read_model(r: _Reader, source: str) -> ModelGeometry:
    r.done(
        allowed={"hf_id", "architecture", "dtype", "num_hidden_layers", "layers", "sources",
                 "confidence", "notes", "attention", "state", "num_nextn_predict_layers",
                 "max_position_embeddings"}
    )  # fmt: skip
    n = r.int("num_hidden_layers")
    layers = r.str("layers")
    if len(layers) != n:
        raise r.fail("layers", f"expected {n} characters (num_hidden_layers), got {len(layers)}")
    bad = sorted(set(layers) - set(LAYER_CODES))
    if bad:
        raise r.fail("layers", f"unknown layer code(s) {''.join(bad)!r}; expected {''.join(LAYER_CODES)}")
    sources = r.data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise r.fail("sources", "expected a list of strings")
    needs_attention = any(c in "ASLXP" for c in layers)
    needs_state = any(c in "MP" for c in layers)
    # an encoder-only model (every layer "-") may state the geometry of its attention, which holds
    # no KV cache (vLLM's EncoderOnlyAttention.get_kv_cache_spec is None): a config writer needs it
    encoder_only = set(layers) == {"-"}
    if needs_attention != ("attention" in r.data) and not encoder_only:
        raise r.fail(
            "attention",
            "expected [model.attention] exactly when layers has A/S/L/X/P "
            "(or, optionally, when every layer is -)",
        )
    if needs_state != ("state" in r.data):
        raise r.fail("state", "expected [model.state] exactly when layers has M/P")
    attention = _read_attention(r.table("attention"), layers) if "attention" in r.data else None
    if attention is not None and attention.is_heterogeneous and needs_state:
        raise r.fail("attention", "global_head_dim / num_global_kv_heads: not modelled with state layers")
    state = _read_state(r.table("state")) if needs_state else None
    return ModelGeometry(
        architecture=r.str("architecture"),
        dtype=r.str("dtype", choices=MODEL_DTYPES),
        num_hidden_layers=n,
        layers=layers,
        attention=attention,
        state=state,
        num_nextn_predict_layers=r.int("num_nextn_predict_layers", default=0, minimum=0),
        max_position_embeddings=r.int("max_position_embeddings", default=0),
        hf_id=r.str("hf_id", default=""),
        sources=tuple(sources),
        confidence=r.str("confidence", default=""),
        notes=r.str("notes", default=""),
    )


#: ``[model.attention]`` keys of the full-attention layers' own geometry (Gemma 4).
_GLOBAL_KEYS = ("global_head_dim", "num_global_kv_heads")


def _read_attention(r: _Reader, layers: str) -> AttentionGeometry:
    kind = r.str("kind", choices=ATTENTION_KINDS)
    common = {"kind", "sliding_window", "attention_chunk_size", "num_attention_heads", "sinks"}
    if kind == "gqa":
        r.done(allowed=common | {"num_kv_heads", "head_dim", "head_dim_v", *_GLOBAL_KEYS})
        geo = AttentionGeometry(
            kind=kind, num_kv_heads=r.int("num_kv_heads"), head_dim=r.int("head_dim"),
            head_dim_v=r.int("head_dim_v", default=None),
            global_head_dim=r.int("global_head_dim", default=None),
            num_global_kv_heads=r.int("num_global_kv_heads", default=None),
        )  # fmt: skip
        if geo.is_heterogeneous and geo.head_dim_v is not None:
            raise r.fail("head_dim_v", "not modelled together with global_head_dim / num_global_kv_heads")
    else:
        r.done(allowed=common | {"kv_lora_rank", "qk_rope_head_dim", "indexer_head_dim", "indexer_layers"})
        indexer_layers = r.str("indexer_layers", default="") or None
        if indexer_layers is not None and (
            len(indexer_layers) != len(layers) or set(indexer_layers) - {"I", "-"}
        ):
            raise r.fail("indexer_layers", f"expected {len(layers)} characters of 'I' or '-'")
        geo = AttentionGeometry(
            kind=kind, num_kv_heads=1, kv_lora_rank=r.int("kv_lora_rank"),
            qk_rope_head_dim=r.int("qk_rope_head_dim"),
            indexer_head_dim=r.int("indexer_head_dim", default=0, minimum=0),
            indexer_layers=indexer_layers,
        )  # fmt: skip
    window, chunk = r.int("sliding_window", default=None), r.int("attention_chunk_size", default=None)
    if "S" in layers and window is None:
        raise r.fail("sliding_window", "missing; expected an integer >= 1 (layers has 'S')")
    if "L" in layers and chunk is None:
        raise r.fail("attention_chunk_size", "missing; expected an integer >= 1 (layers has 'L')")
    return dataclasses.replace(
        geo, sliding_window=window, attention_chunk_size=chunk,
        num_attention_heads=r.int("num_attention_heads", default=0, minimum=0), sinks=r.bool("sinks", False),
    )  # fmt: skip


_STATE_FIELDS = {
    "mamba1": ("intermediate_size", "d_state"),
    "mamba2": ("intermediate_size", "n_groups", "n_heads", "head_dim", "d_state"),
    "gdn": ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"),
    "kda": ("num_heads", "head_dim"),
    "short_conv": ("conv_dim",),
}


def _read_state(r: _Reader) -> StateGeometry:
    kind = r.str("kind", choices=STATE_KINDS)
    fields = _STATE_FIELDS[kind]
    chunked = kind in ("mamba1", "mamba2")
    r.done(allowed={"kind", "conv_kernel", "ssm_dtype", *fields, *(("chunk_size",) if chunked else ())})
    return StateGeometry(
        kind=kind,
        conv_kernel=r.int("conv_kernel"),
        ssm_dtype=r.str("ssm_dtype", default="auto", choices=MAMBA_DTYPES),
        **{f: r.int(f) for f in fields},
        **({"chunk_size": r.int("chunk_size", default=0)} if chunked else {}),
    )


def _read_runtime(r: _Reader, source: str) -> RuntimeSettings:
    ints = ("max_model_len", "tensor_parallel_size", "pipeline_parallel_size", "block_size",
            "kernel_block_alignment", "extra_block_alignment", "kv_cache_memory_bytes",
            "max_num_batched_tokens", "max_concurrent_batches", "decode_context_parallel_size")  # fmt: skip
    strs = _RUNTIME_CHOICES
    r.done(allowed={*ints, *strs, "num_speculative_tokens", "num_gpu_blocks_override",
                    "user_specified_block_size", "registered_kv_cache_dtypes", "max_num_seqs",
                    "additional_config", "env", "kv_cache_dtype_skip_layers",
                    "disable_hybrid_kv_cache_manager"})  # fmt: skip
    registered = r.table("registered_kv_cache_dtypes", required=False)
    env = r.table("env", required=False)
    defaults = RuntimeSettings()
    # max_model_len = -1 / "auto": auto-fit from the derived length (set by scenario_from_dict)
    auto_fit = r.data.get("max_model_len") in (-1, "auto")  # (True and False are 1 and 0)
    values: dict[str, Any] = {
        k: r.int(k, default=getattr(defaults, k)) for k in ints if not (auto_fit and k == "max_model_len")
    }
    values["max_model_len"] = values.get("max_model_len", defaults.max_model_len)
    values["auto_fit_max_model_len"] = auto_fit
    values["registered_kv_cache_dtypes"] = tuple(
        (name, registered.str(name, choices=tuple(SPEC_DTYPES))) for name in sorted(registered.data)
    )
    choices = {**strs, "kv_cache_dtype": kv_cache_dtype_choices(values["registered_kv_cache_dtypes"])}
    values.update({k: r.str(k, default=getattr(defaults, k), choices=c) for k, c in choices.items()})
    values["num_speculative_tokens"] = r.int("num_speculative_tokens", default=0, minimum=0)
    values["num_gpu_blocks_override"] = r.int("num_gpu_blocks_override", default=None)
    values["max_num_seqs"] = r.int("max_num_seqs", default=None)
    values["additional_config"] = json.dumps(dict(r.table("additional_config", required=False).data),
                                             sort_keys=True)  # fmt: skip
    values["env"] = tuple((name, env.str(name)) for name in sorted(env.data))
    skip = r.data.get("kv_cache_dtype_skip_layers", [])
    if not isinstance(skip, list) or not all(isinstance(x, str) for x in skip):
        raise r.fail(
            "kv_cache_dtype_skip_layers", f'expected a list of strings (e.g. ["0", "31"]), got {skip!r}'
        )
    values["kv_cache_dtype_skip_layers"] = tuple(skip)
    values["disable_hybrid_kv_cache_manager"] = r.bool("disable_hybrid_kv_cache_manager", False)
    values["unset"] = tuple(k for k in DEFAULTED if k not in r.data)
    # Writing block_size is passing --block-size, unless the file says otherwise.
    values["user_specified_block_size"] = r.bool("user_specified_block_size", "block_size" in r.data)
    if not values["user_specified_block_size"] and values["block_size"] != defaults.block_size:
        raise r.fail(
            "block_size", f"{values['block_size']} needs user_specified_block_size = true (without a "
            f"--block-size vLLM starts from {defaults.block_size} and Phase 1 picks the backend's block)",
        )  # fmt: skip
    runtime = RuntimeSettings(**values)
    _check_runtime(runtime, source)
    return runtime


def _check_model_runtime(rt: RuntimeSettings, model: ModelGeometry | None, source: str) -> None:
    """Settings that read the model: pipeline stages take its layers by their index (a spec-level
    scenario has none); ``mamba_cache_mode = "all"`` aligns the block to its Mamba chunk."""
    if rt.pipeline_parallel_size > 1 and model is None:
        raise ScenarioError(
            source, "runtime.pipeline_parallel_size",
            "above 1 needs a [model]: pipeline stages take the model's layers by their index",
        )  # fmt: skip
    state = model.state if model is not None else None
    chunked = state is not None and state.kind in ("mamba1", "mamba2")
    if rt.mamba_cache_mode == "all" and chunked and not state.chunk_size:  # type: ignore[union-attr]
        raise ScenarioError(
            source, "model.state.chunk_size",
            "needed by mamba_cache_mode = 'all' (the config's mamba_chunk_size or chunk_size)",
        )  # fmt: skip


def _check_runtime(rt: RuntimeSettings, source: str) -> None:
    """Validate settings, including ones changed after loading (``--set``)."""
    choices_of = {**_RUNTIME_CHOICES, "kv_cache_dtype": kv_cache_dtype_choices(rt.registered_kv_cache_dtypes)}
    for f in dataclasses.fields(rt):
        v = getattr(rt, f.name)
        if f.name in choices_of:
            if v not in choices_of[f.name]:
                choices = ", ".join(choices_of[f.name])
                raise ScenarioError(source, f"runtime.{f.name}", f"expected one of {choices}; got {v!r}")
        elif f.name == "registered_kv_cache_dtypes":
            continue  # validated when read
        elif f.name == "unset":
            if not (isinstance(v, tuple) and set(v) <= set(DEFAULTED) and list(v) == sorted(set(v))):
                raise ScenarioError(
                    source, "runtime.unset", f"expected sorted names from {', '.join(DEFAULTED)}, got {v!r}"
                )
        elif f.name == "env":
            if not (isinstance(v, tuple) and all(isinstance(k, str) and isinstance(x, str) for k, x in v)):
                raise ScenarioError(
                    source, "runtime.env", f"expected a [runtime.env] table of strings, got {v!r}"
                )
        elif f.name == "additional_config":
            _check_additional_config(v, source)
        elif f.name == "kv_cache_dtype_skip_layers":
            if not (isinstance(v, tuple) and all(isinstance(x, str) and (x.isdigit() or x == "sliding_window")
                                                 for x in v)):  # fmt: skip
                got = list(v) if isinstance(v, tuple) else v
                raise ScenarioError(
                    source, "runtime.kv_cache_dtype_skip_layers",
                    f'expected layer indices ("0") or "sliding_window", got {got}',
                )  # fmt: skip
        elif f.name in (
            "user_specified_block_size",
            "auto_fit_max_model_len",
            "disable_hybrid_kv_cache_manager",
        ):
            if not isinstance(v, bool):
                raise ScenarioError(source, f"runtime.{f.name}", f"expected true or false, got {v!r}")
        elif v is not None or f.name not in ("num_gpu_blocks_override", "max_num_seqs"):
            minimum = 0 if f.name == "num_speculative_tokens" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ScenarioError(
                    source, f"runtime.{f.name}", f"expected an integer >= {minimum}, got {v!r}"
                )


def _check_additional_config(text: Any, source: str) -> None:
    """``additional_config`` must be the JSON text of a table (``--set additional_config='{...}'``)."""
    try:
        table = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        table = None
    if not isinstance(table, dict):
        raise ScenarioError(
            source, "runtime.additional_config", f"expected a JSON object (table), got {text!r}"
        )


_RUNTIME_CHOICES = {
    "kv_cache_dtype": KV_CACHE_DTYPES, "mamba_cache_dtype": MAMBA_DTYPES,
    "mamba_ssm_cache_dtype": MAMBA_DTYPES, "mamba_cache_mode": MAMBA_CACHE_MODES,
    "unify_policy": UNIFY_POLICIES, "speculative_method": SPECULATIVE_METHODS,
}  # fmt: skip


def kv_cache_dtype_choices(registered: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """vLLM's ``CacheDType`` values plus the ones a platform registered (``register_kv_cache_dtype``)."""
    return (*KV_CACHE_DTYPES, *(name for name, _ in registered if name not in KV_CACHE_DTYPES))


_ATTENTION_SPEC_KEYS = {"kind", "count", "block_size", "num_kv_heads", "head_size", "head_size_v", "dtype",
                        "state_content_bytes", "sliding_window", "attention_chunk_size"}  # fmt: skip


def _positive_ints(shape: Any) -> bool:
    return (
        isinstance(shape, list)
        and bool(shape)
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
    )


def _read_layer_specs(items: Any, source: str) -> tuple[LayerSpecEntry, ...]:
    if not isinstance(items, list) or not items:
        raise ScenarioError(source, "layer_specs", "expected a non-empty array of tables")
    out = []
    for i, item in enumerate(items):
        r = _Reader(item, source, f"layer_specs[{i}]")
        kind = r.str("kind", choices=SPEC_KINDS)
        count = r.int("count", default=1)
        block_size = r.int("block_size", default=16)
        if kind == "mamba":
            r.done(allowed={"kind", "count", "block_size", "shapes", "dtypes", "num_speculative_blocks"})
            shapes, dtypes = r.data.get("shapes"), r.data.get("dtypes")
            if not (isinstance(shapes, list) and shapes and all(_positive_ints(s) for s in shapes)):
                raise r.fail("shapes", "expected a non-empty list of lists of positive integers")
            if not (
                isinstance(dtypes, list)
                and len(dtypes) == len(shapes)
                and all(d in SPEC_DTYPES for d in dtypes)
            ):
                raise r.fail("dtypes", f"expected {len(shapes)} dtype names from {', '.join(SPEC_DTYPES)}")
            out.append(LayerSpecEntry(
                kind=kind, count=count, block_size=block_size,
                shapes=tuple(tuple(s) for s in shapes), dtypes=tuple(dtypes),
                num_speculative_blocks=r.int("num_speculative_blocks", default=0, minimum=0),
            ))  # fmt: skip
            continue
        r.done(allowed=_ATTENTION_SPEC_KEYS)
        entry = LayerSpecEntry(
            kind=kind, count=count, block_size=block_size,
            num_kv_heads=r.int("num_kv_heads", default=1), head_size=r.int("head_size"),
            head_size_v=r.int("head_size_v", default=None, minimum=0),
            dtype=r.str("dtype", default="bfloat16", choices=tuple(SPEC_DTYPES)),
            state_content_bytes=r.int("state_content_bytes", default=None),
            sliding_window=r.int("sliding_window", default=None),
            attention_chunk_size=r.int("attention_chunk_size", default=None),
        )  # fmt: skip
        if kind == "sliding_window" and entry.sliding_window is None:
            raise r.fail("sliding_window", "missing; expected an integer >= 1 for kind sliding_window")
        if kind == "chunked_local" and entry.attention_chunk_size is None:
            raise r.fail("attention_chunk_size", "missing; expected an integer >= 1 for kind chunked_local")
        out.append(entry)
    return tuple(out)
