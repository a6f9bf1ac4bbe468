"""The table of the vLLM a launch runs (`runners.vllm.flags`): the bundled table of its release
without importing vLLM, else the installed vLLM's own parser read as a table."""

from __future__ import annotations

import argparse

import pytest

from runners.vllm.flags import flags_from_parser, table_for
from search_spaces.engine.render import to_argv
from search_spaces.engine.tables import bundled_flags


def test_the_installed_parser_gives_negation_and_defaults_as_argparse_states_them() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--enable-log-requests", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    table = flags_from_parser(parser, version="9.9")
    assert table.is_negatable("enable_prefix_caching"), "None: decided at start-up"
    assert not table.is_negatable("enforce_eager") and not table.is_negatable(
        "enable_log_requests"), "False is the default, or there is no --no- form"
    assert to_argv({"enable_prefix_caching": False, "enforce_eager": False,
                    "enable_log_requests": False}, table) == ["--no-enable-prefix-caching"]
    assert table.default("block_size") == 16 and table.default("enforce_eager") is False
    with pytest.raises(KeyError):
        table.default("max_num_seqs")


def test_launching_the_bundled_release_renders_with_the_bundled_table() -> None:
    assert table_for("0.26.0") is bundled_flags(), "no vLLM import to launch 0.26.0"
    assert table_for("0.26.0+cu129") is bundled_flags()
