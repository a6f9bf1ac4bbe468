"""The context vLLM 0.26 derives from a config.json (config/model.py `_get_and_verify_max_len`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runners.model_info import ModelInfo

BASE: dict[str, Any] = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 2,
                        "max_position_embeddings": 32768}


@pytest.mark.parametrize(("rope", "expected"), [
    (None, 32768),
    ({"rope_type": "default", "rope_theta": 1e6}, 32768),  # Transformers 5's rope_parameters
    ({"type": "linear", "factor": 2.0}, 65536),
    ({"rope_type": "dynamic", "factor": 4.0}, 131072),
    # YaRN scales the original length (Qwen2.5's long-context recipe: 32768 x 4)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}, 32768),
    # llama3, longrope and su already give the long context in max_position_embeddings
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 32768),
    ({"rope_type": "longrope", "factor": 4.0}, 32768),
    ({"type": "linear", "factor": None}, 32768),  # vLLM falls back to 1.0
    # nested per layer type: every layer type shares the factor
    ({"full_attention": {"rope_type": "linear", "factor": 2.0},
      "sliding_attention": {"rope_type": "default"}}, 65536),
])
def test_derived_context_applies_rope_scaling_as_vllm_does(rope: dict[str, Any] | None,
                                                            expected: int) -> None:
    config = {**BASE, "rope_scaling": rope}
    assert ModelInfo.from_config(config).default_max_model_len == expected


def test_gemma3_context_is_already_scaled() -> None:
    config = {**BASE, "model_type": "gemma3_text", "rope_scaling": {"type": "linear",
                                                                    "factor": 8.0}}
    assert ModelInfo.from_config(config).default_max_model_len == 32768


def test_the_length_is_the_smallest_key_vllm_reads_and_model_max_length_wins() -> None:
    shape = {k: v for k, v in BASE.items() if k != "max_position_embeddings"}
    assert ModelInfo.from_config({**shape, "n_positions": 8192}).derived_max_model_len == 8192
    assert ModelInfo.from_config({**BASE, "seq_length": 4096}).derived_max_model_len == 4096
    # Command-R: max_position_embeddings 8192, model_max_length 131072 (vLLM serves 131072)
    command_r = {**BASE, "max_position_embeddings": 8192, "model_max_length": 131072}
    assert ModelInfo.from_config(command_r).derived_max_model_len == 131072
    assert ModelInfo.from_config(shape).derived_max_model_len is None, \
        "no length key: Transformers fills it from the model type; not guessed here"


def test_a_missing_shape_key_says_transformers_fills_it_not_that_the_file_is_wrong(
        tmp_path: Path) -> None:
    from runners.model_info import load_model_info

    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="Transformers fills it") as info:
        load_model_info(str(tmp_path))
    assert "as published" not in str(info.value)
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2, '
                                          '"num_attention_heads": 4}')
    model = load_model_info(str(tmp_path))
    assert model is not None and not model.is_vocab_size_given


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_a_longrope_models_default_is_its_original_length_and_its_bound_the_long_one(
        rope_key: str) -> None:
    # Phi-3-mini-128k: with no max_model_len vLLM 0.26 serves original_max_position_embeddings
    # (config/model.py:2244-2255); a given one may reach max_position_embeddings. "su" is
    # LongRoPE's legacy name (transformers_utils/config.py:505).
    for kind in ("longrope", "su"):
        phi3 = {**BASE, "max_position_embeddings": 131072, "original_max_position_embeddings":
                4096, rope_key: {"type": kind, "long_factor": [1.0], "short_factor": [1.0]}}
        info = ModelInfo.from_config(phi3)
        assert (info.default_max_model_len, info.derived_max_model_len) == (4096, 131072)
    nested = {**BASE, "max_position_embeddings": 131072, "rope_parameters": {
        "rope_type": "longrope", "original_max_position_embeddings": 8192}}
    assert ModelInfo.from_config(nested).default_max_model_len == 8192
    assert ModelInfo.from_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 8192}}
                                 ).longrope_default_len is None, "only LongRoPE"
