"""Production-shaped workloads: bursty (gamma) arrivals as `vllm bench serve --burstiness`,
shared-prefix prompts and the prefix-cache hit rate the simulated engine reports for them, and
trace replay in time. CPU only; the engine tests run the simulated engine as a real process."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from runners import arrivals
from runners.base import EngineConfig
from runners.load_level import LoadLevel
from runners.loadgen.requests import build_requests
from runners.workload import SLO, LengthDistribution, SharedPrefix, TraceReplay, Workload
from tests.builders import simulated_run


def _gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(np.array([0.0, *offsets]))


def _vllm_gaps(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """vLLM 0.26's draw (vllm/benchmarks/serve.py:463-485) with its global RandomState."""
    np.random.seed(seed)
    theta = 1.0 / (rate * burstiness)
    delays = np.cumsum([np.random.gamma(shape=burstiness, scale=theta) for _ in range(num)])
    delays *= (num / rate) / delays[-1]
    return np.diff(np.array([0.0, *delays]))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_vllms_mean_and_coefficient_of_variation(burstiness: float) -> None:
    num, rate = 20_000, 10.0
    ours = _gaps(arrivals.arrival_offsets_s(num, rate, seed=3, burstiness=burstiness))
    theirs = _vllm_gaps(num, rate, burstiness, seed=3)
    assert ours.sum() == pytest.approx(num / rate), "rescaled: the last arrival at num / rate"
    assert ours.mean() == pytest.approx(theirs.mean(), rel=1e-9)
    cv_ours, cv_theirs = ours.std() / ours.mean(), theirs.std() / theirs.mean()
    assert cv_ours == pytest.approx(1 / math.sqrt(burstiness), rel=0.05), \
        "a gamma of shape k has CV 1/sqrt(k)"
    assert cv_ours == pytest.approx(cv_theirs, rel=0.05)


def test_burstiness_one_is_the_poisson_draw_number_for_number() -> None:
    rng = np.random.default_rng(7)
    poisson = np.cumsum(rng.exponential(1 / 5.0, size=200))
    poisson *= (200 / 5.0) / poisson[-1]
    assert arrivals.arrival_offsets_s(200, 5.0, seed=7, burstiness=1.0) == \
        [float(x) for x in poisson]
    assert arrivals.arrival_offsets_s(200, 5.0, seed=7, burstiness=0.3) == \
        arrivals.arrival_offsets_s(200, 5.0, seed=7, burstiness=0.3), "deterministic in the seed"
    endless = arrivals.open_ended_offsets_s(5.0, seed=7, burstiness=0.3)
    first = [next(endless) for _ in range(50)]
    again = arrivals.open_ended_offsets_s(5.0, seed=7, burstiness=0.3)
    assert first == [next(again) for _ in range(50)]
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrivals.arrival_offsets_s(3, 1.0, seed=0, burstiness=0.0)


def test_shared_prefix_requests_share_exactly_the_prefix_and_keep_their_own_part() -> None:
    shared = SharedPrefix(fraction=0.5, num_tokens=48, num_prefixes=2)
    plain = Workload(input_len=LengthDistribution(mean=20), output_len=LengthDistribution(mean=4),
                     seed=11)
    workload = Workload(input_len=plain.input_len, output_len=plain.output_len, seed=11,
                        shared_prefix=shared)
    unique = build_requests(plain, 40, seed=5)
    specs = build_requests(workload, 40, seed=5)
    prefixes = {tuple(s.prompt[:48]) for s in specs if len(s.prompt) == 68}
    assert len(prefixes) == 2, "two distinct prefixes, each used"
    num_shared = 0
    for spec, alone in zip(specs, unique, strict=True):
        assert isinstance(spec.prompt, list) and isinstance(alone.prompt, list)
        if len(spec.prompt) == 68:
            num_shared += 1
            assert tuple(spec.prompt[:48]) in prefixes
            assert spec.prompt[48:] == alone.prompt, "input_len is the part after the prefix"
            assert spec.prompt_len == 68
        else:
            assert spec.prompt == alone.prompt and spec.prompt_len == 20
    assert num_shared == 20, "exactly floor(n x fraction) requests share"
    assert build_requests(workload, 10, seed=5) == specs[:10], \
        "request i does not depend on how many are built"
    other_level = build_requests(workload, 40, seed=6)
    assert {tuple(s.prompt[:48]) for s in other_level if len(s.prompt) == 68} == prefixes, \
        "every level (and trial) of a study shares the same prefixes"


