"""vLLM 0.26's compile cache as nightshift estimates and reads it: the key estimate
(runners/vllm/compile_cache.py) against what 0.26's `compute_hash` functions hash, the warm /
cold / none reading of real H200 logs, the refused warm-cache check, the cache root passed to
every launch, and the warm-cache check's fallback through the simulated engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from runners.base import EngineConfig, FailureReason
from runners.vllm.compile_cache import compile_key, env_in_key
from runners.vllm.launcher import VllmLauncher
from runners.vllm.logs import classify_failure, parse_log

LOGS = Path(__file__).parent.parent / "fixtures" / "vllm_logs"
BASE = {"max_model_len": 4096}


def _key(flags: dict[str, Any] | None = None, env: dict[str, str] | None = None,
         model: str = "/m/qwen") -> str | None:
    key = compile_key(EngineConfig(model, {**BASE, **(flags or {})}, env or {}))
    return None if key is None else key.digest


# Each pair differs in one field: same key where 0.26 leaves the field out of
# VllmConfig.compute_hash (and out of every field it keeps), else a different key.
@pytest.mark.parametrize(("flags", "same"), [
    ({"gpu_memory_utilization": 0.8}, True),  # config/cache.py:204
    ({"enable_prefix_caching": False}, True),  # config/cache.py:209
    ({"no_enable_prefix_caching": True}, True),  # as the flag renderer spells a false
    ({"kv_cache_memory_bytes": 10**10}, True),
    ({"scheduling_policy": "priority"}, True),  # config/scheduler.py:203: mnbt alone
    ({"stream_interval": 4}, True),
    ({"max_num_partial_prefills": 2}, True),
    ({"disable_custom_all_reduce": True}, True),  # config/parallel.py:783
    ({"max_num_seqs": 512}, True),  # capture sizes: min(2 x 512, 512) = the default's 512
    ({"max_num_seqs": 256}, True),  # min(2 x 256, 512) = 512 as well
    ({"max_num_seqs": 128}, False),  # capture sizes up to 256: config/vllm.py:1794
    ({"max_num_batched_tokens": 2048}, False),  # config/scheduler.py:224
    ({"kv_cache_dtype": "fp8"}, False),  # CacheConfig.cache_dtype
    ({"block_size": 32}, False),
    ({"attention_backend": "FLASHINFER"}, False),  # config/attention.py:100
    ({"quantization": "fp8"}, False),  # ModelConfig.quantization
    ({"compilation_config.cudagraph_mode": "PIECEWISE"}, False),  # config/compilation.py:782
    ({"max_cudagraph_capture_size": 64}, False),
    ({"max_model_len": 8192}, False),  # ModelConfig.max_model_len
    ({"tensor_parallel_size": 2}, False),
    ({"async_scheduling": False}, False),  # parallel: disable_nccl_for_dp_synchronization
    ({"some_future_flag": 1}, False),  # unknown: taken to enter the key
])
def test_a_field_changes_the_key_exactly_where_vllm_hashes_it(flags: dict[str, Any],
                                                              same: bool) -> None:
    assert (_key(flags) == _key()) is same, f"{flags}: same key expected {same}"


def test_max_num_seqs_matters_only_while_graph_sizes_follow_it() -> None:
    assert _key({"max_num_seqs": 64}) != _key({"max_num_seqs": 128})
    pinned = {"max_cudagraph_capture_size": 64}
    assert _key({**pinned, "max_num_seqs": 64}) == _key({**pinned, "max_num_seqs": 128}), \
        "pinned capture sizes no longer follow max_num_seqs"
    no_graphs = {"compilation_config.cudagraph_mode": "NONE"}
    assert _key({**no_graphs, "max_num_seqs": 8}) == _key(no_graphs)
    assert _key({"max_num_seqs": 128, "spec_tokens": 1, "spec_method": "ngram"}) == \
        _key({"max_num_seqs": 256, "spec_tokens": 1, "spec_method": "ngram"}), \
        "2 x 128 x (1 + 1 speculative) = 512, the cap"


def test_env_enters_the_key_as_vllms_compile_factors_say() -> None:
    assert _key(env={"VLLM_USE_FLASHINFER_SAMPLER": "0"}) != _key(), \
        "envs.py:2105: not ignored, so the saver gives new keys"
    for outside in ("VLLM_CACHE_ROOT", "VLLM_FORCE_AOT_LOAD", "VLLM_ENABLE_STARTUP_PLAN",
                    "VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG"):
        assert _key(env={outside: "1"}) == _key(), f"{outside} is outside the key"
    assert env_in_key({"VLLM_USE_AOT_COMPILE": "0", "NCCL_DEBUG": "INFO"}) == {
        "VLLM_USE_AOT_COMPILE": "0"}


def test_eager_and_uncached_configs() -> None:
    assert _key({"enforce_eager": True}) is None, "no torch.compile: nothing to key"
    assert _key({"compilation_config.mode": 0}) is None
    assert _key({"optimization_level": "O0"}) is None
    key = compile_key(EngineConfig("/m", {"spec_method": "ngram_gpu", "spec_tokens": 2}))
    assert key is not None and not key.is_cached, "backends.py: ngram_gpu turns the cache off"
    off = compile_key(EngineConfig("/m", {}, {"VLLM_DISABLE_COMPILE_CACHE": "1"}))
    assert off is not None and not off.is_cached


@pytest.mark.parametrize(("path", "state", "vllm_key"), [
    ("h200/trial0.log", "cold", "1ca8ed6276a03ae4"),  # defaults, first start: compiled
    ("h200/run2/trial1_fp8.log", "cold", "6cc5f9a5ca6ab7ed"),
    ("h200/run2/trial4_kv_fp8.log", "cold", "b467e8bd741d4b57"),
    ("h200/run2/trial6_triton.log", "cold", "f783ce940e8b4251"),
    ("h200/trial2.log", "none", None),  # eager
    ("h200/run2/trial3_kv_oom.log", "none", None),  # eager, died at start
    ("warm_aot_reconstructed.log", "warm", "6cc5f9a5ca6ab7ed"),  # built from 0.26's lines
    ("kv_cache_oom.log", None, None),  # "torch.compile took" alone: a load prints it too
])
def test_the_start_up_log_says_warm_cold_or_none(path: str, state: str | None,
                                                 vllm_key: str | None) -> None:
    info = parse_log((LOGS / path).read_text())
    assert info.compile_cache == state
    assert info.compile_cache_dir == vllm_key


def test_the_warm_and_cold_start_of_one_config_name_the_same_vllm_key() -> None:
    cold = parse_log((LOGS / "h200/run2/trial1_fp8.log").read_text())
    warm = parse_log((LOGS / "warm_aot_reconstructed.log").read_text())
    assert cold.compile_cache_dir == warm.compile_cache_dir
    assert warm.compile_s is not None and cold.compile_s is not None
    assert warm.compile_s < cold.compile_s


def test_a_refused_aot_load_is_a_compile_cache_miss_not_a_crash() -> None:
    path = ("/root/vllm-cache/torch_compile_cache/torch_aot_compile/"
            + "ab" * 32 + "/rank_0_0/model")
    log = "\n".join([
        "(EngineCore pid=7) INFO 12-04 10:00:00 [model_runner.py:305] Model loading took "
        "14.29 GiB and 2.3 seconds",
        f"(EngineCore pid=7) ERROR 12-04 10:00:01 [core.py:1108] FileNotFoundError: [Errno 2] "
        f"No such file or directory: '{path}'",
        "(APIServer pid=5) RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}"])
    failure = classify_failure(log, 1, "startup")
    assert failure.reason == FailureReason.COMPILE_CACHE_MISS


def test_every_launch_gets_the_shared_cache_root_unless_per_trial(tmp_path: Path) -> None:
    config = EngineConfig("/m", {})
    shared = VllmLauncher(vllm_version="0.26.0", cache_root=tmp_path / "cache")
    for trial in ("0001", "0002"):
        _, env = shared.command(config, 8000, tmp_path / trial, None)
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache"), "one root for every trial"
    isolated = VllmLauncher(vllm_version="0.26.0", cache_root=tmp_path / "cache",
                            is_cache_per_trial=True)
    _, env = isolated.command(config, 8000, tmp_path / "0003", None)
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "0003" / "vllm_cache")


def test_the_load_generator_sends_greedy_requests_only() -> None:
    """The FlashInfer-sampler saver holds only for greedy requests (docs/startup-cost.md)."""
    import asyncio

    from runners.loadgen.client import send_request
    from runners.loadgen.requests import RequestSpec

    sent: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, text="data: [DONE]\n\n")

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await send_request(client, "http://x", "m", RequestSpec(prompt=[1, 2], prompt_len=2,
                                                                    output_len=4), 5.0)

    asyncio.run(main())
    assert sent and sent[0]["temperature"] == 0
    assert not {"top_p", "top_k", "seed", "min_p"} & set(sent[0]), "nothing but greedy"


def test_a_refused_warm_check_relaunches_without_it(tmp_path: Path) -> None:
    """VLLM_FORCE_AOT_LOAD=1 on a cold modelled cache: the simulated engine dies as vLLM does,
    the runner starts it again without the variable, and the result says so; the next start of
    the same key loads the artefact the relaunch saved."""
    from runners.engine import EngineRunner
    from runners.load_level import LoadLevel
    from runners.simulated.launcher import SimulatedLauncher
    from runners.workload import LengthDistribution, Workload

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines")
    workload = Workload(input_len=LengthDistribution(mean=16),
                        output_len=LengthDistribution(mean=4), num_requests=4,
                        num_warmup_requests=0, levels=(LoadLevel(max_concurrency=2),),
                        vocab_size=1000, startup_timeout_s=60)
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "cache"), "VLLM_FORCE_AOT_LOAD": "1"}
    config = EngineConfig("qwen2.5-7b", {"max_model_len": 4096}, env, load_format="dummy")
    try:
        first = runner.run(config, workload, tmp_path / "t1")
        assert first.status == "complete", first.failure
        assert first.engine.is_warm_check_refused and first.engine.compile_cache == "cold"
        assert "VLLM_FORCE_AOT_LOAD" not in first.env, "the relaunch ran without the check"
        assert (tmp_path / "t1" / "server.aot-refused.log").is_file()
        second = runner.run(config, workload, tmp_path / "t2")
        assert second.status == "complete" and not second.engine.is_warm_check_refused
        assert second.engine.compile_cache == "warm"
    finally:
        runner.close()
