"""The morning report: built from the trial records in a real Optuna storage, written as HTML,
Markdown and PNGs, logged to the study's MLflow parent run, and rendered by a real headless
Chromium (Debian's): the DOM it built and a screenshot of the page."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from optimizer.bottleneck import LABELS
from optimizer.cli import main
from optimizer.config import parse_study
from optimizer.report import TrialRow, build_report, pareto_front, render_markdown, write_report
from optimizer.report.plots import LABEL_COLOURS
from optimizer.storage.study import open_study
from optimizer.tracking.tracker import Tracker

CHOICES = {"quantization": ["none", "fp8"], "enforce_eager": [False, True]}
DISTRIBUTIONS = {k: optuna.distributions.CategoricalDistribution(v) for k, v in CHOICES.items()}


def _record(state: str, flags: dict[str, Any], goodput: float | None, tput: float | None,
            tpot: float | None, label: str = "", failure: str | None = None,
            is_baseline: bool = False) -> dict[str, Any]:
    metrics = {} if tput is None else {"output_throughput": tput, "p99_tpot_ms": tpot,
                                       "p99_ttft_ms": 300.0, "engine.startup_s": 90.0}
    return {"state": state, "params": {}, "flags": flags,
            "values": [goodput] if state == "complete" else None, "metrics": metrics,
            "steps": [], "failure_reason": failure, "failure_message": None,
            "conclusion": f"trial with {flags or 'defaults'} <b>not bold</b>",
            "argv": ["python", "-m", "runners.simulated", "serve"], "env": {},
            "verdict": {"label": label} if label else None, "wall_s": 100.0,
            "is_baseline": is_baseline}


@pytest.fixture
def study_file(tmp_path: Path) -> Path:
    """A study of five recorded trials (defaults, fp8, eager, fp8+eager pruned, an OOM)."""
    data = {"name": "morning", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 5},
            "slo": {"tpot_p99_ms": 10}, "results_dir": str(tmp_path / "results"),
            "tracking_uri": f"sqlite:///{tmp_path}/mlruns/mlflow.db"}
    path = tmp_path / "study.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    cfg = parse_study(data, path=path)
    study = open_study(cfg)
    rows = [
        ({"quantization": "none", "enforce_eager": False},
         _record("complete", {}, 29.6, 7570.0, 8.1, "memory-bound", is_baseline=True)),
        ({"quantization": "fp8", "enforce_eager": False},
         _record("complete", {"quantization": "fp8"}, 40.0, 10246.0, 5.9, "memory-bound")),
        ({"quantization": "none", "enforce_eager": True},
         _record("complete", {"enforce_eager": True}, 0.0, 3754.0, 17.2, "launch-bound")),
        ({"quantization": "fp8", "enforce_eager": True},
         _record("complete", {"quantization": "fp8", "enforce_eager": True}, 1.0, 9000.0, 5.0,
                 "launch-bound")),
        ({"quantization": "fp8", "enforce_eager": True},
         _record("failed", {"quantization": "fp8", "enforce_eager": True}, None, None, None,
                 failure="oom_at_start")),
    ]
    for params, record in rows:
        state = optuna.trial.TrialState.COMPLETE if record["state"] == "complete" else \
            optuna.trial.TrialState.FAIL
        attrs = {"record": record, **({"baseline": True} if record["is_baseline"] else {})}
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=DISTRIBUTIONS, state=state,
            value=record["values"][0] if record["values"] else None, user_attrs=attrs))
    # The tail of a grid: enqueued, never started (a report counts them, it has no row for them).
    for _ in range(3):
        study.enqueue_trial({"quantization": "none", "enforce_eager": True})
    tracker = Tracker(cfg.tracking_uri)
    tracker.start_study(cfg.name, key="k", params={"objective": "goodput"}, artifacts={})
    return path


def _row(number: int, tput: float | None, tpot: float | None,
         state: str = "complete") -> TrialRow:
    return TrialRow(number, state, {}, 1.0, tput, tpot, None, None, None, "", "", "", False)


def test_pareto_front_keeps_only_undominated_complete_trials() -> None:
    rows = [_row(0, 7000, 8.0), _row(1, 10000, 6.0), _row(2, 9000, 5.0), _row(3, 8000, 7.0),
            _row(4, 12000, 4.0, state="failed"), _row(5, None, None)]
    assert pareto_front(rows) == (1, 2), "0 and 3 are beaten on both axes; 4 failed; 5 unmeasured"


def test_report_states_best_gain_over_defaults_front_labels_and_failures(
        study_file: Path) -> None:
    import yaml

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    report = build_report(open_study(cfg, create=False), cfg)
    assert report.best is not None and report.best.number == 1
    assert report.baseline is not None and report.baseline.number == 0
    assert report.gain == pytest.approx(40.0 / 29.6), "the gain is measured in the same study"
    assert report.pareto == (1, 3), "fp8 (throughput) and fp8+eager (TPOT) are undominated"
    assert report.failures == {"oom_at_start": 1}
    assert set(report.importances) == set(CHOICES)
    assert report.is_simulated, "simulated figures are said to be simulated"
    md = render_markdown(report)
    assert "1.35x the vLLM defaults" in md
    assert "Simulated engine" in md
    assert "| 2 | complete | enforce_eager=True |" in md
    assert "- oom_at_start: 1" in md
    assert [r.number for r in report.rows] == [0, 1, 2, 3, 4] and report.queued == 3
    assert "5 trials (3 more queued, not run yet)" in md


def test_report_command_writes_files_and_logs_them_to_the_parent_run(
        study_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "morning"
    assert main(["report", str(study_file), "-o", str(out)]) == 0
    for name in ("report.html", "report.md", "pareto.png", "history.png", "importances.png"):
        assert (out / name).stat().st_size > 1000, f"{name} is written"
    html = (out / "report.html").read_text()
    assert "<b>not bold</b>" not in html and "&lt;b&gt;not bold&lt;/b&gt;" in html, \
        "conclusions are escaped: a trial's text never becomes markup"
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run_id = Tracker(f"sqlite:///{tmp_path}/mlruns/mlflow.db").find_study_run("morning")
    logged = {a.path for a in client.list_artifacts(run_id, "report")}
    assert {"report/report.html", "report/pareto.png"} <= logged


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return int(width), int(height)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow  # a browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_html_report_renders_in_headless_chromium(study_file: Path, tmp_path: Path) -> None:
    import yaml

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    out = tmp_path / "report"
    write_report(build_report(open_study(cfg, create=False), cfg), out)
    url = (out / "report.html").resolve().as_uri()
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
             "--virtual-time-budget=3000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for anchor in ('id="headline"', 'id="pareto"', 'id="trials"', 'id="failures"',
                   'id="simulated"', "1.35x the vLLM defaults"):
        assert anchor in dom, f"the rendered page has {anchor}"
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,1800", url],
                   capture_output=True, timeout=120, check=True)
    assert _png_size(shot) == (1280, 1800)
    assert shot.stat().st_size > 50_000, "a page with plots and tables, not a blank one"


def test_live_progress_shows_labels_changes_and_an_eta(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from optimizer.cli.live import LiveProgress
    from optimizer.run.events import TrialEvent

    cfg = parse_study({"name": "live", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 4}, "slo": {"tpot_p99_ms": 10},
                       "results_dir": str(tmp_path)})
    progress = LiveProgress(cfg)
    progress.on_event(TrialEvent("started", 0, {}))
    progress.on_event(TrialEvent("finished", 0, {}, "complete", 29.6, 8.1, "vLLM defaults",
                                 180.0, "memory-bound"))
    progress.on_event(TrialEvent("started", 1, {"quantization": "fp8"}))
    text = io.StringIO()
    Console(file=text, width=220).print(progress)  # drawn at the console's width
    screen = text.getvalue()
    for shown in ("1/4 trials", "ETA", "(defaults)", "quantization=fp8", "memory-bound",
                  "29.6", "running"):
        assert shown in screen, f"the live table shows {shown!r}"


def test_too_few_trials_rank_no_parameters_and_values_carry_units(study_file: Path) -> None:
    """Issue 18 (every claim true): two measured trials differing in two parameters gave fANOVA
    numbers (0.59 / 0.41) that only said which values the two happened to differ in; a report
    ranks parameters only from enough trials, and says so otherwise. Values carry units."""
    import yaml

    from optimizer.report import TOO_FEW_FOR_IMPORTANCES, importances_floor

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    study = open_study(cfg, create=False)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert importances_floor(complete) == 4, "two varied params: 2 + 2, and at least 4"
    assert importances_floor(complete[:2]) == 4
    two = optuna.create_study()
    for t in complete[:2]:
        two.add_trial(t)
    assert build_report(two, cfg).importances == {}, "two trials rank nothing"
    md = render_markdown(build_report(two, cfg))
    assert TOO_FEW_FOR_IMPORTANCES in md
    import re

    assert re.search(r"Best: trial \d+ .*goodput [\d.]+ req/s", md) and \
        "| goodput req/s/GPU |" in md, "values carry their unit (a rate per GPU)"


def test_pareto_plot_draws_every_line_its_legend_lists(study_file: Path) -> None:
    """Issue 22: the legend listed a "Pareto front" line a one-trial front did not draw (a
    dashed line through one point has no segment)."""
    import dataclasses

    import matplotlib.pyplot as plt
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D

    from optimizer.report.plots import pareto_figure

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    built = build_report(open_study(cfg, create=False), cfg, with_importances=False)
    for report in (built, dataclasses.replace(built, pareto=built.pareto[:1])):
        fig = pareto_figure(report)
        try:
            ax = fig.axes[0]
            listed = [t.get_text() for t in ax.get_legend().get_texts()]
            artists = {a.get_label(): a for a in [*ax.get_lines(), *ax.collections]}
            front = next(name for name in listed if name.startswith("Pareto front"))
            assert front == f"Pareto front ({len(report.pareto)} trial" + \
                ("s)" if len(report.pareto) > 1 else ")")
            for name in listed:
                artist = artists[name]
                if isinstance(artist, Line2D):
                    has_segment = len(artist.get_xdata()) >= 2 and \
                        artist.get_linestyle() not in ("None", "")
                    has_marker = artist.get_marker() not in ("None", "", None) and \
                        len(artist.get_xdata()) >= 1
                    assert has_segment or has_marker, f"{name!r} is listed and drawn"
                else:
                    assert isinstance(artist, PathCollection) and len(artist.get_offsets())
            line = artists[front]
            tpots = sorted(r.p99_tpot_ms for r in report.rows if r.number in report.pareto)
            assert list(line.get_xdata()) == tpots, "the front passes through its trials"
        finally:
            plt.close(fig)


def test_the_importances_note_lies_inside_its_figure(study_file: Path) -> None:
    """Issue 34: the "too few complete trials" note was one line clipped at both edges."""
    import matplotlib.pyplot as plt

    from optimizer.report.plots import importances_figure

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    report = build_report(open_study(cfg, create=False), cfg, with_importances=False)
    assert report.importances == {}
    fig = importances_figure(report)
    try:
        fig.canvas.draw()
        note = next(t for t in fig.axes[0].texts if t.get_text().startswith("too few"))
        box, page = note.get_window_extent(), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 <= box.y1 <= \
            page.y1, f"the note {box} lies inside the figure {page}"
    finally:
        plt.close(fig)


def test_importances_rank_a_parameter_a_rule_fixed_in_some_trials() -> None:
    """The quickstart's winner changed data_parallel_size; Optuna sampled it only at TP 1 (the
    rule replicas-fit-gpus fixed it to 1 at TP 2), and its evaluators rank only parameters
    every trial holds: it was left out. Each trial's record holds the value it ran with."""
    from optimizer.report.knobs import importances

    tp = optuna.distributions.CategoricalDistribution([1, 2])
    dp = optuna.distributions.CategoricalDistribution([1, 2])
    q = optuna.distributions.CategoricalDistribution(["none", "fp8"])
    study = optuna.create_study(direction="maximize")
    configs = [(1, 1, "none", 22.6), (2, 1, "none", 21.2), (2, 1, "fp8", 24.4),
               (1, 2, "fp8", 41.5), (1, 2, "none", 39.1), (2, 1, "fp8", 24.2),
               (1, 1, "fp8", 25.8), (1, 2, "fp8", 43.7)]
    for tp_size, dp_size, quant, value in configs:
        params: dict[str, Any] = {"tensor_parallel_size": tp_size, "quantization": quant}
        dists: dict[str, Any] = {"tensor_parallel_size": tp, "quantization": q}
        if tp_size == 1:
            params["data_parallel_size"] = dp_size
            dists["data_parallel_size"] = dp
        record = {"state": "complete", "params": {**params, "data_parallel_size": dp_size}}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                  value=value, user_attrs={"record": record}))
    ranked = importances(study)
    assert set(ranked) == {"tensor_parallel_size", "data_parallel_size", "quantization"}
    assert max(ranked, key=ranked.__getitem__) == "data_parallel_size", \
        "replicas double goodput here: the parameter that matters most is ranked first"


