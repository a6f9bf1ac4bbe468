"""The vLLM log parser and failure classifier on real logs recorded on the H200 (see the
fixtures' README for card, versions and flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.base import FailureReason
from runners.vllm.logs import classify_failure, parse_log

H200 = Path(__file__).parents[1] / "fixtures" / "vllm_logs" / "h200"


def _log(name: str) -> str:
    return (H200 / name).read_text()


def test_defaults_log_reports_capacity_compile_and_graphs() -> None:
    info = parse_log(_log("trial0.log"))
    assert info.engine_version == "0.26.0"
    assert info.attention_backend == "FLASH_ATTN", "FA3 is vLLM's choice on SM90"
    assert info.kv_cache_tokens == 2_115_440
    assert info.max_model_len == 4096 and info.max_concurrency_at_max_len == pytest.approx(516.46)
    assert info.model_memory_gib == pytest.approx(14.29)
    assert info.compile_s == pytest.approx(21.34) and info.graph_capture_s == pytest.approx(6.0)
    assert info.init_engine_s == pytest.approx(134.86)


@pytest.mark.parametrize(("name", "backend", "kv_tokens"), [
    ("trial1.log", "FLASHINFER", 2_244_032),
    ("trial2.log", "FLASH_ATTN", 4_454_896),
    ("trial3.log", "FLASH_ATTN", 4_488_064),
    ("trial4.log", "FLASHINFER", 4_488_064),
])
def test_eager_fp8_logs_have_no_compile_and_fp8_kv_doubles_capacity(
        name: str, backend: str, kv_tokens: int) -> None:
    info = parse_log(_log(name))
    assert info.attention_backend == backend
    assert info.kv_cache_tokens == kv_tokens
    assert info.compile_s is None and info.graph_capture_s is None, "eager: no compile, no graphs"
    assert info.model_memory_gib == pytest.approx(8.2), "fp8 weights take about half of bf16"


def test_fp8_kv_cache_holds_about_twice_the_tokens() -> None:
    bf16 = parse_log(_log("trial1.log")).kv_cache_tokens
    fp8 = parse_log(_log("trial3.log")).kv_cache_tokens
    assert bf16 and fp8 and 1.9 < fp8 / bf16 < 2.1


@pytest.mark.parametrize("name", sorted(p.name for p in H200.glob("*.log")))
def test_healthy_logs_are_never_classified_as_unsupported_or_oom(name: str) -> None:
    # Real healthy logs carry WARNING lines (FlashInfer's artifactory, ulimit) that must not
    # pass for a cause: a SIGTERM'd healthy engine is at most a crash, never a config problem.
    failure = classify_failure(_log(name), -15, "run")
    assert failure.reason == FailureReason.CRASH_MID_RUN
    assert "SIGTERM" in failure.message or "signal" in failure.message.lower()


# Second H200 study (h200-proof-2, same card and versions): compiled configs, TRITON_ATTN and a
# deliberate KV-cache OOM (gpu_memory_utilization 0.06 cannot hold 14.3 GiB of bf16 weights).
RUN2 = H200 / "run2"


@pytest.mark.parametrize(("name", "backend", "kv_tokens", "model_gib", "compile_s", "graphs_s"), [
    ("trial1_fp8.log", "FLASH_ATTN", 2_228_896, 8.2, 30.7, 4.0),
    ("trial4_kv_fp8.log", "FLASH_ATTN", 4_229_728, 14.32, 21.0, 5.0),
    # 0.26 names the backend it was told to use in the enum's words, not "out of potential ...".
    ("trial6_triton.log", "TRITON_ATTN", 2_115_440, 14.29, 17.36, 8.0),
])
def test_compiled_logs_report_backend_capacity_compile_and_graphs(
        name: str, backend: str, kv_tokens: int, model_gib: float, compile_s: float,
        graphs_s: float) -> None:
    info = parse_log((RUN2 / name).read_text())
    assert info.attention_backend == backend
    assert info.kv_cache_tokens == kv_tokens
    assert info.model_memory_gib == pytest.approx(model_gib)
    assert info.compile_s == pytest.approx(compile_s)
    assert info.graph_capture_s == pytest.approx(graphs_s)


def test_real_kv_cache_oom_is_classified_as_oom_at_start() -> None:
    text = (RUN2 / "trial3_kv_oom.log").read_text()
    failure = classify_failure(text, 1, "start")
    assert failure.reason == FailureReason.OOM_AT_START
    assert "gpu_memory_utilization" in failure.message, "the message names the knob to turn"
    assert "No available memory for the cache blocks" in failure.log_excerpt
    info = parse_log(text)
    assert info.kv_cache_gib == pytest.approx(-7.24), "vLLM printed a negative KV budget"
    assert info.kv_cache_tokens is None


@pytest.mark.parametrize("name", ["trial1_fp8.log", "trial4_kv_fp8.log", "trial6_triton.log"])
def test_a_traceback_logged_as_warning_is_not_the_cause_of_death(name: str) -> None:
    # Every healthy start under --skip-tokenizer-init logs a "Tokenizer not available" traceback
    # at WARNING level and goes on; a later crash must not be blamed on it.
    text = (RUN2 / name).read_text()
    assert "WARNING" in text and "Tokenizer not available" in text
    failure = classify_failure(text, 1, "start")
    assert failure.reason == FailureReason.STARTUP_CRASH
    assert "Tokenizer not available" not in failure.message
