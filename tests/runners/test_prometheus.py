"""Prometheus reading: parsing a vLLM /metrics answer, scraping a real HTTP server, counter
deltas, and the background poller's summary over a scripted series."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runners.process import free_port
from runners.prometheus import MetricsPoller, delta, parse, scrape

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_metrics.txt"


class _ScriptedMetricsServer:
    """A real HTTP server on 127.0.0.1 whose /metrics answer is `render(n)` for the n-th GET."""

    def __init__(self, render: Callable[[int], str], status: int = 200) -> None:
        self.render = render
        self.status = status
        self.num_gets = 0
        self.answered = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = server.render(server.num_gets).encode()
                server.num_gets += 1
                self.send_response(server.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with server.answered:
                    server.answered.notify_all()

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output clean

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def wait_for_gets(self, num: int, timeout_s: float = 60.0) -> None:
        """Return once `num` GETs were answered: a poller's samples, counted, not timed."""
        with self.answered:
            assert self.answered.wait_for(lambda: self.num_gets >= num, timeout_s), \
                f"{self.num_gets} GETs of {num} within {timeout_s} s"

    def __enter__(self) -> _ScriptedMetricsServer:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def _gauges(waiting: float, kv: float, preemptions: float = 0.0) -> str:
    labels = '{engine="0",model_name="m"}'
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {waiting}\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} 4.0\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{labels} {kv}\n"
        "# TYPE vllm:num_preemptions_total counter\n"
        f"vllm:num_preemptions_total{labels} {preemptions}\n"
    )


@pytest.fixture
def fixture_text() -> str:
    return FIXTURE.read_text(encoding="utf-8")


def test_parse_keeps_vllm_sample_names_and_sums_labels(fixture_text: str) -> None:
    values = parse(fixture_text)
    assert values["vllm:num_requests_running"] == 12.0
    assert values["vllm:num_requests_waiting"] == 3.0
    assert values["vllm:kv_cache_usage_perc"] == 0.4125
    assert values["vllm:num_preemptions_total"] == 7.0, "counters keep their _total name"
    assert values["vllm:prompt_tokens_total"] == 262144.0
    assert values["vllm:generation_tokens_total"] == 65536.0
    assert values["vllm:prefix_cache_queries_total"] == 262144.0
    assert values["vllm:prefix_cache_hits_total"] == 65536.0
    assert values["vllm:request_success_total"] == 512.0, "summed over finished_reason"
    assert values["vllm:time_to_first_token_seconds_sum"] == pytest.approx(25.6)
    assert values["vllm:time_to_first_token_seconds_count"] == 512.0
    assert values["vllm:iteration_tokens_total_sum"] == 327680.0, "a histogram named _total"
    assert values["vllm:iteration_tokens_total_count"] == 1000.0


def test_parse_drops_buckets_created_and_foreign_metrics(fixture_text: str) -> None:
    keys = set(parse(fixture_text))
    assert not any(k.endswith(("_bucket", "_created")) for k in keys), keys
    assert all(k.startswith("vllm:") for k in keys), "python_/process_ metrics are not ours"


def test_parse_takes_the_fullest_kv_cache_across_engines() -> None:
    text = ("# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0"} 0.3\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.9\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0"} 2\n'
            'vllm:num_requests_running{engine="1"} 5\n')
    values = parse(text)
    assert values["vllm:kv_cache_usage_perc"] == 0.9, "a fraction is not summable"
    assert values["vllm:num_requests_running"] == 7.0


def test_scrape_reads_a_real_server(fixture_text: str) -> None:
    with _ScriptedMetricsServer(lambda n: fixture_text) as server:
        assert scrape(server.base_url) == parse(fixture_text)


def test_scrapes_and_pollers_load_the_ca_bundle_once(fixture_text: str) -> None:
    """A step makes three clients (its poller, the scrapes before and after its window); each
    would load the CA bundle again, 20 ms of CPU."""
    from runners.prometheus import MetricsPoller, _ssl_context

    _ssl_context.cache_clear()
    with _ScriptedMetricsServer(lambda n: fixture_text) as server:
        assert scrape(server.base_url) and scrape(server.base_url)
        with MetricsPoller(server.base_url, interval_s=0.05):
            pass
    assert _ssl_context.cache_info().misses == 1, "one SSL context for every client"


