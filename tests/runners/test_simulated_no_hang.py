"""The simulated engine never stops producing tokens unless a `sim_*` fault asks it to: a slow
config (fp8_per_block's modelled JIT stall) streams slowly, data-parallel replicas included, and
a sample of the widened Hopper space each completes a short level. Properties of the simulated
engine, never measurements."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from runners.base import EngineConfig, FlagValue
from runners.hardware import load_preset
from runners.load_level import LoadLevel
from runners.simulated.engine import SimulatedEngine
from runners.workload import LengthDistribution, SharedPrefix, Workload
from tests.builders import simulated_run
from tests.virtual_time import run_in_virtual_time

# Far below the runner's 120 s: a replica that sleeps out another replica's modelled clock
# (the hang this file guards against) is caught in seconds, while a healthy level of these
# sizes never goes this long without a chunk.
STALL_TIMEOUT_S = 5.0


def _run(tmp_path: Path, flags: dict[str, FlagValue], workload: Workload,
         model: str = "qwen2.5-0.5b") -> None:
    result = simulated_run(tmp_path, EngineConfig(model, flags, load_format="dummy",
                                                  skip_tokenizer_init=True,
                                                  served_model_name="sim"),
                           workload, stall_timeout_s=STALL_TIMEOUT_S)
    for step in result.steps:
        assert step.metrics.failed == 0 and step.metrics.completed > 0, (flags, step.metrics)


def test_data_parallel_replicas_of_a_jit_stalled_config_stream_slowly_never_hang(
        tmp_path: Path) -> None:
    """fp8_per_block's stall runs each busy replica's modelled clock far ahead of the wall (the
    stall is slept time-scaled); a burst member that lands on the other replica was stamped on
    the first one's clock, and that replica used to sleep the whole difference in real time
    (the h200-widened dry run's "stopped producing tokens for 120 s")."""
    flags: dict[str, FlagValue] = {
        "data_parallel_size": 2, "quantization": "fp8_per_block", "stream_interval": 16,
        "long_prefill_token_threshold": 512, "max_model_len": 4096}
    workload = Workload(input_len=LengthDistribution(mean=512),
                        output_len=LengthDistribution(mean=48),
                        shared_prefix=SharedPrefix(fraction=0.8, num_tokens=1024,
                                                   num_prefixes=4),
                        levels=(LoadLevel(max_concurrency=8),), num_requests=16,
                        num_warmup_requests=4, repeats=2, vocab_size=1000,
                        startup_timeout_s=60)
    _run(tmp_path, flags, workload)


def test_a_burst_split_over_replicas_is_stamped_on_one_time_line_without_sleeping_the_gap(
        ) -> None:
    """One request on each replica, then one alone runs replica 0's modelled clock ~14 s
    ahead of replica 1's (32 stalled steps); a burst of two then lands one request on each
    replica. Both are stamped at the same modelled time, and replica 1 does not sleep out the
    14 s it was behind."""
    from runners.simulated.settings import ServerSettings

    async def main() -> tuple[list[float], float]:
        engine = SimulatedEngine(ServerSettings(
            EngineConfig("qwen2.5-0.5b", {"data_parallel_size": 2,
                                          "quantization": "fp8_per_block"}),
            load_preset("h200"), port=0, startup_time_scale=1e-3, noise_sigma=0.0))
        assert await engine.start() is None

        async def drain(first: int, max_tokens: int) -> None:
            async for _ in engine.generate(list(range(first, first + 64)), max_tokens):
                pass

        await asyncio.gather(drain(0, 1), drain(100, 1))  # each replica has served one
        await drain(200, 32)
        ahead_s = engine.replicas[0].clock_s - engine.replicas[1].clock_s
        assert ahead_s > 10, "the stall runs the busy replica's clock ahead"
        arrivals: list[float] = []

        async def one(first: int) -> None:
            async for event in engine.generate(list(range(first, first + 64)), 8,
                                               burst_size=2):
                if event.is_first:
                    arrivals.append(event.request.arrival_s)

        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(asyncio.gather(one(300), one(400)), timeout=30)
        assert [len(r.scheduler.running) for r in engine.replicas] == [0, 0]
        return arrivals, loop.time() - started

    # In virtual time: the engine's sleeps take no wall time, and the loop's clock says how
    # long it would have slept.
    arrivals, slept_s = run_in_virtual_time(main())
    assert len(arrivals) == 2 and abs(arrivals[0] - arrivals[1]) < 1e-6, arrivals
    assert slept_s < 5.0, f"the burst slept {slept_s:.1f} s: a replica slept the gap"


async def _closed_loop(engine: SimulatedEngine, prompts: list[list[int]], concurrency: int,
                       max_tokens: int, stall_s: float) -> int:
    """Drive a started SimulatedEngine as the load generator drives the server: the first
    `concurrency` requests as one burst, then a refill as each ends; fails on `stall_s` of the
    loop's time without a chunk from any request in flight. Returns the tokens received."""
    loop = asyncio.get_running_loop()
    received = [0]
    last_chunk = [loop.time()]
    queue = list(enumerate(prompts))

    async def one(ids: list[int], is_refilled: bool, burst: int) -> None:
        async for event in engine.generate(ids, max_tokens, is_refilled, burst,
                                           num_remaining=len(queue)):
            received[0] += event.num_tokens
            last_chunk[0] = loop.time()

    async def worker() -> None:
        is_refilled = False
        while queue:
            _, ids = queue.pop(0)
            await one(ids, is_refilled, 0 if is_refilled else concurrency)
            is_refilled = True

    async def watchdog() -> None:
        while True:
            await asyncio.sleep(0.05)
            assert loop.time() - last_chunk[0] < stall_s, \
                f"no chunk for {stall_s} s: the simulated engine stopped producing tokens"

    workers: asyncio.Future[list[None]] = asyncio.gather(
        *(worker() for _ in range(concurrency)))
    guard = asyncio.create_task(watchdog())
    try:
        either: list[asyncio.Future[Any]] = [workers, guard]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if guard.done():
            guard.result()  # the stall's AssertionError
        workers.result()
    finally:
        guard.cancel()
        workers.cancel()
    return received[0]


def test_a_sample_of_the_widened_hopper_space_streams_every_level_to_the_end() -> None:
    """30 configs drawn at random (seeded) from search_spaces' hopper space resolved for two
    simulated H200s and the h200-widened study's workload (dummy weights, shared prefix,
    max_model_len 4096) each serve a short closed-loop level to its last token in process, in
    virtual time (a config that sleeps out a stall shows it on the loop's clock)."""
    import optuna

    from optimizer.run.engine_choice import simulated_hardware
    from optimizer.run.space_context import space_context
    from runners.model_info import load_model_info
    from runners.simulated.settings import ServerSettings
    from search_spaces import load_space

    hardware = simulated_hardware("h200", 2)
    workload = Workload(input_len=LengthDistribution(mean=512),
                        output_len=LengthDistribution(mean=128),
                        shared_prefix=SharedPrefix(fraction=0.8, num_tokens=1024,
                                                   num_prefixes=4),
                        levels=(LoadLevel(max_concurrency=64),))
    space, _ = load_space("hopper").resolve(space_context(
        hardware, load_model_info("qwen2.5-7b"), workload, "dummy")).with_fixed(
        {"max_model_len": 4096})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    prefixes = [list(range(p * 1024, (p + 1) * 1024)) for p in range(4)]
    prompts = [prefixes[i % 4] + list(range(10_000 + 512 * i, 10_000 + 512 * (i + 1)))
               for i in range(12)]
    num_served = 0
    for _ in range(30):
        params = space.sample(study.ask())
        if space.token_budget_problem(params) is not None:
            continue  # the optimizer never launches it
        flags = {**space.to_flags(params), "max_model_len": 4096}
        engine = SimulatedEngine(ServerSettings(
            EngineConfig("qwen2.5-7b", flags, load_format="dummy"), hardware, port=0,
            startup_time_scale=1e-5, noise_sigma=0.0))

        async def level(engine: SimulatedEngine = engine) -> int | None:
            if await engine.start() is not None:
                return None  # refused at start (memory, arguments): a failure, not a hang
            try:  # the runner's readiness completion, alone, then the level
                await _closed_loop(engine, prompts[:1], 1, 16, STALL_TIMEOUT_S)
                return await _closed_loop(engine, prompts, 8, 16, STALL_TIMEOUT_S)
            finally:
                for replica in engine.replicas:
                    if replica.task is not None:
                        replica.task.cancel()

        received = run_in_virtual_time(level())
        if received is not None:
            assert received == 16 * len(prompts), (params, received)
            num_served += 1
    assert num_served >= 20, f"only {num_served} of 30 sampled configs started"
