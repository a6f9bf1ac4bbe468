"""Secrets by name and by flag: what a record or an export may hold of a launch, and how an
engine's output is scrubbed of their values, whole or in pieces."""

from __future__ import annotations

import itertools
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from runners.credentials import (
    MIN_SECRET_CHARS,
    StreamScrubber,
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


def test_overlapping_secrets_are_masked_to_their_last_character() -> None:
    # Replacing one secret after another cut the first out and left the tail of the second.
    assert scrub("x abcdef y", ["abcd", "cdef"]) == "x <redacted> y"
    assert scrub("abab abab", ["abab"]) == "<redacted> <redacted>"
    assert scrub("ababab", ["abab"]) == "<redacted>", "overlapping occurrences are one run"


def test_values_under_four_characters_are_not_scrubbed_for_they_would_mask_ordinary_text(
        ) -> None:
    # The decision of issue 35 (item 3): a 1-3 character value is left in the log. A switch
    # named like a secret (huggingface_hub's HF_HUB_DISABLE_IMPLICIT_TOKEN=1) would otherwise
    # cut every digit 1 out of the figures the log's parsers read.
    assert MIN_SECRET_CHARS == 4
    env = {"HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "DB_PASSWORD": "pw1", "HF_TOKEN": "hf_a"}
    values = launch_secrets(["vllm", "serve", "m", "--api-key", "k12"], env)
    assert values == ["hf_a"], "only values of 4 characters or more are scrubbed"
    line = "Avg prompt throughput: 1.1 tokens/s, pw1 and k12 are shown, hf_a is not"
    assert scrub(line, values) == \
        "Avg prompt throughput: 1.1 tokens/s, pw1 and k12 are shown, <redacted> is not"


def test_a_secret_cut_between_pieces_is_held_until_decided_and_other_text_goes_out_at_once(
        ) -> None:
    key = "k3y-" + "x" * 40
    scrubber = StreamScrubber([key])
    assert scrubber.feed(b"INFO ready\n") == b"INFO ready\n", "nothing like a secret: not held"
    assert scrubber.feed(b"api key k3y-xx") == b"api key ", "a secret's start waits"
    assert scrubber.feed(b"x" * 38 + b" used\n") == b"<redacted> used\n"
    assert scrubber.feed(b"progress k3") == b"progress "
    assert scrubber.feed(b"0%") == b"k30%", "a start that did not go on goes out"
    assert scrubber.feed(b"cut k3y-x") == b"cut "
    assert scrubber.flush() == b"<redacted>", "the engine died printing it: masked all the same"


def test_a_secret_cut_short_by_the_end_is_masked_from_four_characters() -> None:
    key = "k3y-" + "x" * 40
    assert scrub("killed printing k3y-xxx", [key]) == "killed printing <redacted>"
    assert scrub("ends with k3y", [key]) == "ends with k3y", "under 4 characters: text"
    assert scrub("k3y-xxx in the middle", [key]) == "k3y-xxx in the middle"


# Small alphabets make secrets that overlap, hold each other and recur: the hard cases.
_SECRETS = st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=3)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(values=_SECRETS, text=st.text("ab\n", max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_stream_scrubbed_in_pieces_is_the_whole_scrubbed_wherever_it_is_cut(
        values: list[str], text: str, cuts: list[int]) -> None:
    data = text.encode()
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    scrubber = StreamScrubber(values)
    pieces = [scrubber.feed(data[a:b]) for a, b in itertools.pairwise(bounds)]
    assert b"".join([*pieces, scrubber.flush()]).decode() == scrub(text, values)