@pytest.mark.parametrize("status", [404, 503])
def test_scrape_of_an_error_answer_is_empty(status: int, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    with _ScriptedMetricsServer(lambda n: "nope", status=status) as server:
        assert scrape(server.base_url) == {}
    assert f"HTTP {status}" in caplog.text


def test_scrape_of_an_unreachable_server_is_empty_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="runners.prometheus"):
        assert scrape(f"http://127.0.0.1:{free_port()}", timeout_s=1) == {}
    assert "could not read" in caplog.text


def test_scrape_of_garbage_is_empty() -> None:
    with _ScriptedMetricsServer(lambda n: "vllm:x{ 1 2 3\n") as server:
        assert scrape(server.base_url) == {}


def test_delta_is_counter_growth_and_handles_resets() -> None:
    before = {"vllm:num_preemptions_total": 5.0, "vllm:ttft_seconds_sum": 1.0,
              "vllm:ttft_seconds_count": 10.0, "vllm:num_requests_waiting": 8.0,
              "vllm:prompt_tokens_total": 1000.0}
    after = {"vllm:num_preemptions_total": 9.0, "vllm:ttft_seconds_sum": 1.5,
             "vllm:ttft_seconds_count": 12.0, "vllm:num_requests_waiting": 2.0,
             "vllm:prompt_tokens_total": 300.0, "vllm:generation_tokens_total": 50.0}
    assert delta(before, after) == {
        "vllm:num_preemptions_total": 4.0,
        "vllm:ttft_seconds_sum": 0.5,
        "vllm:ttft_seconds_count": 2.0,
        "vllm:prompt_tokens_total": 300.0,  # went down: the engine restarted
    }


@pytest.fixture
def rising_queue() -> Iterator[_ScriptedMetricsServer]:
    def render(n: int) -> str:
        return _gauges(waiting=2.0 * n, kv=min(1.0, 0.5 + 0.1 * n), preemptions=float(n))
    with _ScriptedMetricsServer(render) as server:
        yield server


def test_poller_sees_a_rising_queue_and_kv_pressure(rising_queue: _ScriptedMetricsServer
                                                    ) -> None:
    poller = MetricsPoller(rising_queue.base_url, interval_s=0.05)
    poller.start()
    rising_queue.wait_for_gets(5)
    summary = poller.stop()
    num = int(summary["num_samples"])
    assert num >= 4 and num == rising_queue.num_gets
    assert summary["max_num_requests_waiting"] == 2.0 * (num - 1)
    assert summary["max_num_requests_running"] == 4.0
    assert summary["max_kv_cache_usage_perc"] == pytest.approx(min(1.0, 0.5 + 0.1 * (num - 1)))
    assert summary["waiting_slope_per_s"] > 0
    assert summary["is_waiting_rising"] == 1.0
    assert summary["num_preemptions"] == float(num - 1)


def test_poller_sees_a_flat_queue_as_not_rising() -> None:
    with _ScriptedMetricsServer(lambda n: _gauges(waiting=3.0 + (n % 2), kv=0.4)) as server:
        with MetricsPoller(server.base_url, interval_s=0.05) as poller:
            server.wait_for_gets(4)
        summary = poller.summary()
    assert summary["is_waiting_rising"] == 0.0
    assert summary["max_num_requests_waiting"] == 4.0
    assert summary["mean_kv_cache_usage_perc"] == pytest.approx(0.4)
    assert summary["num_preemptions"] == 0.0


def test_poller_without_a_server_reports_no_samples() -> None:
    poller = MetricsPoller(f"http://127.0.0.1:{free_port()}", interval_s=0.05, timeout_s=0.5)
    poller.start()
    time.sleep(0.1)
    assert poller.stop() == {"num_samples": 0.0}


