"""Fuzz `fixed_flags` and `vllm.extra_args`: whatever a study gives, the answer is a one-line
ConfigError, or a study whose every engine command renders and still listens on 127.0.0.1 only,
with the fixed values on it."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.config import parse_study
from optimizer.errors import ConfigError
from optimizer.storage.study import engine_config
from runners.vllm.launcher import VllmLauncher

BASE = {"name": "s", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
        "slo": {"tpot_p99_ms": 50}}
NAMES = ["max_num_seqs", "gpu_memory_utilization", "kv_cache_dtype", "enable_lora",
         "max_model_len", "host", "port", "compilation_config", "cudagraph_mode",
         "enable_prefix_caching", "max_lora_rank", "seed", "served_model_name", "swap_space",
         "max_num_batched_tokens", "cudagraph_capture_sizes", "sim_unstable", "typo_flag"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.sampled_from(["auto", "fp8", "8k", "PIECEWISE", "0.0.0.0", "16"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)
words = st.one_of(st.sampled_from(["--host", "--port", "--enable-lora", "--max-loras", "-O3",
                                   "--max-num-seqs", "-tp", "--config", "--uds", "2",
                                   "0.0.0.0", "--seed=3", "--no-enable-lora", "x"]),
                  st.text(max_size=6))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(NAMES), values, max_size=4),
       st.lists(words, max_size=4))
def test_fixed_flags_and_extra_args_give_an_error_or_a_loopback_command(
        fixed: dict, extra: list) -> None:
    try:
        cfg = parse_study({**BASE, "fixed_flags": fixed, "vllm": {"extra_args": extra}})
    except ConfigError as exc:
        assert "\n" not in str(exc), "errors are one line"
        return
    config = engine_config(cfg, {"max_num_seqs": 256})
    argv, _ = VllmLauncher(vllm_version="0.26.0").command(config, 8000, Path("/tmp"), None)
    hosts = [argv[i + 1] for i, a in enumerate(argv) if a == "--host"]
    assert hosts == ["127.0.0.1"], f"listens on loopback only: {argv}"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--port"] == ["8000"]
    if "max_num_seqs" in fixed and fixed["max_num_seqs"] is not None:
        assert config.flags["max_num_seqs"] == fixed["max_num_seqs"], "the fixed value wins"