def _run(tmp_path: Path, workload: Workload, flags: dict[str, object] | None = None):
    config = EngineConfig("qwen2.5-0.5b", {"max_model_len": 4096, **(flags or {})},
                          load_format="dummy", skip_tokenizer_init=True)
    return simulated_run(tmp_path, config, workload)


def _shaped(shared: SharedPrefix | None) -> Workload:
    return Workload(input_len=LengthDistribution(mean=32), output_len=LengthDistribution(mean=4),
                    levels=(LoadLevel(max_concurrency=2),), num_requests=40,
                    num_warmup_requests=0, slo=SLO(tpot_p99_ms=1000.0), shared_prefix=shared)


def test_simulated_hit_rate_follows_the_shared_tokens_and_is_zero_without_sharing(
        tmp_path: Path) -> None:
    shared = SharedPrefix(fraction=0.8, num_tokens=512)
    (step,) = _run(tmp_path / "shared", _shaped(shared)).steps
    hit_rate = step.server_metrics["prefix_cache_hit_rate"]
    # Tokens: 32 requests share 512 prefix tokens (+32 own), 8 send 32. The first request of
    # the prefix (and one beside it at concurrency 2) computes it; the others hit all of it.
    total = 32 * (512 + 32) + 8 * 32
    assert (32 - 2) * 512 / total <= hit_rate <= (32 - 1) * 512 / total + 1e-9, hit_rate
    assert hit_rate > 0.8, "mostly shared tokens: the hit rate is near the shared fraction"

    (plain,) = _run(tmp_path / "plain", _shaped(None)).steps
    assert plain.server_metrics["prefix_cache_hit_rate"] < 0.01, "unique prompts hit nothing"

    (off,) = _run(tmp_path / "off", _shaped(shared), {"enable_prefix_caching": False}).steps
    assert "prefix_cache_hit_rate" not in off.server_metrics, \
        "with prefix caching off vLLM counts no query, so there is no rate"
    assert off.metrics.mean_ttft_ms > step.metrics.mean_ttft_ms, \
        "cached prefixes skip prefill work"


def test_trace_offsets_keep_the_recorded_gaps_and_scale_to_a_mean_rate() -> None:
    times = [10.0, 10.5, 10.6, 12.0, 14.0]  # absolute: replayed from the first arrival
    assert arrivals.trace_offsets_s(times, None) == pytest.approx([0.0, 0.5, 0.6, 2.0, 4.0])
    assert arrivals.trace_rate_rps(times) == pytest.approx(1.0)
    assert arrivals.trace_offsets_s(times, 2.0) == pytest.approx([0.0, 0.25, 0.3, 1.0, 2.0]), \
        "a level's rate is the replay's mean rate: twice as fast"


def test_bad_trace_lines_are_refused_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1, "input_length": 8, "output_length": 2}\n'
                    '{"timestamp": 2, "input_length": 0, "output_length": 2}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: 'input_length' must be an integer >= 1"):
        arrivals.read_trace(path)
    path.write_text('{"timestamp": 1, "input_length": 8, "output_length": 2}\n')
    with pytest.raises(ValueError, match="spanning more than 0 s"):
        arrivals.read_trace(path)


