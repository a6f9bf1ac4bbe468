"""Secrets by name and by flag: what a record or an export may hold of a launch."""

from __future__ import annotations

from pathlib import Path

from runners.credentials import (
    auth_headers,
    is_secret_name,
    launch_secrets,
    new_api_key,
    redact_argv,
    redact_env,
    scrub,
    scrub_file,
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


def test_a_launchs_secrets_are_its_secret_variables_and_secret_flag_values_longest_first(
        ) -> None:
    env = {"HF_TOKEN": "hf_abc123", "VLLM_API_KEY": "key-hf_abc123-long", "PATH": "/usr/bin",
           "DB_PASSWORD": "pw"}  # too short to scrub: it would cut every "pw" out of a log
    argv = ["vllm", "serve", "m", "--api-key", "flagkey1", "--hf-token=flagtok2"]
    assert launch_secrets(argv, env) == ["key-hf_abc123-long", "hf_abc123", "flagkey1",
                                         "flagtok2"]


def test_a_log_is_scrubbed_in_place_whole_and_private_and_left_alone_without_secrets(
        tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("start\nlogin hf_abc123 failed\nkey key-hf_abc123-long\n")
    log.chmod(0o644)
    values = launch_secrets([], {"HF_TOKEN": "hf_abc123", "API_KEY": "key-hf_abc123-long"})
    assert scrub_file(log, values)
    assert log.read_text() == "start\nlogin <redacted> failed\nkey <redacted>\n", \
        "the longer secret is replaced whole, not cut by the shorter inside it"
    assert log.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["server.log"], "no temporary left"
    assert not scrub_file(log, values), "nothing left to replace: not rewritten"
    assert not scrub_file(tmp_path / "missing.log", values)
