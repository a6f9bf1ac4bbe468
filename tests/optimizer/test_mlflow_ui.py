"""The MLflow UI as a user opens it: a real `mlflow server` (3.17) on 127.0.0.1 over a study's
sqlite store written by the `Tracker`, rendered by a real headless Chromium (Debian's). The URL
nightshift gives lands on the runs table with the trials, their conclusions and headline
figures, best first; the study's own run and GenAI's Overview page are not in the way."""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from optimizer.results.trial_record import TrialRecord
from optimizer.tracking.payload import tracking_payload
from optimizer.tracking.tracker import Tracker
from optimizer.tracking.view import VIEW_GAIN, runs_page, three_digits, view_key
from runners.process import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,  # an MLflow server and a browser
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]

CONCLUSIONS = {
    0: "vLLM defaults: goodput 29.3 req/s; the baseline every other trial is compared with.",
    1: "quantization=fp8 vs defaults: goodput 38.6 req/s (1.32x): new best. memory-bound.",
    2: "kv_cache_dtype=fp8 vs best trial 1: goodput 29.7 req/s (-23%): worse.",
}
FLAGS = {0: {}, 1: {"quantization": "fp8"}, 2: {"kv_cache_dtype": "fp8"}}
GOODPUT = {0: 29.3, 1: 38.6, 2: 29.7}


def _store(tmp_path: Path) -> tuple[str, str]:
    """A finished three-trial study and one confirmation run; (tracking URI, experiment id)."""
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("ui", key="k", params={"objective": "goodput"}, artifacts={},
                                 objectives={"goodput": "maximize"})
    for number, conclusion in CONCLUSIONS.items():
        run = tracker.start_trial(parent, "ui", number, FLAGS[number])
        value = GOODPUT[number]
        record = TrialRecord(
            state="complete", params=FLAGS[number], conclusion=conclusion,
            flags=FLAGS[number], values=(value,), is_baseline=number == 0,
            verdict={"label": "memory-bound" if number else "compute-bound"},
            metrics={"request_goodput": value, "objective.goodput": value,
                     "objective.goodput.per_gpu": value, "output_throughput": value * 256,
                     "p99_tpot_ms": 6.0, "p99_ttft_ms": 500.0, "engine.startup_s": 100.0},
            steps=({"step": 0, "metrics": {"request_goodput": value / 3}},
                   {"step": 1, "metrics": {"request_goodput": value}}))
        tracker.finish_trial(run, **tracking_payload(record, None, number=number))
    run = tracker.start_trial(parent, "ui", 3, FLAGS[1], confirm="best")
    tracker.finish_trial(run, **tracking_payload(TrialRecord(
        state="complete", params=FLAGS[1], conclusion="confirmation (best): 38.1 req/s.",
        flags=FLAGS[1], values=(38.1,), metrics={"objective.goodput": 38.1,
                                                 "objective.goodput.per_gpu": 38.1}), None,
        number=3, confirm="best"))
    tracker.finish_study(parent, {}, {"conclusion": "best: trial 1"}, is_done=True)
    # What the daemon does at the end: the review figures, and the recommended trial marked.
    tracker.mark_trials(parent, 1, {n: {view_key("goodput"): three_digits(v),
                                        VIEW_GAIN: three_digits(v / GOODPUT[0])}
                                    for n, v in GOODPUT.items()})
    exp = tracker.client.get_experiment_by_name("ui")
    return uri, str(exp.experiment_id)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Its whole process group (the server's uvicorn worker; Chromium's helpers)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # helpers that outlived their leader
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def _mlflow_server(uri: str, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, \
                f"mlflow server exited {proc.returncode}: {(tmp_path / 'server.log').read_text()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "mlflow server was not ready within 120 s"
            time.sleep(0.5)
        yield url
    finally:
        _end(proc)
        log.close()


def _page_text(url: str, tmp_path: Path) -> str:
    """The text of the page Chromium built for `url` (a wide window: the runs table renders
    only the columns in view)."""
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
             "--window-size=2400,1200", "--virtual-time-budget=20000", "--dump-dom", url]
    proc = subprocess.Popen(flags, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        _end(proc)
    dom = re.sub(r"<script.*?</script>|<style.*?</style>", "", out.decode(), flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)))


@pytest.fixture(scope="module")
def runs_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The runs page of `_store`'s study, served by one `mlflow server` for this module's
    tests (a server's start is most of the CPU a test here takes)."""
    tmp_path = tmp_path_factory.mktemp("ui")
    uri, exp_id = _store(tmp_path)
    with _mlflow_server(uri, tmp_path) as server:
        yield runs_page(server, exp_id)


@pytest.fixture(scope="module")
def runs_text(runs_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The text of the runs page as Chromium built it, read once for this module's tests."""
    return _page_text(runs_url, tmp_path_factory.mktemp("chromium"))


def test_the_runs_page_shows_each_trial_with_its_conclusion_best_first(runs_text: str) -> None:
    text = runs_text
    assert "Detect Issues" not in text and "Runs - Experiment" in text, \
        "the runs table, not GenAI's Overview of traces"
    assert "4 matching runs" in text, "three trials and the confirmation; not the study's run"
    names = ["★ recommended: t001 fp8", "c003 confirm best", "t002 kv-fp8", "t000 defaults"]
    for name in names:
        assert name in text, f"the runs table names the run {name!r}"
    assert [text.index(n) for n in names] == sorted(text.index(n) for n in names), \
        "sorted by the objective, best first"
    for number, conclusion in CONCLUSIONS.items():
        assert conclusion[:40] in text, f"trial {number}'s conclusion is in its row"
    for column in ("Description", "goodput in req per s", "headline.p99_ttft_ms",
                   "headline.p99_tpot_ms", "state"):
        assert column in text, f"the table shows the column {column}"
    # The review columns first: the objective in its unit (3 significant digits), the gain
    # vs the defaults, the bottleneck; the headline figures after them.
    # The runs table's cells in the order shown: the objective in its unit (3 significant
    # digits) first, the gain vs the defaults, the bottleneck, the mark, then the description
    # with its figure first. (Its header cells keep MLflow's own order in the DOM.)
    assert "38.6 1.32 memory-bound true quantization=fp8" in text, \
        "the recommended trial's row: the objective is the first metric column"
    assert "29.3 1 compute-bound - vLLM defaults" in text
    for column in ("goodput in req per s", "gain vs defaults x", "bottleneck",
                   "nightshift.recommended"):
        assert column in text


def _screenshot(url: str, path: Path, tmp_path: Path, width: int = 1600,
                height: int = 900) -> None:
    """A PNG of the page Chromium built for `url` at `width` x `height`."""
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
             f"--window-size={width},{height}", "--virtual-time-budget=20000",
             f"--screenshot={path}", url]
    proc = subprocess.Popen(flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.communicate(timeout=120)
    finally:
        _end(proc)


def test_the_saved_view_fits_a_1600_pixel_screen_with_the_review_columns(
        runs_url: str, runs_text: str, tmp_path: Path) -> None:
    """At 1600 px the objective, the gain and the bottleneck are in view (they were last, and
    only two metric columns showed): the screenshot is what a user sees."""
    shot = tmp_path / "runs.png"
    _screenshot(runs_url, shot, tmp_path)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    assert "★ recommended: t001" in runs_text
