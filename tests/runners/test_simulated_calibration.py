"""The simulated engine against every committed H200 measurement of a bundled model shape (the
calibration set tests/fixtures/h200_calibration.json, built by bench/h200_calibration.py; the
SmolLM2 quality-gate run is outside it, docs/simulated-engine.md): each record replayed
through the model's virtual-time path with its config and workload, each figure held to a stated
tolerance, and per study the measured order of configs and the sign of each knob's effect.
Tolerances and what the model does not cover: docs/simulated-engine.md ("Calibration against
the H200 records")."""

from __future__ import annotations

import functools
import itertools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runners import prefixes
from runners.base import EngineConfig
from runners.hardware import load_preset
from runners.simulated.benchmark import BenchmarkEstimate, simulate_benchmark
from runners.simulated.performance import PerformanceModel
from runners.workload import SharedPrefix

FIXTURE = Path(__file__).parents[1] / "fixtures" / "h200_calibration.json"
RECORDS: list[dict[str, Any]] = json.loads(FIXTURE.read_text())["records"]
MAX_REPLAYED_REQUESTS = 192  # closed-loop steady state is reached well before; keeps it fast

# Relative tolerance per figure, where the model covers it.
TOLERANCE = {"output_throughput": 0.20, "request_throughput": 0.20, "request_goodput": 0.20,
             "median_tpot_ms": 0.25, "p99_tpot_ms": 0.25, "median_ttft_ms": 0.25,
             "p99_ttft_ms": 0.45}
# (record id pattern, figures, reason): what the model does not cover, each listed in the docs.
NOT_COVERED: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (r"h200-prefill/t0/s[4-7].*|h200-prefill/t1/s0.*",
     ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "request_goodput"),
     "open-loop levels at or past the capacity knee: a few % of prefill throughput decides "
     "whether the queue grows, so latencies there are not predicted"),
    (r"h200-prefill/t1/s0.*", ("output_throughput", "request_throughput"),
     "fp8 weights + fp8 KV on 1000-3000-token prompts at 32 req/s: the model's capacity is "
     "~20% under the measured one (it queues, -22% throughput); its prefill is too slow there"),
    (r"h200-prefill/t0/s[12].*", ("p99_tpot_ms", "p99_ttft_ms"),
     "p99 over 40-80 requests at light open-loop load: one prefill landing in a decode"),
    (r"h200-decode/.*-c(100|107|132|165)", ("request_goodput",),
     "the measured TPOT p99 sits within 10% of the SLO bound: goodput is a knife edge"),
    (r"h200-decode/t1/s0-c256", ("output_throughput", "request_throughput", "p99_tpot_ms"),
     "fp8 weights at 256 concurrent: the measured throughput fell below the 124-concurrent "
     "level's (11.1k vs 13.0k tok/s); the model's keeps rising (+27%)"),
    (r"study1/.*", ("p99_ttft_ms",),
     "eager runs at 64 concurrent: TTFT p99 -20 to -40%, with the waves above"),
    (r"h200-(widened/t3|knobs/t1)/.*", ("request_goodput",),
     "prefix caching off on the shared-prefix load: goodput near zero (1.7 and 3.3 req/s in "
     "two sessions, 1.9x apart) counts the few requests under the TPOT bound"),
    (r"h200-widened/t4/.*", tuple(TOLERANCE),
     "fp8_per_block with nine other changes: its JIT stall is modelled as measured on another "
     "load (0.45 s a step); here TPOT p50 was 9.6 ms, p99 149 ms, the repeats 19-79% apart"),
    (r"h200-knobs/t6/.*", tuple(TOLERANCE),
     "PIECEWISE CUDA graphs: unstable (goodput 11.7 and 0 in its two repeats); the model "
     "does not cost attention launched between graph pieces on decode steps (TPOT p50 +34% "
     "measured, unchanged modelled)"),
    (r"h200-knobs/t3/.*", ("request_goodput",),
     "stream_interval 16: 0.91x the defaults' goodput with TPOT p50 +1%; vLLM applies the "
     "interval in the API server, off the engine's step, and the model leaves the step as it "
     "is: what cost the 9% is not modelled"),
    (r"h200-widened/t1/.*", ("p99_ttft_ms",),
     "fp8 weights + fp8 KV with a 32768-token budget prefill a 64-request wave in one step; "
     "the model's is slower (TTFT p99 +49%), as on the prefill study (capacity -20%)"),
)


# TTFT p50 of a closed loop in waves (below): the wave a request lands in decides it.
WAVES_TTFT_P50_TOLERANCE = 0.70


