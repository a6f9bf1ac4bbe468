"""The simulated engine's start-up (`start_up`): vLLM 0.26's start-up sequence walked through
with its log lines, each phase slept for its modelled time x the time scale, the start-up faults
fired on the way, and the warm compile cache remembered (`compile_cache_marker`)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from pathlib import Path

from runners.base import EngineConfig, Failure, FailureReason
from runners.simulated.calibration import GIB
from runners.simulated.performance import PerformanceModel
from runners.simulated.settings import ServerSettings
from runners.simulated.sizing import ATTENTION_BACKENDS, ENGINE_VERSION, flag_bool
from runners.vllm.compile_cache import compile_key

logger = logging.getLogger(__name__)


def compile_cache_marker(config: EngineConfig) -> Path | None:
    """Where a warm compile cache is remembered, only when the config names VLLM_CACHE_ROOT (so
    tests never write under the user's home)."""
    root = config.env.get("VLLM_CACHE_ROOT")
    if not root:
        return None
    # Keyed as vLLM 0.26 keys its cache, as far as nightshift's estimate knows it (modelled:
    # runners/vllm/compile_cache.py); the simulated faults are no part of a config.
    plain = dataclasses.replace(config, flags={k: v for k, v in config.flags.items()
                                               if not k.startswith("sim_")})
    key = compile_key(plain)
    if key is None:
        return None
    digest = key.digest if key.is_cached else hashlib.sha256(str(time.time_ns()).encode()
                                                             ).hexdigest()
    return Path(root) / "torch_compile_cache" / "torch_aot_compile" / f"simulated-{digest}" / \
        "rank_0_0" / "model"


async def start_up(model: PerformanceModel, settings: ServerSettings,
                   compile_marker: Path | None) -> int | None:
    """Walk through vLLM's start-up, logging its lines; None when the engine may serve, else the
    exit code it dies with. `compile_marker` is where a warm compile cache is remembered (None:
    nowhere); a cold compile writes it."""
    faults, scale = settings.faults, settings.startup_time_scale

    async def sleep_scaled(modelled_s: float) -> None:
        await asyncio.sleep(max(0.0, modelled_s * scale))

    times = model.startup()
    started = time.monotonic()
    logger.info("vLLM API server version %s", settings.vllm_version or ENGINE_VERSION)
    logger.info("Simulated engine: latencies come from a roofline model of %s on %s, "
                "not from a GPU measurement.", model.model.name, model.hardware.gpu_name)
    await sleep_scaled(times.process_start_s)
    candidates = [b for b in ATTENTION_BACKENDS if b != "FLEX_ATTENTION"] + ["FLEX_ATTENTION"]
    logger.info("Using %s attention backend out of potential backends: %s",
                model.attention_backend, candidates)
    await sleep_scaled(times.model_load_s)
    logger.info("Loading weights took %.2f seconds", times.model_load_s * 0.95)
    logger.info("Model loading took %.4f GiB memory and %.6f seconds",
                model.weight_bytes_per_gpu / GIB, times.model_load_s)
    if faults.oom_at_start:
        await sleep_scaled(times.profile_s)
        return _fail(Failure(
            FailureReason.OOM_AT_START,
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."))
    if times.compile_s:
        if not model.is_compile_cache_warm and \
                flag_bool(settings.config.env, "VLLM_FORCE_AOT_LOAD", False):
            # As vLLM 0.26 with VLLM_FORCE_AOT_LOAD=1 and no artefact
            # (compilation/decorators.py:293-327): the load raises, the engine dies.
            logger.error("FileNotFoundError: [Errno 2] No such file or directory: '%s'",
                         compile_marker
                         or "torch_compile_cache/torch_aot_compile/?/rank_0_0/model")
            logger.error("RuntimeError: Engine core initialization failed. See root cause "
                         "above. Failed core proc(s): {}")
            return 1
        await sleep_scaled(times.compile_s)
        if model.is_compile_cache_warm:
            logger.info("Directly load AOT compilation from path %s", compile_marker)
        else:
            logger.info("Compiling a graph for compile range (1, %d) takes %.2f s",
                        model.max_num_batched_tokens, times.compile_s * 0.6)
            if compile_marker is not None:
                logger.info("saved AOT compiled function to %s", compile_marker)
        logger.info("torch.compile took %.2f s in total", times.compile_s)
    await sleep_scaled(times.profile_s)
    failure = model.check_memory()
    if failure is not None:
        return _fail(failure)
    logger.info("Available KV cache memory: %.2f GiB", model.kv_cache_bytes_per_gpu / GIB)
    logger.info("GPU KV cache size: %s tokens", f"{model.kv_cache_tokens:,}")
    logger.info("Maximum concurrency for %s tokens per request: %.2fx",
                f"{model.max_model_len:,}", model.max_concurrency_at_max_len)
    if times.graph_capture_s:
        logger.info("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0%")
        if faults.graph_capture_fail:
            await sleep_scaled(times.graph_capture_s / 3)
            logger.error(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                "GPU 0 has a total capacity of %.2f GiB of which 1.12 GiB is free.",
                model.hardware.gpu_memory_gib)
            logger.error("RuntimeError: Engine core initialization failed. See root cause "
                         "above. Failed core proc(s): {}")
            return 1
        await sleep_scaled(times.graph_capture_s)
        logger.info("Graph capturing finished in %.0f secs, took %.2f GiB",
                    times.graph_capture_s, model.cuda_graph_bytes_per_gpu / GIB)
    logger.info("init engine (profile, create kv cache, warmup model) took %.2f seconds "
                "(compilation: %.2f s)", times.init_engine_s, times.compile_s)
    if compile_marker is not None and times.compile_s:
        compile_marker.parent.mkdir(parents=True, exist_ok=True)
        compile_marker.touch()
    await sleep_scaled(times.misc_s)
    if faults.slow_start_s:
        await asyncio.sleep(float(faults.slow_start_s))  # real seconds, on purpose
    if faults.hang_at_start:
        logger.info("Simulated fault: never becoming healthy (sim_hang_at_start).")
        await asyncio.Event().wait()
    logger.info("Simulated engine ready: modelled start-up %.1f s (slept %.2f s at "
                "startup_time_scale %g)", times.total_s, time.monotonic() - started, scale)
    logger.info("Starting vLLM API server 0 on http://%s:%d", settings.host, settings.port)
    logger.info("Application startup complete.")
    return None


def _fail(failure: Failure, exception: str = "ValueError") -> int:
    logger.error("%s: %s", exception, failure.message)
    logger.error("RuntimeError: Engine core initialization failed. See root cause above. "
                 "Failed core proc(s): {}")
    return 1
