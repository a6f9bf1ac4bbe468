"""vLLM 0.26's torch.compile cache as nightshift sees it: `compile_key`, an estimate of which
part of an `EngineConfig` enters vLLM's cache key (two configs with the same estimate land in the
same cache directory), and the environment switches the start-up savers and the warm-cache check
use. Pure; every fact is cited against the 0.26.0 wheel's source in docs/startup-cost.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from runners.base import EngineConfig
from search_spaces.engine.tables import bundled_flags

# What a start-up did with the compile cache, as its log says (`runners.vllm.logs.parse_log`):
# "warm" loaded compiled artefacts and compiled nothing, "cold" compiled, "none" ran no
# torch.compile at all (eager), None: the log does not say (it died first, or an old version).
CompileCacheState = Literal["warm", "cold", "none"]

# vLLM reads these only to place or time things; its compile key leaves them out
# (vllm/envs.py:2105-2172, `compile_factors`' ignored_factors, as of 0.26.0).
ENV_OUTSIDE_KEY = frozenset({
    "MAX_JOBS", "VLLM_RPC_BASE_PATH", "VLLM_USE_MODELSCOPE", "VLLM_RINGBUFFER_WARNING_INTERVAL",
    "VLLM_DEBUG_DUMP_PATH", "VLLM_PORT", "VLLM_CACHE_ROOT", "VLLM_ENABLE_STARTUP_PLAN",
    "LD_LIBRARY_PATH", "VLLM_SERVER_DEV_MODE", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT",
    "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_RANDOMIZE_DP_DUMMY_INPUTS", "VLLM_MODEL_REDIRECT_PATH",
    "VLLM_HOST_IP", "VLLM_FORCE_AOT_LOAD", "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY",
    "S3_ENDPOINT_URL", "VLLM_USAGE_STATS_SERVER", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
    "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_STREAM", "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_COLOR", "VLLM_LOG_STATS_INTERVAL", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
    "VLLM_TUNED_CONFIG_FOLDER", "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
    "VLLM_FLASHINFER_AUTOTUNE_SKIP_OPS", "VLLM_ENGINE_ITERATION_TIMEOUT_S",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    "VLLM_IMAGE_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT", "VLLM_AUDIO_FETCH_TIMEOUT",
    "VLLM_MEDIA_CACHE", "VLLM_MEDIA_CACHE_MAX_SIZE_MB", "VLLM_MEDIA_CACHE_TTL_HOURS",
    "VLLM_MEDIA_FETCH_MAX_RETRIES", "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    "VLLM_MEDIA_LOADING_THREAD_COUNT", "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB",
    "VLLM_MAX_AUDIO_DECODE_DURATION_S", "VLLM_MAX_AUDIO_PREPROCESS_WORKERS",
    "VLLM_MAX_IMAGE_PIXELS", "VLLM_VIDEO_LOADER_BACKEND", "VLLM_MEDIA_CONNECTOR",
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "VLLM_ASSETS_CACHE", "VLLM_ASSETS_CACHE_MODEL_CLEAN",
    "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_MOE_PREPACK",
    "VLLM_ZENTORCH_WEIGHT_PREPACK", "VLLM_TEST_FORCE_LOAD_FORMAT",
    "VLLM_ENABLE_CUDA_COMPATIBILITY", "VLLM_CUDA_COMPATIBILITY_PATH",
    "VLLM_SKIP_MODEL_NAME_VALIDATION", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "NO_COLOR",
})
# compile_factors also hashes these Ray switches whether vLLM knows them or not (envs.py:2178).
_RAY_NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"

# Flags whose config fields vLLM 0.26 leaves out of `VllmConfig.compute_hash` and that feed no
# field it keeps (file:line in docs/startup-cost.md). Every other flag is taken to enter the
# key: an unknown flag splits a group (a cold start predicted where it would be warm), which
# costs a wrong prediction, never a wrong measurement.
FLAGS_OUTSIDE_KEY = frozenset({
    # CacheConfig.compute_hash ignored_factors (config/cache.py:204-222)
    "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
    "enable_prefix_caching", "prefix_caching_hash_algo",
    # SchedulerConfig.compute_hash hashes max_num_batched_tokens alone (config/scheduler.py:203)
    "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold",
    "scheduling_policy", "stream_interval",
    # ParallelConfig.compute_hash ignored_factors (config/parallel.py:758-796)
    "disable_custom_all_reduce",
    # ModelConfig.compute_hash ignored_factors (config/model.py:391-424)
    "seed", "served_model_name", "tokenizer", "tokenizer_mode", "skip_tokenizer_init",
    # Observability, profiler and load configs hash no factors (config/observability.py:102,
    # config/profiler.py:118, config/load.py:117)
    "disable_log_stats", "enable_mfu_metrics", "profiler_config", "load_format",
})
# Derived: max_num_seqs sets the CUDA-graph capture sizes when they are not pinned
# (config/vllm.py:1788-1796), and those are CompilationConfig fields, hashed whole
# (config/compilation.py:782-810); enable_chunked_prefill may set the default token budget.
_CAPTURE_PINNED = ("max_cudagraph_capture_size", "cudagraph_capture_sizes",
                   "compilation_config.max_cudagraph_capture_size",
                   "compilation_config.cudagraph_capture_sizes")
_CAPTURE_CAP = 512  # config/vllm.py:1794-1796: min(max_num_seqs * decode_query_len * 2, 512)
_NO_COMPILE_MODES = ("0", "none", "NONE", "CompilationMode.NONE")

# Env switches nightshift sets itself (docs/startup-cost.md).
FORCE_AOT_LOAD = "VLLM_FORCE_AOT_LOAD"  # envs.py:765: a failed AOT load raises (decorators.py:326)
AOT_COMPILE = "VLLM_USE_AOT_COMPILE"  # envs.py:339-348: default on with torch >= 2.10
DISABLE_CACHE = "VLLM_DISABLE_COMPILE_CACHE"  # envs.py:335


@dataclass(frozen=True)
class CompileKey:
    """The estimated key: equal digests mean vLLM 0.26 computes the same cache directory for
    both configs on one host (same vLLM, torch, code and inherited environment)."""

    digest: str  # 12 hex characters over `factors`
    factors: Mapping[str, Any] = field(default_factory=dict)  # what entered, for the record
    is_cached: bool = True  # False: vLLM compiles this config on every start (cache off)


def _on(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _compiles(flags: Mapping[str, Any]) -> bool:
    """Whether vLLM runs torch.compile for these flags: not with enforce_eager
    (config/vllm.py:1163, mode NONE), nor with compilation mode 0 or -O0 (config/vllm.py:1238)."""
    if _on(flags.get("enforce_eager")):
        return False
    mode = flags.get("compilation_config.mode")
    compilation = flags.get("compilation_config")
    if isinstance(compilation, str):
        try:
            compilation = json.loads(compilation)
        except ValueError:
            compilation = None
    if isinstance(compilation, Mapping) and "mode" in compilation:
        mode = compilation["mode"]
    if mode is not None and str(mode) in _NO_COMPILE_MODES:
        return False
    level = flags.get("optimization_level")
    return not (level is not None and str(level).upper().lstrip("O") == "0")


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def _capture_max(flags: Mapping[str, Any]) -> int | None:
    """The largest CUDA-graph capture size max_num_seqs leads to, or None where it does not
    matter (graphs off, sizes pinned). Both of vLLM's default max_num_seqs (256 and 1024) give
    the cap of 512, so an unset max_num_seqs needs no host."""
    mode = str(flags.get("compilation_config.cudagraph_mode") or "").upper()
    if mode == "NONE" or any(flags.get(k) is not None for k in _CAPTURE_PINNED):
        return None
    seqs = _int(flags.get("max_num_seqs"))
    spec_tokens = _int(flags.get("spec_tokens")) or 0
    size = _CAPTURE_CAP if seqs is None else min(seqs * (1 + spec_tokens) * 2, _CAPTURE_CAP)
    budget = _int(flags.get("max_num_batched_tokens"))
    return min(size, budget) if budget is not None else size


def env_in_key(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that vLLM 0.26 hashes into the key: those it knows
    (`vllm.envs.environment_variables`, recorded in the flag table) less `ENV_OUTSIDE_KEY`,
    and Ray's NOSET switches (envs.py:2099-2195)."""
    known = bundled_flags().env_vars
    return {k: v for k, v in sorted(env.items())
            if (k in known and k not in ENV_OUTSIDE_KEY) or k.startswith(_RAY_NOSET_PREFIX)}


