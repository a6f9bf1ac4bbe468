"""Model shape from a Hugging Face `config.json`: what the roofline, memory and TP rules need,
the parameter counts among them (weights in memory, weights a token passes, weights a step reads)
for dense decoders and for the mixture-of-experts forms modelled (`MOE_FAMILIES`); the context
vLLM gives it by default is read in runners/model_context.py.

Ships configs of a few real shapes under `model_configs/` so a study can run with dummy weights
and no hub (`model: qwen2.5-7b`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from runners.model_context import derived_max_model_len, longrope_default_len

MODEL_CONFIGS_DIR = Path(__file__).parent / "model_configs"
# The checkpoint each bundled shape was copied from (its `config.json` as published; the base
# and instruct checkpoints of one size share the shape, the eos ids name the instruct one). A
# study on a bundled shape measures dummy weights of this shape: it stands for this checkpoint.
BUNDLED_CHECKPOINTS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
}

# The mixture-of-experts forms counted here, by `model_type`: Mixtral (every layer's MLP is
# `num_local_experts` experts of `intermediate_size`, a router, no shared expert), Qwen2-MoE
# and Qwen3-MoE (`num_experts` experts of `moe_intermediate_size`, Qwen2-MoE's shared expert
# of `shared_expert_intermediate_size` with its one-output gate, dense layers where
# `mlp_only_layers` or `decoder_sparse_step` say). Any other config naming experts is refused
# (`UnmodelledMoeError`): DeepSeek-V2/V3's MLA attention alone changes the KV per token.
MOE_FAMILIES: Final = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})
# Keys that name a routed-expert count in the configs Transformers ships.
_EXPERT_COUNT_KEYS: Final = ("num_local_experts", "num_experts", "n_routed_experts",
                             "moe_num_experts", "num_moe_experts")


class UnmodelledMoeError(ValueError):
    """A config.json whose mixture-of-experts form nightshift does not count: its parameters,
    weight bytes and KV per token would be another model's."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int
    dtype: str = "bfloat16"  # checkpoint dtype
    quant_method: str | None = None  # "awq", "gptq", "fp8", ... when the checkpoint is quantized
    tie_word_embeddings: bool = False
    # `architectures[0]` of config.json (`Qwen2ForCausalLM`), else its `model_type`; None where
    # the config names neither. The tuning memory compares it
    # (optimizer/tuning_memory/fingerprint.py).
    architecture: str | None = None
    # tokens; the context vLLM 0.26 derives from config.json (`derived_max_model_len`), its
    # max_model_len when none is given; None: config.json names none of the keys vLLM reads
    # (Transformers then fills one from the model type's defaults, which are not read here)
    derived_max_model_len: int | None = None
    # tokens; vLLM 0.26's max_model_len when none is given for a LongRoPE model (Phi-3's 128k
    # variants): its `original_max_position_embeddings`, not the long context above, which a
    # given max_model_len may still reach (config/model.py:2244-2255); None for any other model
    longrope_default_len: int | None = None
    # False where config.json gives no vocab_size (the 32000 above is a stand-in)
    is_vocab_size_given: bool = True
    # Mixture of experts (`MOE_FAMILIES`); all 0 for a dense model.
    num_experts: int = 0  # routed experts in each MoE layer
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # one routed expert's gated-MLP width
    shared_expert_intermediate_size: int = 0  # the shared expert's width; 0: none
    num_moe_layers: int = 0  # layers whose MLP is the experts; the rest are dense

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0 and self.num_experts > 1

    @property
    def default_max_model_len(self) -> int:
        """vLLM's max_model_len for this model when none is given (tokens): the derived
        context, or a LongRoPE model's original length."""
        return self.longrope_default_len or self.derived_max_model_len or \
            self.max_position_embeddings

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """The input embedding and the LM head (one matrix when tied)."""
        return self.lm_head_params * (1 if self.tie_word_embeddings else 2)

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up and down projections); 0 for a dense model."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @property
    def _layer_params_but_experts(self) -> int:
        """Every layer's attention, norms and MLP, less the routed experts of the MoE layers
        (whose routers and shared experts are counted here: every token passes them)."""
        h, layers = self.hidden_size, self.num_hidden_layers
        attention = 2 * h * (self.num_attention_heads + self.num_key_value_heads) * self.head_dim
        per_layer = attention + 2 * h
        dense_layers = layers - self.num_moe_layers if self.is_moe else layers
        moe_fixed = h * self.num_experts  # router
        if self.shared_expert_intermediate_size:
            moe_fixed += 3 * h * self.shared_expert_intermediate_size + h  # expert and gate
        return (layers * per_layer + dense_layers * 3 * h * self.intermediate_size
                + (self.num_moe_layers * moe_fixed if self.is_moe else 0))

    @property
    def linear_params(self) -> int:
        """Every weight but the embeddings, every expert included: what a step could read."""
        return self._layer_params_but_experts + \
            self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def num_params(self) -> int:
        """All parameters (attention, gated MLP or every expert, norms, embeddings): the
        weights held in memory."""
        return self.linear_params + self.embedding_params

    @property
    def active_linear_params(self) -> int:
        """The weights but the embeddings that one token passes: of each MoE layer, only its
        `num_experts_per_tok` experts."""
        return self._layer_params_but_experts + \
            self.num_moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def num_active_params(self) -> int:
        """Parameters per token, as published (Mixtral-8x7B's 12.9B): the linear weights it
        passes and the embeddings. Its compute is about 2 x (active linear + LM head)."""
        return self.active_linear_params + self.embedding_params

    def experts_read(self, num_tokens: float) -> float:
        """Distinct experts of one MoE layer that a step of `num_tokens` tokens reads: the
        expectation under uniform, independent routing, E x (1 - (1 - k/E)^n), which is k
        for one token, at most min(E, n x k) and nears E as the batch grows. Real routers are
        skewed, which touches fewer experts: the bytes that follow are an upper estimate."""
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        e, k = self.num_experts, min(self.num_experts_per_tok, self.num_experts)
        return float(e * (1.0 - (1.0 - k / e) ** num_tokens))

    def linear_params_read(self, num_tokens: float) -> float:
        """The linear weights (embeddings aside) a step of `num_tokens` tokens streams from
        memory: all of a dense model's; of an MoE layer, only the experts routed to
        (`experts_read`)."""
        return self._layer_params_but_experts + \
            self.num_moe_layers * self.experts_read(num_tokens) * self.expert_params

    def weight_bytes(self, linear_bytes_per_param: float) -> float:
        """The weights in memory: the linear ones at `linear_bytes_per_param` (by dtype or
        quantization), the embeddings in bf16 (vLLM keeps them so when quantizing)."""
        return self.linear_params * linear_bytes_per_param + self.embedding_params * 2.0

    def weight_bytes_read(self, linear_bytes_per_param: float, num_tokens: float) -> float:
        """The weight bytes one step of `num_tokens` tokens reads: the linear weights it
        streams (`linear_params_read`) and the bf16 LM head; the input embedding is a gather of
        a few rows, left out."""
        return (self.linear_params_read(num_tokens) * linear_bytes_per_param
                + self.lm_head_params * 2.0)

    @property
    def ffn_width_per_token(self) -> int:
        """The widest MLP intermediate one token makes in a layer: a dense layer's, or the
        routed experts' together with the shared expert's."""
        dense = self.intermediate_size if not self.is_moe or \
            self.num_moe_layers < self.num_hidden_layers else 0
        moe = self.num_experts_per_tok * self.moe_intermediate_size + \
            self.shared_expert_intermediate_size if self.is_moe else 0
        return max(dense, moe)

    def kv_bytes_per_token(self, kv_dtype_bytes: float = 2.0) -> float:
        """K and V for every layer, one token."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
                * kv_dtype_bytes)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> ModelInfo:
        """Raises ValueError (one line) where `config` is not a decoder's config.json."""
        if not isinstance(config, dict):
            raise ValueError(f"expected a JSON object but got {type(config).__name__}")
        text = config.get("text_config", config)  # multimodal wrappers nest the LM
        if not isinstance(text, dict):
            raise ValueError(f"text_config: expected a JSON object but got "
                             f"{type(text).__name__}")
        heads = _size(text, "num_attention_heads")
        hidden = _size(text, "hidden_size")
        layers = _size(text, "num_hidden_layers")
        intermediate = _size(text, "intermediate_size", 4 * hidden)
        moe = _moe_shape(config, text, layers, intermediate)
        quant = config.get("quantization_config") or {}
        if not isinstance(quant, dict):
            raise ValueError(f"quantization_config: expected a JSON object but got "
                             f"{type(quant).__name__}")
        return cls(
            name=name,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_size(text, "num_key_value_heads", heads),
            intermediate_size=intermediate,
            vocab_size=_size(text, "vocab_size", 32000),
            max_position_embeddings=_size(text, "max_position_embeddings", 4096),
            head_dim=_size(text, "head_dim", max(1, hidden // heads)),
            dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
            quant_method=quant.get("quant_method"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            architecture=_architecture(config),
            derived_max_model_len=derived_max_model_len(config, text),
            longrope_default_len=longrope_default_len(config, text),
            is_vocab_size_given=text.get("vocab_size") is not None,
            num_experts=moe[0],
            num_experts_per_tok=moe[1],
            moe_intermediate_size=moe[2],
            shared_expert_intermediate_size=moe[3],
            num_moe_layers=moe[4],
        )


def _moe_shape(config: dict[str, Any], text: dict[str, Any], layers: int,
               intermediate: int) -> tuple[int, int, int, int, int]:
    """The mixture-of-experts fields of `ModelInfo`, in order (all 0 for a dense model);
    UnmodelledMoeError (one line) where the config names experts in a form not modelled."""
    counts = {k: v for k in _EXPERT_COUNT_KEYS if isinstance(v := text.get(k), int)
              and not isinstance(v, bool) and v > 1}
    ffn = text.get("ffn_config")
    if isinstance(ffn, dict) and isinstance(ffn.get("moe_num_experts"), int) and \
            ffn["moe_num_experts"] > 1:
        counts["ffn_config.moe_num_experts"] = ffn["moe_num_experts"]  # DBRX
    if not counts:
        return 0, 0, 0, 0, 0
    kind = text.get("model_type") or config.get("model_type")
    key, count = next(iter(counts.items()))
    if kind not in MOE_FAMILIES:
        # kept short: the study's message cuts a lower layer's at 300 characters, path included
        raise UnmodelledMoeError(
            f"mixture of experts ({key} {count}) of model_type {kind!r:.30}, a form not "
            f"modelled (only {', '.join(sorted(MOE_FAMILIES))}): its sizes would be another "
            "model's; on a real engine set model.path to its hub id")
    top_k = _size(text, "num_experts_per_tok")
    if kind == "mixtral":
        experts = _size(text, "num_local_experts")
        return experts, top_k, intermediate, 0, layers
    experts = _size(text, "num_experts")
    step = _size(text, "decoder_sparse_step", 1)
    dense_only = text.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise ValueError(f"'mlp_only_layers' must be a list of layer numbers but got "
                         f"{dense_only!r:.40}")
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    shared = text.get("shared_expert_intermediate_size")
    return (experts, top_k, _size(text, "moe_intermediate_size"),
            _size(text, "shared_expert_intermediate_size") if shared else 0, moe_layers)


_MAX_SIZE = 2**40  # far beyond any model's dimension, layer count or vocabulary


def _size(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """`config[key]` as a whole number >= 1 (`default` where absent or null); ValueError
    naming the key otherwise."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if value is None:
        raise ValueError(f"{key!r} is not in it (Transformers fills it from the model type's "
                         "defaults, which nightshift does not read); add the value to a copy "
                         "of config.json and point model.path at that directory")
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_SIZE:
        raise ValueError(f"{key!r} must be a whole number >= 1 but got {value!r:.40}")
    return value


def _architecture(config: dict[str, Any]) -> str | None:
    names = config.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str):
        return names[0]
    kind = config.get("model_type")
    return kind if isinstance(kind, str) and kind else None


def bundled_shapes() -> list[str]:
    return sorted(p.name for p in MODEL_CONFIGS_DIR.iterdir() if (p / "config.json").is_file())


def bundled_shape_of(model: str) -> str | None:
    """The bundled shape `model` names (`qwen2.5-7b`), or None for a local path or a hub id."""
    if (Path(model).expanduser() / "config.json").is_file():
        return None  # a local directory of that name wins, as in `resolve_model_dir`
    name = model.lower()
    return name if (MODEL_CONFIGS_DIR / name / "config.json").is_file() else None


def resolve_model_dir(model: str) -> Path | None:
    """A local directory holding `config.json` for `model`: the path itself, or a bundled shape."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    bundled = MODEL_CONFIGS_DIR / model.lower()
    if (bundled / "config.json").is_file():
        return bundled
    return None


def load_model_info(model: str) -> ModelInfo | None:
    """ModelInfo for a local path or bundled shape; None for a hub id we cannot read offline."""
    directory = resolve_model_dir(model)
    if directory is None:
        return None
    try:
        return ModelInfo.from_config(read_config(directory), name=directory.name)
    except ValueError as exc:
        message = str(exc)
        path = str(directory / "config.json")
        fix = "" if "; " in message else "; give the model's config.json as published"
        raise ValueError(message if message.startswith(path) else f"{path}: {message}{fix}"
                         ) from exc


def read_config(directory: Path) -> Any:
    """`directory/config.json` parsed; ValueError (one line naming the file and the fix) where
    it cannot be read as JSON."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({type(exc).__name__}); check its "
                         "permissions") from exc
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"{path}: not JSON ({type(exc).__name__}); give the model's "
                         "config.json as published") from exc
    return config
