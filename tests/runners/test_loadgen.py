"""Load generator: request building, vLLM's metric definitions on hand-built outputs, and real
streaming runs against the echo engine (a subprocess with known TTFT and TPOT)."""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from runners.arrivals import arrival_offsets_s
from runners.capacity import meets_slo
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.level import STALLED_ERROR, run_level_sync
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.requests import RequestSpec, build_requests, sample_length
from runners.process import EngineProcess, free_port, wait_healthy
from runners.workload import SLO, LengthDistribution, Workload

REPO_ROOT = Path(__file__).resolve().parents[2]
TTFT_MS = 20.0
TPOT_MS = 5.0


# ---------------------------------------------------------------------------------------------
# build_requests


def test_same_seed_gives_identical_requests_and_other_seed_differs() -> None:
    workload = Workload(input_len=LengthDistribution("normal", mean=64, std=16),
                        output_len=LengthDistribution("uniform", mean=32, low=8, high=56))
    first = build_requests(workload, 50, seed=7)
    assert first == build_requests(workload, 50, seed=7), "same seed must give same prompts"
    assert first != build_requests(workload, 50, seed=8), "another seed must give others"


def test_request_i_does_not_depend_on_how_many_are_built() -> None:
    workload = Workload(input_len=LengthDistribution("lognormal", mean=100, std=0.5))
    assert build_requests(workload, 5, seed=3) == build_requests(workload, 20, seed=3)[:5]


def test_synthesised_prompts_are_token_ids_in_vocab_with_their_length() -> None:
    workload = Workload(input_len=LengthDistribution("uniform", mean=40, low=20, high=60),
                        vocab_size=100)
    for spec in build_requests(workload, 30, seed=0):
        assert isinstance(spec.prompt, list)
        assert len(spec.prompt) == spec.prompt_len
        assert all(10 <= t < 100 for t in spec.prompt), "ids must skip specials, stay in vocab"
        assert 20 <= spec.prompt_len <= 60


def test_fixed_lengths_are_exact() -> None:
    workload = Workload(input_len=LengthDistribution(mean=17),
                        output_len=LengthDistribution(mean=9))
    specs = build_requests(workload, 10, seed=1)
    assert {(s.prompt_len, s.output_len) for s in specs} == {(17, 9)}


@pytest.mark.parametrize("kind", ["normal", "lognormal"])
def test_wide_distributions_are_clipped_to_low_and_high(kind: str) -> None:
    std = 1000.0 if kind == "normal" else 2.0
    dist = LengthDistribution(kind, mean=100, std=std, low=50, high=150)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    lengths = [sample_length(dist, rng) for _ in range(2000)]
    assert min(lengths) == 50 and max(lengths) == 150, "clip bounds must be reached, not passed"


def test_lengths_are_at_least_one_without_a_low_bound() -> None:
    dist = LengthDistribution("normal", mean=2, std=50)
    rng = np.random.default_rng(0)
    assert min(sample_length(dist, rng) for _ in range(500)) == 1


def test_uniform_without_bounds_is_centred_on_the_mean() -> None:
    rng = np.random.default_rng(0)
    lengths = [sample_length(LengthDistribution("uniform", mean=100), rng) for _ in range(4000)]
    assert min(lengths) >= 1 and max(lengths) <= 199
    assert statistics.mean(lengths) == pytest.approx(100, rel=0.03)


def test_lognormal_keeps_the_configured_mean() -> None:
    rng = np.random.default_rng(0)
    dist = LengthDistribution("lognormal", mean=200, std=0.6)
    lengths = [sample_length(dist, rng) for _ in range(20000)]
    assert statistics.mean(lengths) == pytest.approx(200, rel=0.03)


def test_low_above_high_is_refused() -> None:
    workload = Workload(input_len=LengthDistribution("uniform", mean=10, low=20, high=5))
    with pytest.raises(ValueError, match="input_len"):
        build_requests(workload, 1, seed=0)