def _is_in_waves(record: dict[str, Any]) -> bool:
    """A closed loop whose prompts in flight exceed one step's token budget: its requests
    arrive and prefill in waves, and where a request falls in its wave decides its TTFT; the
    model's TTFT p50 is within 26% on most such records and within
    WAVES_TTFT_P50_TOLERANCE on all (docs/simulated-engine.md)."""
    work = record["workload"]
    levels = work.get("max_concurrency")
    if work.get("request_rate_rps") is not None or levels is None:
        return False
    concurrency = max(levels) if isinstance(levels, list) else levels
    length = work["input_len"]
    mean_input = length if isinstance(length, int) else (length["low"] + length["high"]) / 2
    shared = work.get("shared_prefix")
    if shared:  # input_len is the part after the prefix
        mean_input += shared["fraction"] * shared["tokens"]
    budget = record["flags"].get("max_num_batched_tokens", 8192)
    return bool(concurrency * mean_input > budget)


def _tolerance(record: dict[str, Any], figure: str) -> float:
    if figure == "median_ttft_ms" and _is_in_waves(record):
        return WAVES_TTFT_P50_TOLERANCE
    return TOLERANCE[figure]


def _is_covered(record: dict[str, Any], figure: str) -> bool:
    return not any(re.fullmatch(pattern, record["id"]) and figure in figures
                   for pattern, figures, _ in NOT_COVERED)


@functools.cache
def _model(model: str, flags_json: str) -> PerformanceModel:
    config = EngineConfig(model=model, flags=json.loads(flags_json))
    return PerformanceModel.from_config(config, load_preset("h200"))


def _shared_prefix_prompts(work: dict[str, Any], num: int) -> list[list[int]]:
    """Token-id prompts of a shared-prefix load: which request starts with which prefix is the
    load generator's own plan (runners/prefixes.py, the study's seed); the ids themselves are
    random, as the load generator's are, and only their sharing matters to the model."""
    spec = work["shared_prefix"]
    shared = SharedPrefix(fraction=spec["fraction"], num_tokens=spec["tokens"],
                          num_prefixes=spec["num_prefixes"])
    rng = np.random.default_rng(work.get("seed", 0))

    def make(num_tokens: int, generator: np.random.Generator) -> list[int]:
        ids: list[int] = generator.integers(1000, 150_000, size=num_tokens).tolist()
        return ids

    tails = [make(work["input_len"], rng) for _ in range(num)]
    joined = prefixes.apply_shared_prefix(tails, shared, work.get("seed", 0), make)
    return [prompt for prompt, _ in joined]


def _replay(record: dict[str, Any], concurrency: int | None) -> BenchmarkEstimate:
    work, measured, slo = record["workload"], record["measured"], record["slo"] or {}
    rate = work.get("request_rate_rps")
    if rate is not None and "duration_s" in measured:
        # A time-bound probe: the rate its requests actually arrived at over its window.
        window_s = measured["duration_s"] - measured["mean_e2el_ms"] / 1e3
        rate = min(rate, work["num_requests"] / window_s)
    length = work["input_len"]
    num_requests = min(work["num_requests"], max(MAX_REPLAYED_REQUESTS, 2 * (concurrency or 0)))
    return simulate_benchmark(
        _model(record["model"], json.dumps(record["flags"], sort_keys=True)),
        input_len=length if isinstance(length, int) else 0,
        input_len_range=(length["low"], length["high"]) if isinstance(length, dict) else None,
        prompts=_shared_prefix_prompts(work, num_requests) if work.get("shared_prefix")
        else None,
        output_len=work["output_len"], max_concurrency=concurrency, num_requests=num_requests,
        request_rate_rps=rate, slo_ttft_p99_ms=slo.get("ttft_p99_ms"),
        slo_tpot_p99_ms=slo.get("tpot_p99_ms"))


@functools.cache
def replay(record_id: str) -> BenchmarkEstimate:
    record = next(r for r in RECORDS if r["id"] == record_id)
    levels = record["workload"].get("max_concurrency")
    runs = [_replay(record, c) for c in (levels if isinstance(levels, list) else [levels])]
    return max(runs, key=lambda e: e.request_goodput or 0.0)  # "the better level"


RUNNABLE = [r for r in RECORDS if "failure" not in r]


@pytest.mark.parametrize("record", RUNNABLE, ids=[r["id"] for r in RUNNABLE])
def test_model_reproduces_each_h200_record_within_its_stated_tolerance(record):
    estimate = replay(record["id"])
    misses = []
    for figure, value in record["measured"].items():
        if figure not in TOLERANCE or not _is_covered(record, figure):
            continue
        modelled = getattr(estimate, figure)
        if value == 0:  # goodput 0: every request missed the SLO; the model must agree
            if modelled > 0.05 * estimate.request_throughput:
                misses.append(f"{figure}: measured 0, modelled {modelled:.3g}")
            continue
        error = modelled / value - 1
        if abs(error) > _tolerance(record, figure):
            misses.append(f"{figure}: measured {value:.4g}, modelled {modelled:.4g} "
                          f"({error:+.0%}, tolerance {_tolerance(record, figure):.0%})")
    assert not misses, f"{record['id']} ({record['source']}): " + "; ".join(misses)


FAILING = [r for r in RECORDS if "failure" in r]


@pytest.mark.parametrize("record", FAILING, ids=[r["id"] for r in FAILING])
def test_model_fails_each_config_that_failed_on_the_h200_with_the_same_reason(record):
    model = _model(record["model"], json.dumps(record["flags"], sort_keys=True))
    failure = model.check()
    assert failure is not None and failure.reason.value == record["failure"]


