"""The context length vLLM 0.26 gives a model when none is given, read from its Hugging Face
`config.json` (`ModelInfo.default_max_model_len`, runners/model_info.py): the length it derives
(`derived_max_model_len`: the length keys, scaled by the RoPE factor) and a LongRoPE model's
original length (`longrope_default_len`)."""

from __future__ import annotations

from typing import Any

# The keys vLLM 0.26 reads a model's length from, smallest wins
# (transformers_utils/model_arch_config_convertor.py:326-359); `model_max_length` then wins
# outright where set (Command-R, Cohere2).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")


def derived_max_model_len(config: dict[str, Any], text: dict[str, Any]) -> int | None:
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


def longrope_default_len(config: dict[str, Any], text: dict[str, Any]) -> int | None:
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