def test_a_latency_studys_importances_leave_out_the_worst_value_told_for_a_failure() -> None:
    """A latency objective's failures are told 1e9 ms to steer the sampler; that is no
    latency, and fANOVA would rank the parameters by which one failed (here max_num_seqs 512
    OOMs, while the TPOT varies only with quantization). They are left out of the ranking."""
    from optimizer.report.knobs import importances

    q = optuna.distributions.CategoricalDistribution(["none", "fp8"])
    seqs = optuna.distributions.CategoricalDistribution([128, 256, 512])
    study = optuna.create_study(direction="minimize")
    for i in range(12):
        quant, num_seqs = ("none", "fp8")[i % 2], (128, 256, 512)[i % 3]
        failed = num_seqs == 512
        record = {"state": "failed" if failed else "complete",
                  "params": {"quantization": quant, "max_num_seqs": num_seqs}}
        value = 1e9 if failed else (12.0 if quant == "none" else 8.0) + 0.01 * i
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": quant, "max_num_seqs": num_seqs},
            distributions={"quantization": q, "max_num_seqs": seqs}, value=value,
            user_attrs={"record": record}))
    ranked = importances(study)
    assert max(ranked, key=ranked.__getitem__) == "quantization", ranked


def test_one_knob_at_a_time_ranks_single_changes_with_what_bounds_them(
        study_file: Path) -> None:
    """A design of one change per seed: each single-change trial is that knob's effect against
    the defaults of the same study, largest first; a trial of two changes, a failed one and
    the defaults are not effects. Each says whether it lies beyond the repeats' spread."""
    import yaml

    from optimizer.report import knob_effects, render_html

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    report = build_report(open_study(cfg, create=False), cfg)
    assert [(e.param, e.value, e.number) for e in report.knob_effects] == [
        ("enforce_eager", True, 2), ("quantization", "fp8", 1)], "0x first, then 1.35x"
    assert report.knob_effects[1].verdict == "one measurement each: no spread to compare with"

    def trial(params: dict[str, Any], goodput: float, spread: float,
              baseline: bool = False) -> optuna.trial.FrozenTrial:
        record = _record("complete", {}, goodput, 1000.0, 8.0, is_baseline=baseline)
        record["metrics"]["spread.goodput"] = spread
        return optuna.trial.create_trial(
            params=params, distributions=DISTRIBUTIONS, value=goodput,
            user_attrs={"record": record, **({"baseline": True} if baseline else {})})

    study = optuna.create_study(direction="maximize")
    defaults = {"quantization": "none", "enforce_eager": False}
    for t in (trial(defaults, 30.0, 0.01, baseline=True),
              trial({**defaults, "quantization": "fp8"}, 33.0, 0.04),      # +10%, spread 4%
              trial({**defaults, "enforce_eager": True}, 30.9, 0.05)):    # +3%, spread 5%
        study.add_trial(t)
    effects = knob_effects(study.trials, study.trials[0], "goodput")
    assert [e.verdict for e in effects] == ["beyond the repeats' spread (4%)",
                                            "within the repeats' spread (5%)"]
    near = optuna.create_study(direction="maximize")
    near.add_trial(study.trials[0])
    near.add_trial(trial({**defaults, "quantization": "fp8"}, 30.3, 0.0))
    (effect,) = knob_effects(near.trials, near.trials[0], "goodput")
    assert effect.verdict == "within noise (under 2%)"
    html = render_html(report)
    assert 'id="knob-effects"' in html and "One knob at a time" in render_markdown(report)
    assert knob_effects(study.trials, None, "goodput") == (), "no defaults, no effects"


