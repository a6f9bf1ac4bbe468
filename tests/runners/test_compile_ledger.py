"""The compile ledger in the shared cache root (runners/vllm/compile_ledger.py): whole lines
appended, read back incrementally under one vLLM version and engine, and never fatal: a torn,
corrupt, missing or unreadable ledger costs predictions, not trials."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runners.base import EngineConfig, EngineInfo
from runners.vllm.compile_cache import compile_key
from runners.vllm.compile_ledger import (
    CompileLedger,
    LedgerEntry,
    append_entry,
    entry_of,
    ledger_path,
)


def _entry(key: str, version: str = "0.26.0", engine: str = "vllm") -> LedgerEntry:
    return LedgerEntry(compile_key=key, vllm_key="6cc5f9a5ca6ab7ed", vllm_version=version,
                       engine=engine, compile_cache="cold", writer="regress:case")


def test_a_start_is_kept_only_where_its_log_says_warm_or_cold() -> None:
    config = EngineConfig("/m", {"block_size": 32})
    info = EngineInfo(compile_cache="cold", compile_cache_dir="abc", engine_version="0.26.0")
    entry = entry_of(config, info, engine_name="vllm", writer="study:s")
    key = compile_key(config)
    assert entry is not None and key is not None and entry.compile_key == key.digest
    assert entry.vllm_key == "abc" and entry.vllm_version == "0.26.0"
    for unsaid in (EngineInfo(compile_cache=None, engine_version="0.26.0"),
                   EngineInfo(compile_cache="none", engine_version="0.26.0"),
                   EngineInfo(compile_cache="warm")):  # no version: it vouches for nothing
        assert entry_of(config, unsaid, engine_name="vllm", writer="study:s") is None
    eager = EngineConfig("/m", {"enforce_eager": True})
    assert entry_of(eager, info, engine_name="vllm", writer="study:s") is None


def test_keys_count_only_under_the_same_vllm_version_and_engine(tmp_path: Path) -> None:
    append_entry(tmp_path, _entry("aaa"))
    append_entry(tmp_path, _entry("bbb", version="0.25.1"))
    append_entry(tmp_path, _entry("ccc", engine="simulated"))
    ledger = CompileLedger(tmp_path, vllm_version="0.26.0", engine="vllm")
    assert ledger.compiled_keys() == {"aaa"}
    assert CompileLedger(tmp_path, vllm_version="0.25.1", engine="vllm").compiled_keys() == \
        {"bbb"}


def test_the_ledger_is_read_incrementally_and_a_new_one_replaces_the_old(tmp_path: Path) -> None:
    ledger = CompileLedger(tmp_path, vllm_version="0.26.0", engine="vllm")
    assert ledger.compiled_keys() == set(), "no ledger yet: nothing compiled elsewhere"
    append_entry(tmp_path, _entry("aaa"))
    assert ledger.compiled_keys() == {"aaa"}
    append_entry(tmp_path, _entry("bbb"))
    assert ledger.compiled_keys() == {"aaa", "bbb"}
    ledger_path(tmp_path).unlink()  # the cache root was wiped
    assert ledger.compiled_keys() == set()
    append_entry(tmp_path, _entry("ccc"))
    assert ledger.compiled_keys() == {"ccc"}


def test_a_corrupt_or_torn_line_is_skipped_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = ledger_path(tmp_path)
    good = json.dumps({**_entry("aaa").__dict__})
    path.write_text(f"{good}\nnot json at all\n{{\"compile_key\": 3}}\n" + good[:30])
    ledger = CompileLedger(tmp_path, vllm_version="0.26.0", engine="vllm")
    with caplog.at_level(logging.WARNING):
        assert ledger.compiled_keys() == {"aaa"}, "a line still being written waits"
        assert ledger.num_skipped_lines == 2
        append_entry(tmp_path, _entry("bbb"))  # ends the torn line first: it spoils only itself
        assert ledger.compiled_keys() == {"aaa", "bbb"}
    assert ledger.num_skipped_lines == 3
    assert len([r for r in caplog.records if "compile ledger" in r.message]) == 1


def test_an_unreadable_or_unwritable_ledger_never_raises(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ledger_path(tmp_path).mkdir()  # a directory where the file should be
    with caplog.at_level(logging.WARNING):
        assert append_entry(tmp_path, _entry("aaa")) is False
        assert CompileLedger(tmp_path, vllm_version="0.26.0",
                             engine="vllm").compiled_keys() == set()
    assert len([r for r in caplog.records if "compile ledger" in r.message]) == 2