def test_prompts_file_is_cycled_and_missing_output_len_is_sampled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "one two three four five six seven eight", "output_len": 4})
        + "\n\n" + json.dumps({"prompt": [11, 12, 13]}) + "\n",
        encoding="utf-8",
    )
    workload = Workload(prompts_file=path, output_len=LengthDistribution(mean=7))
    specs = build_requests(workload, 5, seed=0)
    assert [s.output_len for s in specs] == [4, 7, 4, 7, 4]
    assert specs[1] == RequestSpec(prompt=[11, 12, 13], prompt_len=3, output_len=7)
    assert specs[2] == specs[0] and isinstance(specs[0].prompt, str)
    assert specs[0].prompt_len >= 1
    assert "5 requests from 2 distinct prompts, cycled" in caplog.text, \
        "repeats are served from the prefix cache: the log says the prompts were cycled"


def test_bad_prompts_file_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:2"):
        build_requests(Workload(prompts_file=path), 2, seed=0)


def test_arrival_offsets_are_seeded_and_end_at_num_over_rate() -> None:
    offsets = arrival_offsets_s(100, 20.0, seed=5)
    assert offsets == arrival_offsets_s(100, 20.0, seed=5)
    assert offsets[-1] == pytest.approx(100 / 20.0), "vLLM rescales the last arrival to n/rate"
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    assert arrival_offsets_s(3, None, seed=5) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# compute_metrics, on hand-built outputs with numbers worked out by hand

OUTPUTS = [
    RequestOutput(success=True, ttft_s=0.1, itl_s=(0.02, 0.03), latency_s=0.15, prompt_len=10,
                  output_tokens=3),
    RequestOutput(success=True, ttft_s=0.2, itl_s=(), latency_s=0.2, prompt_len=20,
                  output_tokens=1),
    RequestOutput(success=False, error="HTTP 500: boom", prompt_len=30),
]


def test_compute_metrics_matches_vllm_definitions() -> None:
    m = compute_metrics(OUTPUTS, 2.0, SLO(), max_concurrency_seen=2)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 4), "failed requests excluded"
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.0)
    assert m.total_token_throughput == pytest.approx(17.0)
    assert m.request_goodput is None, "no SLO, no goodput"
    # TTFT over [0.1, 0.2] s.
    assert m.mean_ttft_ms == pytest.approx(150.0)
    assert m.median_ttft_ms == pytest.approx(150.0)
    assert m.std_ttft_ms == pytest.approx(50.0)
    assert m.p90_ttft_ms == pytest.approx(190.0)
    assert m.p99_ttft_ms == pytest.approx(199.0)
    # TPOT only for output_tokens > 1: (0.15 - 0.1) / 2.
    assert m.mean_tpot_ms == pytest.approx(25.0)
    assert m.std_tpot_ms == pytest.approx(0.0)
    assert m.p99_tpot_ms == pytest.approx(25.0)
    # ITLs concatenated: [0.02, 0.03].
    assert m.mean_itl_ms == pytest.approx(25.0)
    assert m.std_itl_ms == pytest.approx(5.0)
    # E2EL over [0.15, 0.2].
    assert m.mean_e2el_ms == pytest.approx(175.0)
    assert m.p90_e2el_ms == pytest.approx(195.0)
    assert m.p99_e2el_ms == pytest.approx(199.5)
    assert m.max_concurrency_seen == 2
    assert (m.num_tpot_samples, m.num_itl_samples) == (1, 2), "what TPOT and ITL are over"
    assert m.duration_s == 2.0


@pytest.mark.parametrize(("slo", "expected_rps"), [
    (SLO(ttft_p99_ms=150, tpot_p99_ms=30), 0.5),  # the second misses TTFT
    (SLO(tpot_p99_ms=20), 0.5),  # the first misses TPOT; a one-token request has TPOT 0
    (SLO(e2el_ms=160), 0.5),
    (SLO(ttft_p99_ms=1000, tpot_p99_ms=1000, e2el_ms=1000), 1.0),
    (SLO(ttft_p99_ms=1), 0.0),
])
def test_goodput_counts_requests_meeting_every_set_bound(slo: SLO, expected_rps: float) -> None:
    assert compute_metrics(OUTPUTS, 2.0, slo).request_goodput == pytest.approx(expected_rps)


