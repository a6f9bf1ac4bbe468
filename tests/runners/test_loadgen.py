"""Load generator: request building, vLLM's metric definitions on hand-built outputs, and real
streaming runs against the echo engine (a subprocess with known TTFT and TPOT)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from runners.arrivals import arrival_offsets_s
from runners.capacity.slo import meets_slo
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput, send_request
from runners.loadgen.level import run_level_sync
from runners.loadgen.level_driver import STALLED_ERROR, STOPPED_ERROR
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.requests import RequestSpec, build_requests, sample_length
from runners.process import free_port
from runners.workload import SLO, LengthDistribution, Workload
from tests.builders import echo_engine

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
    # Exponential gaps have a coefficient of variation of 1; a fixed rate would have ~0.
    gaps = np.diff([0.0, *offsets])
    assert 0.6 <= float(np.std(gaps) / np.mean(gaps)) <= 1.4


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


# The echo engine runs on the wall clock, which a busy host stretches: a request's timing
# arithmetic is checked on a scripted clock (`send_request(clock=...)`, over the real stream),
# and whole levels only on what no host can change: counts, order, and that no figure is below
# the server's own schedule.


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with echo_engine(tmp_path_factory.mktemp("echo"), ttft_ms=TTFT_MS, tpot_ms=TPOT_MS) as url:
        yield url


def _specs(num: int, output_len: int, prompt_len: int = 8) -> list[RequestSpec]:
    return [RequestSpec(prompt=list(range(10, 10 + prompt_len)), prompt_len=prompt_len,
                        output_len=output_len) for _ in range(num)]


def scripted_clock(*times_s: float) -> Callable[[], float]:
    """A clock that reads `times_s` in turn, then the last for ever: `send_request` reads it as
    it sends, then as each SSE data line arrives (the usage line reads the last time)."""
    readings = itertools.chain(times_s, itertools.repeat(times_s[-1]))
    return lambda: next(readings)


def _send(url: str, model: str, spec: RequestSpec, clock: Callable[[], float]) -> RequestOutput:
    async def send() -> RequestOutput:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await send_request(client, url, model, spec, 30, clock=clock)

    return asyncio.run(send())


def test_a_requests_latencies_are_read_from_its_send_to_each_chunk(echo_url: str) -> None:
    # The send at 0, the first token at 20 ms, then one every 5 ms: 20 tokens end at 115 ms.
    ttft_s, tpot_s = TTFT_MS / 1000, TPOT_MS / 1000
    clock = scripted_clock(0.0, *(ttft_s + i * tpot_s for i in range(20)))
    out = _send(echo_url, "echo", _specs(1, 20)[0], clock)
    assert out.success, out.error
    assert (out.output_tokens, out.prompt_len) == (20, 8)
    assert out.ttft_s == pytest.approx(ttft_s), "TTFT: from the send to the first token"
    assert out.itl_s == pytest.approx((tpot_s,) * 19), "one ITL per chunk after the first"
    assert out.latency_s == pytest.approx(ttft_s + 19 * tpot_s), "E2EL: to the last token"
    m = compute_metrics([out, out], 1.0, SLO(tpot_p99_ms=TPOT_MS + 0.5))
    assert m.mean_tpot_ms == pytest.approx(TPOT_MS) and m.median_itl_ms == pytest.approx(TPOT_MS)
    assert m.request_goodput == pytest.approx(m.request_throughput), "5 ms meets a 5.5 ms SLO"
    tight = compute_metrics([out, out], 1.0, SLO(tpot_p99_ms=TPOT_MS - 0.5))
    assert tight.request_goodput == 0.0, "and misses a 4.5 ms one"


def test_tokens_are_counted_from_usage_when_chunks_carry_several(echo_url: str) -> None:
    # 9 tokens in 3 chunks of 3, 15 ms apart.
    clock = scripted_clock(0.0, 0.020, 0.035, 0.050)
    out = _send(echo_url, "chunked", _specs(1, 9)[0], clock)
    assert out.success, out.error
    assert out.output_tokens == 9, "usage.completion_tokens, not the 3 chunks"
    assert out.itl_s == pytest.approx((0.015, 0.015))
    # TPOT divides by tokens, not chunks: 30 ms over 9 - 1 tokens is 3.75 ms (counting chunks
    # would give 15 ms).
    assert compute_metrics([out], 1.0, SLO()).mean_tpot_ms == pytest.approx(3.75)


def test_a_levels_figures_are_never_below_the_servers_schedule(echo_url: str) -> None:
    result = run_level_sync(echo_url, "echo", _specs(16, 20), LoadLevel(max_concurrency=4),
                            SLO(), timeout_s=30, seed=0)
    m = result.metrics
    assert (m.completed, m.failed) == (16, 0), [o.error for o in result.outputs]
    assert m.total_output_tokens == 16 * 20
    assert m.total_input_tokens == 16 * 8
    assert all(len(o.itl_s) == 19 for o in result.outputs), "one ITL per chunk after the first"
    # The server sends the first token TTFT after it receives the request and the last 19 TPOT
    # later, on an absolute schedule; the client's send comes before. A busy host only adds.
    # (0.99: an event loop's timer may fire a clock tick early.)
    assert min(o.ttft_s for o in result.outputs) >= 0.99 * TTFT_MS / 1000
    assert min(o.latency_s for o in result.outputs) >= 0.99 * (TTFT_MS + 19 * TPOT_MS) / 1000
    assert m.request_throughput > 0 and not result.stalled and not result.stopped


def test_a_rate_level_sends_no_request_before_its_arrival_time(echo_url: str) -> None:
    rate, num = 50.0, 20
    before = time.perf_counter()
    result = run_level_sync(echo_url, "echo", _specs(num, 2), LoadLevel(request_rate_rps=rate),
                            SLO(), timeout_s=30, seed=1)
    assert result.metrics.completed == num
    starts = sorted(o.start_time - before for o in result.outputs)
    offsets = arrival_offsets_s(num, rate, seed=1)
    assert all(start >= offset for start, offset in zip(starts, offsets, strict=True)), \
        "each request waits for its arrival time (the schedule's shape: the offsets test)"


@pytest.mark.parametrize("is_trace", [False, True], ids=["rate", "trace"])
def test_a_level_on_a_lagging_modelled_clock_lasts_at_least_the_arrivals_it_offered(
        echo_url: str, is_trace: bool) -> None:
    """A server whose modelled clock takes a busy host's lag off (here: half the wall's pace)
    stamps the arrivals closer together than they were sent; the level still lasts its offered
    span plus its last request's life, so its goodput is never above the rate it offered
    (spanning the engine's stamps alone read ~0.55 s for 1 s of arrivals: ~36 req/s at 20)."""
    rate, num = 20.0, 20
    offsets = [i * 0.05 + (0.3 if i >= 10 else 0.0) for i in range(num)] if is_trace \
        else None
    last_send_s = offsets[-1] if offsets is not None else num / rate
    offered_rps = (num - 1) / offsets[-1] if offsets is not None else rate
    result = run_level_sync(echo_url, "modelled-lagging", _specs(num, 2),
                            LoadLevel(request_rate_rps=None if is_trace else rate),
                            SLO(ttft_p99_ms=1000), timeout_s=30, seed=3,
                            send_offsets_s=offsets)
    m = result.metrics
    assert result.is_modelled_clock and (m.completed, m.failed) == (num, 0)
    spans = [o.modelled_span_s for o in result.outputs if o.modelled_span_s is not None]
    assert max(e for _, e in spans) - min(s for s, _ in spans) < 0.8 * last_send_s, \
        "the server's clock did lag: its stamps span less than the arrivals sent"
    life_s = (TTFT_MS + TPOT_MS) / 1000
    assert m.duration_s >= last_send_s + 0.99 * life_s, \
        "vLLM's duration: from the level's start to the last request's end"
    assert m.request_goodput is not None
    assert m.request_goodput <= offered_rps * num / (num - 1), \
        "goodput is at most the offered rate (n requests over n - 1 gaps)"


def test_a_duration_bound_level_cycles_its_requests_and_stops_issuing(echo_url: str) -> None:
    # Two requests told apart by their prompts: the level sends them in turn, and it returns
    # at all only because it stops issuing at the duration (a cycle has no end of its own).
    specs = [*_specs(1, 2, prompt_len=8), *_specs(1, 2, prompt_len=9)]
    result = run_level_sync(echo_url, "echo", specs, LoadLevel(request_rate_rps=40.0), SLO(),
                            timeout_s=30, seed=2, duration_s=0.5)
    sent = [o.prompt_len for o in result.outputs]
    assert sent == [(8, 9)[i % 2] for i in range(len(sent))], "in turn, from the first"
    assert result.metrics.failed == 0 and not result.stopped


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
    # The requests' own timeout (600 s) is past the suite's: only the stall ends this level.
    result = run_level_sync(echo_url, "hang", _specs(4, 5), LoadLevel(max_concurrency=2), SLO(),
                            timeout_s=600, seed=0, stall_timeout_s=0.5)
    assert result.stalled and not result.stopped
    assert [o.error for o in result.outputs] == [STALLED_ERROR] * 2, (
        "the two in flight are cancelled; the two behind the cap are never sent")


def test_request_timeout_fails_the_request(echo_url: str) -> None:
    result = run_level_sync(echo_url, "hang", _specs(1, 5), LoadLevel(), SLO(), timeout_s=0.5,
                            seed=0)
    assert not result.stalled
    assert "no complete response within 0.5 s" in result.outputs[0].error


def test_stop_event_from_another_thread_ends_the_level(echo_url: str) -> None:
    httpx.delete(f"{echo_url}/stats")
    stop = threading.Event()

    def stop_once_a_request_arrived() -> None:
        while not stop.is_set() and httpx.get(f"{echo_url}/stats").json()["num_requests"] < 1:
            stop.wait(0.01)
        stop.set()

    stopper = threading.Thread(target=stop_once_a_request_arrived)
    stopper.start()
    try:
        # 100 requests at 10 a second: a schedule of about 10 s.
        result = run_level_sync(echo_url, "echo", _specs(100, 50),
                                LoadLevel(request_rate_rps=10), SLO(), timeout_s=30, seed=0,
                                stop_event=stop)
    finally:
        stop.set()
        stopper.join()
    assert result.stopped and not result.stalled
    assert len(result.outputs) < 100, "stopping must not wait for the whole schedule"
    assert any(o.error == STOPPED_ERROR for o in result.outputs), "those in flight are cut"
