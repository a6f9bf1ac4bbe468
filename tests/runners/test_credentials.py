"""Secrets by name and by flag: what a record or an export may hold of a launch."""

from __future__ import annotations

from runners.credentials import (
    auth_headers,
    is_secret_name,
    new_api_key,
    redact_argv,
    redact_env,
    scrub,
    secret_values,
)


def test_secret_names_are_found_by_what_they_hold_and_knobs_are_not() -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
                 "DB_PASSWORD", "wandb_api_key"):
        assert is_secret_name(name), name
    for name in ("VLLM_LOGGING_LEVEL", "TOKENIZERS_PARALLELISM", "NCCL_P2P_DISABLE",
                 "VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE", "VLLM_KEYS_CACHE"):
        assert not is_secret_name(name), name


def test_redacted_env_names_each_secret_and_keeps_the_rest() -> None:
    env = {"HF_TOKEN": "hf_abc123", "VLLM_LOGGING_LEVEL": "INFO"}
    assert redact_env(env) == {"HF_TOKEN": "${HF_TOKEN}", "VLLM_LOGGING_LEVEL": "INFO"}
    assert scrub("token hf_abc123 used", secret_values(env)) == "token <redacted> used"


def test_redacted_argv_hides_the_value_of_each_secret_flag_in_both_spellings() -> None:
    argv = ["vllm", "serve", "m", "--hf-token", "hf_abc", "--api-key=k1", "--max-num-seqs", "8"]
    assert redact_argv(argv) == ["vllm", "serve", "m", "--hf-token", "<redacted>",
                                 "--api-key=<redacted>", "--max-num-seqs", "8"]


def test_each_api_key_is_new_and_sent_as_a_bearer_token() -> None:
    first, second = new_api_key(), new_api_key()
    assert first != second and len(first) >= 40
    assert auth_headers(first) == {"Authorization": f"Bearer {first}"}
    assert auth_headers(None) == {}
