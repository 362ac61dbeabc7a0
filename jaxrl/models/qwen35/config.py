"""Qwen3.5 text-tower configuration, read from either Hugging Face layout.

Two layouts exist (docs/design/qwen35-architecture.md §1, §4):
  * "container": `Qwen3_5ForConditionalGeneration`, the official checkpoints. `config.json` has `text_config`
    and `vision_config`; language-tower tensors are under `model.language_model.`.
  * "text": `Qwen3_5ForCausalLM`. `config.json` is the text config itself; tensors under `model.`.

Only the text tower is modelled in JAX. Everything else in a checkpoint folder is carried through unchanged by
`checkpoint.save_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from jaxrl.ops.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from jaxrl.models.settings import model_default

LINEAR = "linear_attention"
FULL = "full_attention"

# Fields of Qwen3_5TextConfig that change the computation. Anything else in config.json is accepted and ignored
# here (real checkpoints carry extra keys such as `attn_output_gate` or `mtp_num_hidden_layers`), because
# save_pretrained copies config.json verbatim rather than regenerating it.
_ACCEPTED_ACTIVATIONS = ("silu",)
_ACCEPTED_ROPE_TYPES = ("default",)
GDN_STATE_DTYPES = ("float32", "bfloat16")
# The computation settings among the fields: they may differ between two models that load the same weights. Each
# is also a run-config key of the same name, whose default (jaxrl/models/settings.py) is the field's default.
COMPUTE_FIELDS = ("gdn_chunk_size", "gdn_state_dtype", "attention_implementation", "scan_layers")


class ConfigError(ValueError):
    """A config.json that cannot describe a Qwen3.5 model; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    attention_bias: bool = False
    max_position_embeddings: int = 262144
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | tuple[int, ...]] = None
    # Computation settings (not part of the HF architecture; `Qwen35.set_compute` changes them on a built model).
    # Chunk length of the chunked gated delta rule (the reference uses 64).
    gdn_chunk_size: int = model_default("gdn_chunk_size")
    # Storage dtype of the Gated DeltaNet recurrent state in decode caches: "float32" (the reference, HF's
    # `mamba_ssm_dtype`) or "bfloat16" (half the bytes a decode step moves; the update's math stays fp32).
    gdn_state_dtype: str = model_default("gdn_state_dtype")
    # Full-attention kernel of training and prefill (jaxrl.ops.attention.resolve_implementation).
    attention_implementation: str = model_default("attention_implementation")
    # Training forward: scan the repeating block of layers instead of unrolling them (Qwen35.hidden_states).
    # None: when the pass rematerialises its layers (`scan_decision`); True / False: always / never.
    scan_layers: Optional[bool] = model_default("scan_layers")

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers, 4))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ----- derived sizes -----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_chunk(self) -> int:
        """Tokens per chunk of the chunked Gated DeltaNet: `gdn_chunk_size`, or for 0 (auto) the key head dim
        within [16, 64]. A chunk costs C^2 per head in its intra-chunk products and d_k x d_v in its state
        products, so C near d_k balances the two: on two CPU cores a d_k = 16 model trains fastest with C = 16
        (at 64 the C x C intermediates outgrow the activations; measured in benchmarks/RESULTS.md, section
        'Where the tiny model's time goes on CPU'), the d_k = 64 benchmark model at 64, and 64 is what
        flash-linear-attention's GPU kernels use for the 4B / 9B (d_k = 128)."""
        if self.gdn_chunk_size:
            return self.gdn_chunk_size
        return min(64, max(16, self.linear_key_head_dim))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def validate(self, source: str = "config") -> None:
        def bad(key, msg):
            raise ConfigError(f"{source}: `{key}` {msg}")

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                bad(key, f"must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                                       f"({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple of "
                                          f"linear_num_key_heads ({self.linear_num_key_heads})")
        if len(self.layer_types) != self.num_hidden_layers:
            bad("layer_types", f"has {len(self.layer_types)} entries but num_hidden_layers is "
                               f"{self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in (LINEAR, FULL):
                bad(f"layer_types[{i}]", f"is {t!r}; expected {LINEAR!r} or {FULL!r}")
        rot = self.rotary_dim
        if rot <= 0 or rot % 2 or rot > self.head_dim:
            bad("partial_rotary_factor", f"gives {rot} rotary dims for head_dim {self.head_dim}; "
                                         "need an even number in (0, head_dim]")
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            bad("gdn_state_dtype", f"is {self.gdn_state_dtype!r}; choose one of {GDN_STATE_DTYPES}")
        if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
            bad("attention_implementation", f"is {self.attention_implementation!r}; choose one of "
                                            f"{ATTENTION_IMPLEMENTATIONS}")
        if not isinstance(self.gdn_chunk_size, int) or self.gdn_chunk_size < 0:
            bad("gdn_chunk_size", f"must be a positive integer or 0 (auto), got {self.gdn_chunk_size!r}")
        if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
            bad("scan_layers", f"must be true, false or None (scan when the training pass rematerialises its "
                               f"layers), got {self.scan_layers!r}")
        if not (self.rms_norm_eps > 0):
            bad("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")

    def scan_decision(self, remat_policy: Optional[str] = None) -> tuple[Optional[int], str]:
        """(cycle, "") when a training forward under `remat_policy` (resolved: "auto" already chosen; None: not
        known yet, any policy that recomputes) scans its layers in blocks of `cycle` layers, else (None, why they
        run unrolled), from the config alone (`Qwen35.layer_cycle` adds what only the built layers tell: LoRA on
        some layers only). Scanning needs a layer pattern that is a whole number (at least 2) of repeats of a
        block, and `scan_layers` True, or None with a policy other than "none".

        Why the policy decides the default: the scan is where remat takes effect. Unrolled, XLA:CPU's program
        holds about as much with remat as without; scanned, what each layer saves is the loop's per-iteration
        output, so the program holds what the policy says, and compiles one block. Without remat the scan has
        nothing to gain and still costs step time and memory: it stacks every layer's activations for the
        backward and copies the layer weights into the stack (benchmarks/RESULTS.md, 'CPU: when scanning pays
        (issue 37)')."""
        if self.scan_layers is False:
            return None, "scan_layers is off"
        types = self.layer_types
        cycle = repeat_cycle(types)
        if cycle is None:
            return None, f"the pattern of the {len(types)} layers does not repeat"
        if self.scan_layers is None and remat_policy == "none":
            return None, ("the pass keeps every activation (remat policy none), where scanning only costs "
                          "(scan_layers=True scans anyway)")
        return cycle, ""

    # ----- serialisation of the *jaxrl* view (HF config.json is never regenerated from this) -----
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen35Config":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(f"unknown Qwen35Config keys {unknown}; valid keys: {sorted(fields)}")
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        return cls(**d)


def repeat_cycle(layer_types) -> Optional[int]:
    """The shortest block the layer pattern is a whole number (at least 2) of repeats of, else None."""
    n = len(layer_types)
    for cycle in range(1, n // 2 + 1):
        if n % cycle == 0 and all(layer_types[i] == layer_types[i % cycle] for i in range(n)):
            return cycle
    return None


def default_layer_types(num_layers: int, full_attention_interval: int) -> tuple[str, ...]:
    """HF rule when `layer_types` is absent: layer i is full attention iff (i + 1) % interval == 0."""
    return tuple(FULL if (i + 1) % full_attention_interval == 0 else LINEAR for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """Where the language tower lives in a checkpoint, and how config.json is shaped."""

    kind: str  # "container" | "text"
    tower_prefix: str  # "model.language_model." | "model."
    architectures: tuple[str, ...]


CONTAINER = HFLayout("container", "model.language_model.", ("Qwen3_5ForConditionalGeneration",))
TEXT_ONLY = HFLayout("text", "model.", ("Qwen3_5ForCausalLM",))


def _text_config_from_hf(text: dict[str, Any], source: str, tie: bool) -> Qwen35Config:
    def get(key, default=None, required=False):
        if key not in text or text[key] is None:
            if required:
                raise ConfigError(f"{source}: missing required key `{key}`")
            return default
        return text[key]

    act = get("hidden_act", "silu")
    if act not in _ACCEPTED_ACTIVATIONS:
        raise ConfigError(f"{source}: `hidden_act` is {act!r}; Qwen3.5 uses one of {_ACCEPTED_ACTIVATIONS}")

    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ACCEPTED_ROPE_TYPES:
        raise ConfigError(f"{source}: `rope_parameters.rope_type` is {rope_type!r}; supported: "
                          f"{_ACCEPTED_ROPE_TYPES}")
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))

    num_layers = int(get("num_hidden_layers", required=True))
    layer_types = get("layer_types")
    if layer_types is None:
        layer_types = default_layer_types(num_layers, int(get("full_attention_interval", 4)))

    hidden = int(get("hidden_size", required=True))
    heads = int(get("num_attention_heads", required=True))
    eos = get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    if get("mlp_only_layers"):
        raise ConfigError(f"{source}: `mlp_only_layers` is {get('mlp_only_layers')}; layers without a token "
                          "mixer are not supported")
    for moe_key in ("num_experts", "moe_intermediate_size"):
        if get(moe_key):
            raise ConfigError(f"{source}: `{moe_key}` is set: this is a Qwen3.5-MoE config; jaxrl supports the "
                              "dense Qwen3.5 models")
    try:
        return _build(get, source, tie, hidden, heads, num_layers, layer_types, theta, partial, eos)
    except ConfigError as e:  # validation errors inside the dataclass: name the file
        raise ConfigError(str(e).replace("config:", f"{source}:", 1)) from None


def _build(get, source, tie, hidden, heads, num_layers, layer_types, theta, partial, eos) -> "Qwen35Config":
    cfg = Qwen35Config(
        vocab_size=int(get("vocab_size", required=True)),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size", required=True)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads", heads)),
        head_dim=int(get("head_dim", hidden // heads)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tie),
        rope_theta=float(theta),
        partial_rotary_factor=float(partial),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(get("linear_num_value_heads", 32)),
        layer_types=tuple(layer_types),
        attention_bias=bool(get("attention_bias", False)),
        max_position_embeddings=int(get("max_position_embeddings", 262144)),
        pad_token_id=get("pad_token_id"),
        bos_token_id=get("bos_token_id"),
        eos_token_id=eos,
    )
    return cfg


def parse_hf_config(raw: dict[str, Any], source: str = "config.json") -> tuple[Qwen35Config, HFLayout]:
    """Turn an HF config.json dict into our config and the checkpoint layout.

    Raises ConfigError naming `source` and the offending key for anything we cannot model faithfully, notably
    tying flags that disagree between the container and its text config (§4.3: the container would save no
    lm_head while the text model expects one, which silently yields a random head).
    """
    model_type = raw.get("model_type")
    if "text_config" in raw:
        if model_type not in (None, "qwen3_5"):
            raise ConfigError(f"{source}: `model_type` is {model_type!r}; expected 'qwen3_5' for a container")
        text = dict(raw["text_config"] or {})
        top_tie = raw.get("tie_word_embeddings", False)
        text_tie = text.get("tie_word_embeddings", top_tie)
        if bool(top_tie) != bool(text_tie):
            raise ConfigError(
                f"{source}: `tie_word_embeddings` ({top_tie}) and `text_config.tie_word_embeddings` ({text_tie}) "
                "disagree. HF decides tying from the top-level flag, vLLM and Qwen3_5ForCausalLM from the text "
                "flag, so one of them would run with a random lm_head. Set both to the same value.")
        # Token ids sometimes live only at the top level of the container.
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if text.get(key) is None and raw.get(key) is not None:
                text[key] = raw[key]
        return _text_config_from_hf(text, f"{source}: text_config", bool(top_tie)), CONTAINER
    if model_type not in (None, "qwen3_5_text", "qwen3_5"):
        raise ConfigError(f"{source}: `model_type` is {model_type!r}; expected 'qwen3_5_text' (text-only) or a "
                          "'qwen3_5' container with `text_config`")
    if model_type == "qwen3_5":
        raise ConfigError(f"{source}: `model_type` is 'qwen3_5' but there is no `text_config`")
    return _text_config_from_hf(raw, source, bool(raw.get("tie_word_embeddings", False))), TEXT_ONLY


# What a quantized checkpoint is, by its `quantization_config.quant_method`; jaxrl trains LoRA on dense weights.
QUANTIZED_ADVICE = ("jaxrl loads dense bf16 / fp32 weights only: point it at the unquantized checkpoint (e.g. the "
                    "bf16 Qwen/Qwen3.5-4B or Qwen/Qwen3.5-9B folder); serve a quantized copy with vLLM instead")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from e


def check_not_quantized(raw: dict[str, Any], source: str) -> None:
    """ConfigError naming the quantization when config.json (or its text_config) declares one."""
    for where, block in (("", raw), ("text_config.", raw.get("text_config") or {})):
        quant = block.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
            fmt = quant.get("fmt") or quant.get("format") if isinstance(quant, dict) else None
            detail = f"{method}" + (f", {fmt}" if fmt else "")
            raise ConfigError(f"{source}: a quantized checkpoint ({where}quantization_config: {detail}); "
                              f"{QUANTIZED_ADVICE}")


def generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    """The stop ids of the folder's generation_config.json (Qwen3.5: <|im_end|> and <|endoftext|>); () without
    one."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    eos = _read_json(path).get("eos_token_id")
    if eos is None:
        return ()
    try:
        return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: eos_token_id={eos!r}; expected an id or a list of ids") from None


def with_stop_ids(cfg: Qwen35Config, extra: tuple[int, ...]) -> Qwen35Config:
    """`cfg` whose eos_token_id also holds `extra` (config.json's own ids first, no repeats)."""
    own = cfg.eos_token_id
    ids = [] if own is None else ([own] if isinstance(own, int) else list(own))
    merged = tuple(dict.fromkeys(ids + list(extra)))
    if not merged or tuple(ids) == merged:
        return cfg
    return dataclasses.replace(cfg, eos_token_id=merged[0] if len(merged) == 1 else merged)


def load_hf_config(model_dir: str) -> tuple[Qwen35Config, HFLayout, dict[str, Any]]:
    """(config, layout, raw config.json) of an HF folder. Stop ids: config.json's eos_token_id and every id of
    generation_config.json (what `generate` and `transformers` stop on). A quantized folder is refused."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_dir}: no config.json (is this an HF model folder?)")
    raw = _read_json(path)
    check_not_quantized(raw, path)
    cfg, layout = parse_hf_config(raw, path)
    return with_stop_ids(cfg, generation_eos_ids(model_dir)), layout, raw


# ---------------------------------------------------------------------------------------------------------------
# Presets for the real shapes (§1.2) and the tiny shape used by tests and the demo.

# Qwen3.5's token ids (docs/design/qwen35-architecture.md §8): config.json's text_config has eos <|endoftext|>
# and no pad id; generation_config.json stops on <|im_end|> and <|endoftext|>, so a loaded real folder's
# eos_token_id is both (load_hf_config), and the presets carry the same.
ENDOFTEXT, IM_END = 248044, 248046


def qwen35_9b() -> Qwen35Config:
    return Qwen35Config(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=256, tie_word_embeddings=False,
                        rope_theta=1e7, partial_rotary_factor=0.25, linear_num_key_heads=16,
                        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                        eos_token_id=(ENDOFTEXT, IM_END), pad_token_id=None)


def qwen35_4b() -> Qwen35Config:
    return dataclasses.replace(qwen35_9b(), hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True)


def tiny(**overrides) -> Qwen35Config:
    """The tiny shape of docs/design/qwen35-architecture.md §5 (4 layers: linear, full, linear, full)."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                layer_types=default_layer_types(4, 2), rms_norm_eps=1e-6, tie_word_embeddings=False,
                max_position_embeddings=4096, rope_theta=1e7, partial_rotary_factor=0.25, pad_token_id=0,
                eos_token_id=1)
    base.update(overrides)
    return Qwen35Config(**base)


PRESETS = {"qwen3.5-9b": qwen35_9b, "qwen3.5-4b": qwen35_4b, "tiny": tiny}