def test_trace_replay_sends_at_the_traces_times_on_the_modelled_clock(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    recorded = [100.0, 100.4, 100.5, 101.5, 101.6, 102.4]  # absolute seconds
    trace.write_text("".join(
        f'{{"timestamp": {t}, "input_length": 16, "output_length": 2}}\n' for t in recorded))
    workload = Workload(output_len=LengthDistribution(mean=2), levels=(LoadLevel(),),
                        num_requests=None, num_warmup_requests=0, slo=SLO(tpot_p99_ms=1000.0),
                        trace=TraceReplay(trace))
    (step,) = _run(tmp_path, workload).steps
    assert step.metrics.completed == len(recorded)
    assert step.server_metrics.get("is_modelled_clock") == 1.0
    # The level's duration on the engine's clock spans the trace (2.4 s) plus the last request
    # (a few ms), within a relative tolerance for the host's scheduling of the sends.
    assert 2.4 * 0.9 <= step.metrics.duration_s <= 2.4 * 1.15, step.metrics.duration_s


def test_trace_timestamps_may_be_strings_and_long_gaps_are_cut_to_max_gap(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    stamps = ["-2", "-2", "-1.5", 3600, "3600.25"]  # relative, a duplicate, an idle hour
    path.write_text("".join(f'{{"timestamp": {json.dumps(t)}, "input_length": 8, '
                            f'"output_length": 2}}\n' for t in stamps))
    assert [e.arrival_s for e in arrivals.read_trace(path)] == \
        pytest.approx([0.0, 0.0, 0.5, 3602.0, 3602.25]), "strings read as vLLM's float(ts)"
    cut = [e.arrival_s for e in arrivals.read_trace(path, max_gap_s=2.0)]
    assert cut == pytest.approx([0.0, 0.0, 0.5, 2.5, 2.75]), "the idle hour replays as 2 s"
    path.write_text('{"timestamp": "soon", "input_length": 8, "output_length": 2}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1: 'timestamp' must be a finite number"):
        arrivals.read_trace(path)
    path.write_text('{"timestamp": 5, "input_length": 8, "output_length": 2}\n'
                    '{"timestamp": 4, "input_length": 8, "output_length": 2}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: .* earlier than .* sort the trace"):
        arrivals.read_trace(path)


def test_a_replay_cut_by_its_time_bound_says_how_much_it_sent_and_at_what_rate(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trace = tmp_path / "trace.jsonl"
    recorded = [0.0, 0.2, 0.4, 3600.0, 3600.2]  # an idle hour after the third request
    trace.write_text("".join(
        f'{{"timestamp": {t}, "input_length": 16, "output_length": 2}}\n' for t in recorded))
    rate = arrivals.trace_rate_rps(recorded)
    workload = Workload(output_len=LengthDistribution(mean=2),
                        levels=(LoadLevel(request_rate_rps=rate),), num_requests=None,
                        duration_s=2.0, num_warmup_requests=0, slo=SLO(tpot_p99_ms=1000.0),
                        trace=TraceReplay(trace))
    (step,) = _run(tmp_path, workload).steps
    assert step.metrics.completed == 3, "no send after the 2 s bound, no wait for the hour"
    server = step.server_metrics
    assert (server["trace_num_replayed"], server["trace_num_requests"]) == (3.0, 5.0)
    assert server["trace_replayed_rate_rps"] == pytest.approx(5.0), \
        "3 requests over 0.4 s: what the cut replay offered, not the whole trace's rate"
    assert "replays a gap of 3600 s" in caplog.text and "max_gap_s" in caplog.text


def test_a_probe_replays_the_traces_first_requests_its_rate_fits_in_its_time_bound() -> None:
    busy_then_quiet = [0.0, 0.1, 0.2, 0.3, 0.4, 10.0, 20.0, 30.0]
    assert arrivals.trace_prefix_len(busy_then_quiet, 4.0, 1.0) == 5, \
        "4 req/s over 1 s: five arrivals, four gaps of 0.25 s"
    assert arrivals.trace_offsets_s(busy_then_quiet[:5], 4.0) == \
        pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert arrivals.trace_prefix_len(busy_then_quiet, 100.0, 1.0) == 8, "all of it fits"
    assert arrivals.trace_prefix_len(busy_then_quiet, 4.0, None) == 8, "no bound: all of it"
    assert arrivals.trace_prefix_len([0.0, 0.0, 0.0, 2.0, 3.0], 1.0, 1.0) == 4, \
        "arrivals at one instant have no rate: the first later one joins them"


def test_a_capacity_probe_over_a_trace_offers_its_rate_in_the_part_it_replays(
        tmp_path: Path) -> None:
    """A probe bounded by `probe_duration_s` replays the trace's first part; the rate the
    bracket states is that part's. Scaling the whole trace to the probe's rate and cutting it
    sent the busy first second at 12 req/s under a label of 4."""
    from runners.capacity.search import CapacitySearch

    trace = tmp_path / "trace.jsonl"
    recorded = [0.1 * k for k in range(10)] + [10.0, 20.0, 30.0, 40.0]  # busy, then quiet
    trace.write_text("".join(
        f'{{"timestamp": {t}, "input_length": 16, "output_length": 2}}\n' for t in recorded))
    search = CapacitySearch("request_rate", low=1.0, high=4.0, max_probes=1,
                            probe_duration_s=1.0)
    workload = Workload(output_len=LengthDistribution(mean=2), num_requests=None,
                        num_warmup_requests=0, slo=SLO(tpot_p99_ms=1000.0),
                        trace=TraceReplay(trace), capacity=search)
    result = _run(tmp_path, workload)
    (probe,) = result.steps
    server = probe.server_metrics
    assert probe.level.request_rate_rps == 4.0 and probe.meets_slo
    assert (server["trace_num_replayed"], server["trace_num_requests"]) == (5.0, 14.0), \
        "the first five requests (four gaps at 4 req/s span the 1 s bound), all sent"
    assert server["trace_replayed_rate_rps"] == pytest.approx(4.0), \
        "the part replayed was offered at the probe's rate"
    assert result.capacity is not None and result.capacity.met_load == 4.0


def test_a_traces_text_prompt_length_is_labelled_recorded_not_counted(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 99, "output_length": 2, '
                    '"prompt": "Four words of text"}\n'
                    '{"timestamp": 1, "input_length": 8, "output_length": 2}\n')
    workload = Workload(trace=TraceReplay(path), num_requests=None)
    text, ids = build_requests(workload, 2, seed=0)
    assert (text.prompt_len, text.is_prompt_len_estimated) == (99, True), \
        "the trace's own input_length, unchecked without a tokenizer: not a count"
    assert not ids.is_prompt_len_estimated, "synthesised token ids are exact"


def test_a_traces_file_is_read_once_however_many_levels_build_its_requests(
        tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2}\n'
                    '{"timestamp": 1, "input_length": 12, "output_length": 3}\n')
    trace = TraceReplay(path)
    workload = Workload(trace=trace, num_requests=None)
    first = build_requests(workload, 2, seed=0)
    path.unlink()  # a second read would fail: the parsed entries travel with the workload
    assert build_requests(workload, 2, seed=0) == first, "the level after reads no file"
    assert [(e.input_len, e.output_len) for e in trace.entries] == [(8, 2), (12, 3)]


def test_a_rate_levels_record_names_the_workloads_burstiness(tmp_path: Path) -> None:
    workload = Workload(input_len=LengthDistribution(mean=16),
                        output_len=LengthDistribution(mean=2),
                        levels=(LoadLevel(request_rate_rps=50.0),), num_requests=8,
                        num_warmup_requests=0, burstiness=0.5, slo=SLO(tpot_p99_ms=1000.0))
    (step,) = _run(tmp_path, workload).steps
    assert step.level.burstiness == 0.5 and step.level.label == "rate=50,burstiness=0.5", \
        "the level was sent gamma(0.5) arrivals: its record says so, not Poisson's rate=50"