def test_no_successes_leaves_latencies_out_rather_than_zero() -> None:
    m = compute_metrics([OUTPUTS[2]], 1.0, SLO(ttft_p99_ms=100))
    assert (m.completed, m.failed, m.request_goodput) == (0, 1, 0.0)
    assert all(np.isfinite(v) for v in m.as_dict().values()), "no nan reaches the record"
    assert m.p99_ttft_ms is None and m.mean_itl_ms is None and m.p99_e2el_ms is None, \
        "vLLM's `or 0` would report 0 ms: a figure nobody measured"
    assert "p99_ttft_ms" not in m.as_dict()


def test_one_token_outputs_have_no_tpot_or_itl_but_meet_a_tpot_slo() -> None:
    one = [RequestOutput(success=True, ttft_s=0.1, latency_s=0.1, prompt_len=5,
                         output_tokens=1),
           RequestOutput(success=True, ttft_s=0.3, latency_s=0.3, prompt_len=5,
                         output_tokens=1)]
    m = compute_metrics(one, 2.0, SLO(ttft_p99_ms=200, tpot_p99_ms=10))
    assert m.p99_tpot_ms is None and m.mean_tpot_ms is None, "TPOT is undefined, not 0 ms"
    assert (m.num_tpot_samples, m.num_itl_samples) == (0, 0)
    assert m.p99_itl_ms is None, "no second token: no inter-token latency"
    assert not {"p99_tpot_ms", "mean_itl_ms"} & set(m.as_dict()), "left out of the record"
    # TTFT p99 over [0.1, 0.3] s by linear interpolation: 0.1 + 0.99 x 0.2 = 0.298 s.
    assert m.p99_ttft_ms == pytest.approx(298.0)
    assert m.request_goodput == pytest.approx(0.5), \
        "the first meets TTFT and (vacuously, TPOT 0 as in vLLM) TPOT; the second misses TTFT"
    assert meets_slo(m, SLO(tpot_p99_ms=10), 0.0), "no TPOT sample violates a TPOT bound"
    assert not meets_slo(m, SLO(ttft_p99_ms=200), 0.0)


def test_success_without_token_count_counts_one_token() -> None:
    out = RequestOutput(success=True, ttft_s=0.1, latency_s=0.1, prompt_len=5, output_tokens=0)
    assert compute_metrics([out], 1.0, SLO()).total_output_tokens == 1


def test_zero_duration_is_refused() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(OUTPUTS, 0.0, SLO())


# ---------------------------------------------------------------------------------------------
# Real runs against the echo engine


# The echo engine runs on the wall clock: these tests hold the load generator's figures to its
# latencies within tens of milliseconds, which a host stall (the suite's other worker, an engine
# starting) can exceed once. A stall is retried (pytest-rerunfailures); a wrong measurement
# fails every run.
WALL_CLOCK = pytest.mark.flaky(reruns=2, reruns_delay=1)


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("echo")
    port = free_port()
    proc = EngineProcess.start(
        [sys.executable, "-m", "tests.runners.echo_engine", "--port", str(port),
         "--ttft-ms", str(TTFT_MS), "--tpot-ms", str(TPOT_MS)],
        {"PYTHONPATH": str(REPO_ROOT)}, workdir / "echo.log", workdir / "registry",
    )
    with proc:
        base_url = f"http://127.0.0.1:{port}"
        state = wait_healthy(base_url, proc, timeout_s=30, poll_s=0.1)
        assert state == "ready", (workdir / "echo.log").read_text()
        yield base_url