def test_spec_decode_acceptance_reads_vllms_counters_as_its_dashboard_does() -> None:
    """vLLM 0.26's counters (vllm/v1/spec_decode/metrics.py) exposed as `_total` samples:
    acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts."""
    from runners.prometheus import spec_decode_acceptance

    before = parse("# TYPE vllm:spec_decode_num_drafts counter\n"
                   "vllm:spec_decode_num_drafts_total 10.0\n"
                   "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
                   "vllm:spec_decode_num_draft_tokens_total 40.0\n"
                   "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
                   "vllm:spec_decode_num_accepted_tokens_total 12.0\n")
    after = {k: v * 11 for k, v in before.items()}  # 100 more drafts of 4 tokens, 120 accepted
    got = spec_decode_acceptance(delta(before, after))
    assert got == {"spec_decode_acceptance_rate": 0.3,
                   "spec_decode_mean_acceptance_length": 2.2, "spec_decode_num_drafts": 100.0}
    assert spec_decode_acceptance({}) == {}, "no speculative method: nothing said"
    assert spec_decode_acceptance(delta(before, before)) == {"spec_decode_num_drafts": 0.0}, \
        "counters, but no draft in the window"


def test_a_speculating_trial_says_what_its_drafts_did() -> None:
    from optimizer.search.notes import speculation_note

    measured = {"server.spec_decode_acceptance_rate": 0.8268,
                "server.spec_decode_mean_acceptance_length": 4.3028}
    assert speculation_note({"spec_method": "ngram", "spec_tokens": 4}, measured) == (
        "Speculation (ngram): 83% of draft tokens accepted, 4.3 tokens per verification step "
        "at the headline level.")
    assert "proposed no draft" in speculation_note({"spec_method": "ngram_gpu"},
                                                   {"server.spec_decode_num_drafts": 0.0})
    assert "counters were not read" in speculation_note({"spec_method": "ngram"}, {}), \
        "no counter is no evidence of no draft"
    assert speculation_note({"spec_method": "none"}, measured) == ""
    assert speculation_note({}, measured) == ""


def test_a_config_vllm_turned_async_scheduling_off_for_says_so() -> None:
    """vLLM 0.26 turns async scheduling off by itself for CPU ngram speculation: the log says
    so, the engine info keeps it, and the conclusion names it beside the change asked for."""
    from optimizer.search.notes import implied_changes_note
    from runners.base import EngineInfo
    from runners.vllm.logs import parse_log

    log = ("(APIServer pid=1) WARNING 12-04 21:03:40 [vllm.py:1077] Async scheduling not "
           "supported with ngram-based speculative decoding and will be disabled.\n"
           "(APIServer pid=1) INFO 12-04 21:03:40 [vllm.py:1109] Asynchronous scheduling is "
           "disabled.\n")
    assert parse_log(log).async_scheduling is False
    assert parse_log(log.replace("is disabled", "is enabled")).async_scheduling is True
    assert parse_log("nothing said").async_scheduling is None
    off = EngineInfo(async_scheduling=False)
    ngram = {"spec_method": "ngram", "spec_tokens": 4}
    on = {"async_scheduling": True, "model_runner": "V2"}
    assert "turned async scheduling off" in implied_changes_note(ngram, off, on)
    assert "turned async scheduling off" in implied_changes_note(ngram, off, None)
    assert implied_changes_note(ngram, off, {"async_scheduling": False}) == "", \
        "the defaults ran it off too"
    assert implied_changes_note({"async_scheduling": False}, off, on) == "", "asked for"
    assert implied_changes_note(ngram, EngineInfo(async_scheduling=True), on) == ""
    v1 = parse_log(log + "(APIServer pid=1) WARNING 12-04 21:03:53 [vllm.py:584] Model Runner "
                   "V2 does not yet support ngram/ngram_gpu speculative decoding; using the V1 "
                   "model runner instead.\n")
    assert v1.model_runner == "V1"
    assert parse_log("[gpu_worker.py:378] Using V2 Model Runner").model_runner == "V2"
    both = implied_changes_note(ngram, v1, on)
    assert both == ('vLLM turned async scheduling off (its log: "Asynchronous scheduling is '
                    'disabled") and ran the V1 model runner instead of V2 (its log: "using the '
                    'V1 model runner instead") for this config, so the result includes that.')
