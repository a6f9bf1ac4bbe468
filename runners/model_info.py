"""Model shape from a Hugging Face `config.json`: what the roofline, memory and TP rules need.

Ships configs of a few real shapes under `model_configs/` so a study can run with dummy weights
and no hub (`model: qwen2.5-7b`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def default_max_model_len(self) -> int:
        """vLLM's max_model_len for this model when none is given (tokens): the derived
        context, or a LongRoPE model's original length."""
        return self.longrope_default_len or self.derived_max_model_len or \
            self.max_position_embeddings

    @property
    def num_params(self) -> int:
        """Parameter count of a dense decoder (attention + gated MLP + embeddings)."""
        h, layers = self.hidden_size, self.num_hidden_layers
        q = h * self.num_attention_heads * self.head_dim
        kv = 2 * h * self.num_key_value_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * h
        mlp = 3 * h * self.intermediate_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * (q + kv + o + mlp + 2 * h) + embeddings

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
        quant = config.get("quantization_config") or {}
        if not isinstance(quant, dict):
            raise ValueError(f"quantization_config: expected a JSON object but got "
                             f"{type(quant).__name__}")
        return cls(
            name=name,
            hidden_size=hidden,
            num_hidden_layers=_size(text, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_size(text, "num_key_value_heads", heads),
            intermediate_size=_size(text, "intermediate_size", 4 * hidden),
            vocab_size=_size(text, "vocab_size", 32000),
            max_position_embeddings=_size(text, "max_position_embeddings", 4096),
            head_dim=_size(text, "head_dim", max(1, hidden // heads)),
            dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
            quant_method=quant.get("quant_method"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            architecture=_architecture(config),
            derived_max_model_len=_derived_max_model_len(config, text),
            longrope_default_len=_longrope_default_len(config, text),
            is_vocab_size_given=text.get("vocab_size") is not None,
        )


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


# The keys vLLM 0.26 reads a model's length from, smallest wins
# (transformers_utils/model_arch_config_convertor.py:326-359); `model_max_length` then wins
# outright where set (Command-R, Cohere2).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")


def _derived_max_model_len(config: dict[str, Any], text: dict[str, Any]) -> int | None:
    """The context vLLM 0.26 derives from a config.json (`derive_max_model_len_and_key` and
    `_get_and_verify_max_len`, config/model.py:2152-2245): the smallest of the length keys
    it reads (`model_max_length` wins where set), scaled by the RoPE factor except for the
    `su`, `longrope` and `llama3` types (whose length is already the long context) and for
    Gemma 3; YaRN scales `original_max_position_embeddings`. None where config.json names no
    length key. Not modelled: the per-architecture convertors (e.g. MPT's, Falcon's), and a
    tokenizer_config.json's `model_max_length`, which vLLM 0.26 reads only for pooling models
    with absolute position embeddings (config/model.py:1766-1776), never for generation."""
    lengths = [v for k in _LENGTH_KEYS if isinstance(v := text.get(k), int | float)
               and not isinstance(v, bool) and v >= 1]
    if not lengths:
        return None
    explicit = text.get("model_max_length")
    derived = float(explicit) if isinstance(explicit, int | float) and \
        not isinstance(explicit, bool) and explicit >= 1 else float(min(lengths))
    factor = 1.0  # every layer type shares one factor
    for section in _rope_sections(config, text):
        kind = section.get("rope_type", section.get("type"))
        if kind in ("su", "longrope", "llama3"):
            continue
        value = section.get("factor", factor)
        factor = float(value) if isinstance(value, int | float) and value > 0 else 1.0
        if kind == "yarn":
            original = section.get("original_max_position_embeddings",
                                   text.get("original_max_position_embeddings"))
            if isinstance(original, int) and original >= 1:
                derived = float(original)
    return max(1, int(derived * factor))


def _rope_sections(config: dict[str, Any], text: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's RoPE parameters, one dict per layer type (Transformers 5 may nest them);
    none for Gemma 3, whose length vLLM never scales."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, dict) or "gemma3" in str(text.get("model_type") or
                                                    config.get("model_type") or ""):
        return []
    if "rope_type" in rope or "type" in rope or "factor" in rope:
        return [rope]
    return [v for v in rope.values() if isinstance(v, dict)]


def _longrope_default_len(config: dict[str, Any], text: dict[str, Any]) -> int | None:
    """vLLM 0.26's max_model_len with none given, for a model with a LongRoPE section:
    `original_max_position_embeddings` (the config's, else the section's), so that short
    prompts keep the short factors' quality; None for any other model, or where the length
    is not given (vLLM then keeps the derived context)."""
    sections = _rope_sections(config, text)
    if not any(s.get("rope_type", s.get("type")) in ("longrope", "su") for s in sections):
        return None
    original = text.get("original_max_position_embeddings")
    for section in sections:
        if original is None:
            original = section.get("original_max_position_embeddings")
    if isinstance(original, int) and not isinstance(original, bool) and original >= 1:
        return original
    return None


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