def _specs(num: int, output_len: int, prompt_len: int = 8) -> list[RequestSpec]:
    return [RequestSpec(prompt=list(range(10, 10 + prompt_len)), prompt_len=prompt_len,
                        output_len=output_len) for _ in range(num)]


@WALL_CLOCK
def test_measured_latencies_match_the_servers(echo_url: str) -> None:
    result = run_level_sync(echo_url, "echo", _specs(16, 20), LoadLevel(max_concurrency=4),
                            SLO(), timeout_s=30, seed=0)
    m = result.metrics
    assert (m.completed, m.failed) == (16, 0), [o.error for o in result.outputs]
    assert m.total_output_tokens == 16 * 20
    assert m.total_input_tokens == 16 * 8
    assert TTFT_MS * 0.9 <= m.median_ttft_ms <= TTFT_MS + 30, m.median_ttft_ms
    assert TPOT_MS * 0.8 <= m.mean_tpot_ms <= TPOT_MS + 3, m.mean_tpot_ms
    assert TPOT_MS * 0.5 <= m.median_itl_ms <= TPOT_MS + 3, m.median_itl_ms
    assert all(len(o.itl_s) == 19 for o in result.outputs), "one ITL per chunk after the first"
    expected_e2el = TTFT_MS + 19 * TPOT_MS
    assert expected_e2el * 0.9 <= m.mean_e2el_ms <= expected_e2el + 40, m.mean_e2el_ms
    assert m.request_throughput > 0 and not result.stalled and not result.stopped


@WALL_CLOCK
def test_tokens_are_counted_from_usage_when_chunks_carry_several(echo_url: str) -> None:
    result = run_level_sync(echo_url, "chunked", _specs(2, 9), LoadLevel(), SLO(),
                            timeout_s=30, seed=0)
    for out in result.outputs:
        assert out.success, out.error
        assert out.output_tokens == 9, "usage.completion_tokens, not the 3 chunks"
        assert len(out.itl_s) == 2
    # TPOT divides by tokens, not chunks: the 2 chunk gaps of 3 * 5 ms over 9 - 1 tokens is
    # 3.75 ms (counting chunks would give 15 ms).
    expected_tpot_ms = 2 * 3 * TPOT_MS / 8
    assert expected_tpot_ms * 0.9 <= result.metrics.mean_tpot_ms <= expected_tpot_ms + 3


def test_a_stream_cut_off_fails_and_one_without_usage_counts_max_tokens(echo_url: str) -> None:
    cut = run_level_sync(echo_url, "cut", _specs(2, 8), LoadLevel(), SLO(), timeout_s=30,
                         seed=0)
    assert cut.metrics.completed == 0 and cut.metrics.failed == 2, \
        "4 of 8 tokens and no finish_reason, usage or [DONE]: not a success"
    assert "cut off" in cut.outputs[0].error
    bare = run_level_sync(echo_url, "chunked-nousage", _specs(1, 9), LoadLevel(), SLO(),
                          timeout_s=30, seed=0)
    (out,) = bare.outputs
    assert out.success and out.output_tokens == 9, \
        "finish_reason 'length' with ignore_eos: max_tokens tokens, not the 3 chunks"


@WALL_CLOCK
def test_goodput_against_real_latencies(echo_url: str) -> None:
    level, specs = LoadLevel(max_concurrency=8), _specs(8, 10)
    loose = run_level_sync(echo_url, "echo", specs, level, SLO(ttft_p99_ms=2000,
                           tpot_p99_ms=200), timeout_s=30, seed=0).metrics
    assert loose.request_goodput == pytest.approx(loose.request_throughput)
    tight = run_level_sync(echo_url, "echo", specs, level, SLO(tpot_p99_ms=1),
                           timeout_s=30, seed=0).metrics
    assert tight.request_goodput == 0.0, "no request streams faster than 1 ms a token"