def test_one_knob_reads_what_vllm_runs_with_and_keeps_a_child_with_its_parent() -> None:
    """An explicit value equal to vLLM's default on the host is no change (capture 512 at
    1024 sequences); a change of max_num_seqs alone is one knob though the capture size vLLM
    derives from it moves too; turning speculation on sets its draft count with it (one knob);
    a minimize objective's zero on the trial's side says so."""
    from optimizer.report import knob_effects

    dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in {
        "max_cudagraph_capture_size": [None, 64, 512], "max_num_seqs": [None, 128],
        "spec_method": ["none", "ngram"], "spec_tokens": [None, 4]}.items()}

    def trial(params: dict[str, Any], value: float, baseline: bool = False
              ) -> optuna.trial.FrozenTrial:
        record = _record("complete", {}, value, 1000.0, 8.0, is_baseline=baseline)
        record["params"] = params
        return optuna.trial.create_trial(
            params=params, distributions=dists, value=value,
            user_attrs={"record": record, **({"baseline": True} if baseline else {})})

    base = {"max_cudagraph_capture_size": None, "max_num_seqs": None, "spec_method": "none",
            "spec_tokens": None}
    study = optuna.create_study(direction="minimize")
    for t in (trial(base, 10.0, baseline=True),
              trial({**base, "max_cudagraph_capture_size": 512}, 10.1),   # vLLM's own value
              trial({**base, "max_num_seqs": 128}, 9.0),
              trial({**base, "spec_method": "ngram", "spec_tokens": 4}, 0.0)):
        study.add_trial(t)
    host = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "spec_method": "none"}
    effects = {e.param: e for e in knob_effects(study.trials, study.trials[0], "tpot",
                                                 vllm_defaults=host)}
    assert set(effects) == {"max_num_seqs", "spec_method"}, "512 is what vLLM runs anyway"
    assert effects["spec_method"].shown_value == "ngram (with spec_tokens=4)"
    assert effects["spec_method"].verdict == "no ratio: this trial measured 0"
    assert round(effects["max_num_seqs"].gain.value or 0, 2) == 1.11, "lower TPOT is better"