def test_model_start_up_of_the_jit_while_serving_path_is_as_measured():
    record = next(r for r in RECORDS if r["id"] == "startup/fp8_per_block/r2")
    modelled = _model(record["model"], json.dumps(record["flags"], sort_keys=True))
    plain = _model(record["model"], json.dumps({"max_model_len": 4096}))
    assert modelled.startup().total_s == pytest.approx(record["startup_s"], rel=0.25)
    # Measured: 306 s against 153 s for the first plain start of the same shape.
    assert modelled.startup().total_s - plain.startup().total_s == pytest.approx(153, rel=0.1)


NOISE = 0.05  # configs measured closer than this are ties (run-to-run spread on the H200)
# Records left out of the order and sign checks, with why (listed in the docs too).
CONTRADICTED = {
    "probe/kv-fp8/c64": "its -8% throughput against the defaults was not reproduced by studies "
                        "2 and 4 (-1%, +1%); the model follows the later two",
    "h200-knobs/t6/s0-c64": "PIECEWISE graphs: unstable (goodput 11.7 and 0 in two repeats); "
                            "the model leaves decode steps as they are",
    "h200-knobs/t3/s0-c64": "stream_interval 16's -9% goodput: the model leaves the engine's "
                            "step as it is (vLLM applies the interval in the API server)",
}
# One-knob moves the model does not reproduce, (base, changed): figure and why.
UNEXPLAINED_MOVES = {
    ("study1/t2/c64", "study1/t3/c64"): (
        "median_tpot_ms", "a 2048-token budget's -9% TPOT on eager fp8 + fp8 KV: the measured "
        "19.6 ms is under the model's launch-bound eager fp8 decode step (~21.6 ms)"),
}


def _comparable_groups() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records of one study at one load level (same workload), keyed by (study, load)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in RUNNABLE:
        if record["id"] in CONTRADICTED:
            continue
        work = record["workload"]
        if record["study"].startswith("h200-decode") or record["study"] == "h200-prefill":
            continue  # capacity probes: each trial ran its own loads, no shared level
        load = json.dumps([work.get("max_concurrency"), work.get("request_rate_rps")])
        groups.setdefault((record["study"], load), []).append(record)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _objective(record: dict[str, Any]) -> str:
    measured = record["measured"]
    if measured.get("request_goodput"):
        return "request_goodput"
    return "output_throughput"


@pytest.mark.parametrize("group", sorted(_comparable_groups()), ids=str)
def test_model_orders_each_studys_configs_as_measured_beyond_noise(group):
    """Every pair of configs measured more than 5% apart is ordered the same by the model."""
    records = _comparable_groups()[group]
    wrong = []
    for a, b in itertools.combinations(records, 2):
        figure = _objective(a)
        if figure not in b["measured"] or figure not in a["measured"]:
            continue
        ma, mb = a["measured"][figure], b["measured"][figure]
        if abs(ma - mb) <= NOISE * max(ma, mb):
            continue
        sa, sb = getattr(replay(a["id"]), figure), getattr(replay(b["id"]), figure)
        if (ma > mb) != (sa > sb):
            wrong.append(f"{a['id']} vs {b['id']}: measured {ma:.4g} vs {mb:.4g}, "
                         f"modelled {sa:.4g} vs {sb:.4g}")
    assert not wrong, "; ".join(wrong)


def _one_knob_pairs() -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    pairs = []
    for records in _comparable_groups().values():
        for a, b in itertools.permutations(records, 2):
            fa, fb = a["flags"], b["flags"]
            changed = {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}
            if len(changed) == 1 and not fa.keys() - fb.keys() and fb.keys() - fa.keys():
                pairs.append((a, b, changed.pop()))
    return pairs


@pytest.mark.parametrize("pair", _one_knob_pairs(),
                         ids=[f"{a['id']}+{k}" for a, _, k in _one_knob_pairs()])
def test_model_gives_each_knobs_effect_the_measured_sign(pair):
    """Adding one knob to a config moves output throughput and TPOT p50 the way it measured,
    wherever the measured move is beyond noise."""
    base, changed, knob = pair
    unexplained = UNEXPLAINED_MOVES.get((base["id"], changed["id"]), ("", ""))[0]
    for figure in ("output_throughput", "median_tpot_ms"):
        if figure not in base["measured"] or figure not in changed["measured"] \
                or figure == unexplained:
            continue
        mb, mc = base["measured"][figure], changed["measured"][figure]
        if abs(mc - mb) <= NOISE * max(mb, mc):
            continue
        sb, sc = getattr(replay(base["id"]), figure), getattr(replay(changed["id"]), figure)
        assert (mc > mb) == (sc > sb), (
            f"{knob} on {base['id']} -> {changed['id']}: {figure} measured {mb:.4g} -> "
            f"{mc:.4g}, modelled {sb:.4g} -> {sc:.4g}")