@WALL_CLOCK
def test_poisson_arrivals_follow_the_rate(echo_url: str) -> None:
    rate, num = 50.0, 100
    result = run_level_sync(echo_url, "echo", _specs(num, 2), LoadLevel(request_rate_rps=rate),
                            SLO(), timeout_s=30, seed=1)
    starts = sorted(o.start_time for o in result.outputs)
    gaps = np.diff(starts)
    assert result.metrics.completed == num
    assert starts[-1] - starts[0] == pytest.approx(num / rate, rel=0.15)
    # Exponential gaps have a coefficient of variation of 1; a fixed rate would have ~0.
    assert 0.6 <= float(np.std(gaps) / np.mean(gaps)) <= 1.4


@WALL_CLOCK
def test_duration_bound_level_cycles_requests_and_stops_issuing(echo_url: str) -> None:
    rate, duration = 40.0, 1.0
    started = time.perf_counter()
    result = run_level_sync(echo_url, "echo", _specs(3, 2), LoadLevel(request_rate_rps=rate),
                            SLO(), timeout_s=30, seed=2, duration_s=duration)
    num = len(result.outputs)
    assert 15 <= num <= 70, f"about rate * duration = 40 requests, got {num}"
    assert max(o.start_time for o in result.outputs) - started <= duration + 0.1
    assert result.metrics.failed == 0


def test_concurrency_cap_is_respected(echo_url: str) -> None:
    httpx.delete(f"{echo_url}/stats")
    result = run_level_sync(echo_url, "echo", _specs(15, 10), LoadLevel(max_concurrency=3),
                            SLO(), timeout_s=30, seed=0)
    assert result.metrics.max_concurrency_seen == 3, "all at once, capped at 3"
    server_max = httpx.get(f"{echo_url}/stats").json()["max_in_flight"]
    assert server_max <= 3, f"the server saw {server_max} streams at once with a cap of 3"
    assert result.metrics.completed == 15


def test_http_errors_are_counted_as_failures_not_raised(echo_url: str) -> None:
    result = run_level_sync(echo_url, "error", _specs(4, 5), LoadLevel(), SLO(ttft_p99_ms=100),
                            timeout_s=30, seed=0)
    assert (result.metrics.completed, result.metrics.failed) == (0, 4)
    assert all(o.error.startswith("HTTP 500") and "injected failure" in o.error
               for o in result.outputs)
    assert result.metrics.request_goodput == 0.0


def test_unreachable_server_gives_failed_requests() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = run_level_sync(url, "echo", _specs(2, 5), LoadLevel(), SLO(), timeout_s=5, seed=0)
    assert result.metrics.failed == 2
    assert all("ConnectError" in o.error for o in result.outputs)


def test_hung_stream_is_detected_as_a_stall(echo_url: str) -> None:
    started = time.perf_counter()
    result = run_level_sync(echo_url, "hang", _specs(4, 5), LoadLevel(max_concurrency=2), SLO(),
                            timeout_s=600, seed=0, stall_timeout_s=0.5)
    assert result.stalled and not result.stopped
    assert [o.error for o in result.outputs] == [STALLED_ERROR] * 2, (
        "the two in flight are cancelled; the two behind the cap are never sent")
    assert time.perf_counter() - started < 5


def test_request_timeout_fails_the_request(echo_url: str) -> None:
    result = run_level_sync(echo_url, "hang", _specs(1, 5), LoadLevel(), SLO(), timeout_s=0.5,
                            seed=0)
    assert not result.stalled
    assert "no complete response within 0.5 s" in result.outputs[0].error


def test_stop_event_from_another_thread_ends_the_level(echo_url: str) -> None:
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.perf_counter()
    try:
        result = run_level_sync(echo_url, "echo", _specs(100, 50),
                                LoadLevel(request_rate_rps=10), SLO(), timeout_s=30, seed=0,
                                stop_event=stop)
    finally:
        timer.cancel()
    assert result.stopped and not result.stalled
    assert time.perf_counter() - started < 3, "stopping must not wait for the whole schedule"
    assert len(result.outputs) < 100