def test_a_best_that_is_the_defaults_reads_as_such_in_the_headline(study_file: Path) -> None:
    import yaml

    from optimizer.report import headline

    cfg = parse_study(yaml.safe_load(study_file.read_text()), path=study_file)
    only_defaults = optuna.create_study(direction="maximize")
    only_defaults.add_trial(open_study(cfg, create=False).trials[0])
    text = headline(build_report(only_defaults, cfg))
    assert text.startswith("Best: trial 0 (the vLLM defaults), goodput 29.6 req/s"), text


def test_the_headline_names_a_recommended_defaults_and_a_best_of_the_defaults_flags() -> None:
    from dataclasses import replace

    from optimizer.report import Report, headline

    defaults = replace(_row(0, 7000, 8.0), value=30.0, is_baseline=True)
    best = replace(_row(1, 7100, 7.9), value=30.4)  # the defaults' flags, another run
    report = Report(study="s", objective="goodput", is_maximize=True, is_simulated=False,
                    rows=(defaults, best), baseline=defaults, best=best, pareto=(),
                    importances={}, failures={}, slo={}, recommended=defaults)
    text = headline(report)
    assert text.startswith("Best: trial 1 (the defaults' flags), goodput 30.4 req/s"), text
    assert "Recommended: trial 0 (the vLLM defaults), 30 req/s" in text and "((" not in text