def compile_key(config: EngineConfig) -> CompileKey | None:
    """The estimated compile-cache key of `config`, or None when it runs no torch.compile."""
    flags = dict(config.flags)
    if not _compiles(flags):
        return None
    # `no_<flag>: true` is how the renderer spells a false boolean
    # (search_spaces/engine/render.py).
    keyed: dict[str, Any] = {k: v for k, v in sorted(flags.items())
                             if k.removeprefix("no_") not in FLAGS_OUTSIDE_KEY and
                             k.removeprefix("no_") not in ("max_num_seqs",
                                                           "enable_chunked_prefill")}
    capture = _capture_max(flags)
    if capture is not None:
        keyed["(cudagraph capture max)"] = capture
    if flags.get("max_num_batched_tokens") is None:  # chunked prefill sets the default budget
        keyed.update((k, v) for k, v in flags.items()
                     if k in ("enable_chunked_prefill", "no_enable_chunked_prefill"))
    env = env_in_key(config.env)
    factors = {"model": config.model, "flags": keyed, "extra_args": list(config.extra_args),
               "env": env}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode())
    # ngram_gpu turns vLLM's compile cache off (compilation/backends.py:1078-1083).
    is_cached = not _on(env.get(DISABLE_CACHE)) and flags.get("spec_method") != "ngram_gpu"
    return CompileKey(digest.hexdigest()[:12], factors, is_cached)