def test_one_change_fills_a_missing_key_with_vllms_default_and_ignores_a_moot_capture_size(
        ) -> None:
    from optimizer.report.knobs import KnobEffect, _one_change
    from optimizer.results.gains import point_gain

    host = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "enforce_eager": False,
            "cudagraph_mode": "FULL_AND_PIECEWISE", "enable_prefix_caching": True}
    assert _one_change({}, {"max_num_seqs": 1024}, host) is None, "1024 is what vLLM runs"
    assert _one_change({"max_num_seqs": 1024, "enable_prefix_caching": False},
                       {"enable_prefix_caching": True}, host) == ("enable_prefix_caching", {})
    assert _one_change({"enforce_eager": True, "max_cudagraph_capture_size": 64},
                       {"enforce_eager": False, "max_cudagraph_capture_size": None},
                       host) == ("enforce_eager", {}), "no graphs: the capture size is moot"
    both_zero = KnobEffect("x", 1, 1, point_gain(0.0, 0.0, maximize=False), None,
                           measured=0.0, defaults_measured=0.0)
    assert both_zero.verdict == "no ratio: this trial and the defaults measured 0"
    missing = KnobEffect("x", 1, 1, point_gain(None, 3.0, maximize=True), None,
                         defaults_measured=3.0)
    assert missing.verdict == "no ratio: no value for this trial"


def test_every_label_but_unknown_has_a_colour_of_its_own() -> None:
    """The Pareto plot and the HTML label badge colour by label, grey (#7f7f7f) where a label
    has none: a new label left out would look like unknown."""
    assert set(LABEL_COLOURS) == set(LABELS) - {"unknown"}
    colours = list(LABEL_COLOURS.values())
    assert len(set(colours)) == len(colours) and "#7f7f7f" not in colours
