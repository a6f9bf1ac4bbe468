"""`nightshift regress` and `export --to-library` on the simulated engine: a study's trials
exported to a library and re-measured hold; a regression injected into one case's engine
(`sim_step_slowdown`) is caught (exit 1) while the other case holds; a flag a newer vLLM renamed
fails to start, named with its likely new name; a bad library is one line and exit 2."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from optimizer.cli import main
from optimizer.config import load_study
from optimizer.regress.compare import compare_figure, flag_problems
from optimizer.regress.library import FigureRef, LibraryConfig, load_library
from optimizer.regress.measure import installed, measure_case
from optimizer.results.trial_record import (
    ATTR_BASELINE,
    ATTR_CONFIRM,
    TrialRecord,
    summary_metrics,
)
from optimizer.storage.study import open_study
from runners.base import RunResult
from runners.simulated.launcher import VllmVariant

MODEL = {"path": "qwen2.5-0.5b", "load_format": "dummy", "skip_tokenizer_init": True}
WORKLOAD = {"input_len": 128, "output_len": 32, "num_requests": 24, "warmup_requests": 2,
            "levels": [{"concurrency": 8}]}
SLO = {"tpot_p99_ms": 50.0}
TUNED = {"max_num_seqs": 64}


def _study_file(tmp: Path) -> Path:
    path = tmp / "study.yaml"
    path.write_text(yaml.safe_dump({
        "name": "small", "engine": "simulated", "model": MODEL, "workload": WORKLOAD,
        "slo": SLO, "budget": {"trials": 2}, "confirm_rounds": 1,
        "simulated": {"num_gpus": 1, "startup_time_scale": 0.001},
        "storage": f"sqlite:///{tmp / 'optuna.db'}",
        "tracking_uri": f"sqlite:///{tmp / 'study-mlflow.db'}"}))
    return path


def _record(result: RunResult, flags: dict[str, Any], is_baseline: bool) -> dict[str, Any]:
    metrics = summary_metrics(result, ["goodput"])
    return TrialRecord(state="complete", params=dict(flags), conclusion="measured",
                       flags=dict(flags), values=(metrics["objective.goodput"],),
                       metrics=metrics, argv=result.argv, env=dict(result.env),
                       engine=asdict(result.engine), is_baseline=is_baseline).to_user_attr()


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A study measured on the simulated engine (the defaults, a tuned config and its
    confirmation run, stored as the daemon stores trials), exported twice into a library."""
    tmp = tmp_path_factory.mktemp("regress")
    study_path = _study_file(tmp)
    cfg = load_study(study_path)
    case = load_library_from({"name": "probe", "cases": [{
        "name": "probe", "engine": "simulated", "model": MODEL, "workload": WORKLOAD,
        "slo": SLO, "simulated": {"startup_time_scale": 0.001}, "rounds": 2,
        "configs": [{"name": "defaults"}, {"name": "tuned", "flags": TUNED}]}]}, tmp).cases[0]
    results: dict[str, list[RunResult]] = {"defaults": [], "tuned": []}
    measure_case(case, installed(case), tmp / "measure", 0.05,
                 on_run=lambda name, _, result: results[name].append(result))
    study = open_study(cfg)
    # As the daemon leaves them: the defaults (trial 0), the tuned config (trial 1), then the
    # interleaved confirmation runs of each.
    for flags, result, attrs in (({}, results["defaults"][0], {ATTR_BASELINE: True}),
                                 (TUNED, results["tuned"][0], {}),
                                 ({}, results["defaults"][1], {ATTR_CONFIRM: "defaults"}),
                                 (TUNED, results["tuned"][1], {ATTR_CONFIRM: "best"})):
        trial = study.ask()
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        record = _record(result, flags, bool(attrs.get(ATTR_BASELINE)))
        trial.set_user_attr("record", record)
        study.tell(trial, record["values"][0])
    lib = tmp / "bench.yaml"
    # The tuned trial (with the defaults), then the defaults alone, as a second case.
    for name, number in (("first", "1"), ("second", "0")):
        assert main(["export", str(study_path), "--trial", number, "--to-library", str(lib),
                     "--case", name]) == 0
    return lib


def load_library_from(data: dict[str, Any], tmp: Path) -> Any:
    path = tmp / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_library(path)


def _edited(lib: Path, tmp: Path, case: str, **changes: Any) -> Path:
    data = yaml.safe_load(lib.read_text())
    for entry in data["cases"]:
        if entry["name"] == case:
            for config in entry["configs"]:
                if config["name"] != "defaults":
                    for key, value in changes.items():
                        config[key] = {**config.get(key, {}), **value}
    path = tmp / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_export_to_library_writes_the_defaults_and_the_trial_with_their_samples(
        library: Path) -> None:
    spec = load_library(library)
    assert [c.name for c in spec.cases] == ["first", "second"], "a second export appends"
    assert [c.name for c in spec.cases[1].configs] == ["defaults"], \
        "exporting the defaults trial holds it once"
    configs = {c.name: c for c in spec.cases[0].configs}
    assert set(configs) == {"defaults", "trial-1"}
    tuned = configs["trial-1"]
    assert tuned.flags == TUNED
    assert tuned.reference is not None and tuned.reference.vllm_version == "0.26.0"
    assert tuned.reference.card == "simulated NVIDIA H200"
    samples = tuned.reference.figures["output_throughput"].samples
    assert samples is not None and len(samples) == 2, \
        "the trial and its confirmation run are the reference's samples"
    assert "1 confirmation run" in tuned.reference.source
    defaults = configs["defaults"].reference
    assert defaults is not None and len(defaults.figures["goodput"].values) == 2, \
        "the defaults' confirmation run is a sample of the defaults, not of the trial"



def test_export_to_library_on_a_full_disk_is_one_line_and_leaves_the_library_whole(
        library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 35, item 6: a traceback, and the library cut at 8192 bytes (regress then refused
    # every case of it).
    import errno
    import shutil

    lib = tmp_path / "bench.yaml"
    shutil.copyfile(library, lib)
    before = lib.read_bytes()

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # mock.patch as last resort: a real full disk cannot be made in a test's tmp_path.
    monkeypatch.setattr("runners.atomic.os.fsync", disk_full)
    capsys.readouterr()
    code = main(["export", str(library.parent / "study.yaml"), "--trial", "1",
                 "--to-library", str(lib), "--case", "third"])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(lib) in lines[0], \
        lines
    assert "Traceback" not in err
    assert lib.read_bytes() == before, "the library is as it was, whole"
    assert [p.name for p in tmp_path.iterdir()] == ["bench.yaml"], "no temporary left"

def test_round_trip_holds_and_logs_a_run_per_case_per_version(
        library: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    saved = tmp_path / "rebased.yaml"
    code = main(["regress", str(library), "--tracking-uri", uri, "--workdir",
                 str(tmp_path / "w"), "--report", str(tmp_path / "report"),
                 "--save-references", str(saved)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].startswith("same version: a drift check of this machine"), \
        "the first line compares the installed vLLM with the references'"
    assert "case first: held" in out and "case second: held" in out
    rebased = load_library(saved).cases[0].configs[1].reference
    assert rebased is not None and rebased.source.startswith("nightshift regress"), \
        "--save-references writes this run's samples as the next references"
    report = (tmp_path / "report" / "report.md").read_text()
    assert report.splitlines()[2].startswith("same version")
    assert (tmp_path / "report" / "case-first.png").is_file()
    assert (tmp_path / "report" / "report.html").is_file()
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("nightshift-regress/bench")
    assert exp is not None, "one experiment per library"
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["first @ vllm 0.26.0",
                                                     "second @ vllm 0.26.0"]
    run = next(r for r in runs if r.info.run_name == "first @ vllm 0.26.0")
    assert run.data.tags["verdict"] == "held"
    assert run.data.params["trial-1.max_num_seqs"] == "64"
    assert "trial-1.reference.output_throughput" in run.data.metrics


def test_injected_regression_is_caught_and_the_other_case_holds(
        library: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A deployed config with a debug setting left on: every step 40% slower.
    lib = _edited(library, tmp_path, "first", flags={"sim_step_slowdown": 0.4})
    code = main(["regress", str(lib), "--no-mlflow", "--workdir", str(tmp_path / "w")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "case first: regressed" in out
    assert "case second: held" in out, "the case without the injected slowdown holds"
    assert "output_throughput: reference" in out and "regressed" in out


def test_renamed_flag_fails_to_start_naming_the_likely_new_name(
        library: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    variant = tmp_path / "vllm-0.27.json"
    variant.write_text(json.dumps({"version": "0.27.0",
                                   "renamed": {"max-num-seqs": "max-num-sequences"}}))
    code = main(["regress", str(library), "--case", "first", "--no-mlflow", "--workdir",
                 str(tmp_path / "w"), "--simulated-vllm", str(variant)])
    out = capsys.readouterr().out
    assert code == 1, out
    first = out.splitlines()[0]
    assert "installed vLLM 0.27.0 differs from the references' (0.26.0)" in first
    assert "case first: failed to start" in out
    assert "invalid_argument" in out, "the engine's own error, classified"
    assert "--max-num-seqs is not a flag of simulated vLLM 0.27.0" in out
    assert "renamed --max-num-sequences there" in out, "the variant's declared rename"
    assert "defaults: held" in out, "a config the new parser takes still runs"


@pytest.mark.parametrize(("data", "expected"), [
    ({"name": "x"}, "bench.yaml: cases is required; add it (see docs/regress.md)."),
    ({"name": "x", "threshold": 2, "cases": []}, "threshold"),
    ({"name": "x", "cases": [{"name": "c", "model": {"path": "m"},
                              "configs": [{"name": "a", "flgs": {}}]}]},
     "unknown key 'cases[0].configs[0].flgs'; did you mean 'flags'?"),
    ({"name": "x", "cases": [{"name": "c", "model": {"path": "m"}, "configs": [
        {"name": "a", "reference": {"vllm_version": "0.26.0", "card": "H200",
                                    "date": "2026-12-04",
                                    "figures": {"goodput_rps": {"samples": [1.0]}}}}]}]},
     "goodput_rps"),
    # A case's workload is checked as a study's is, before any engine starts: a missing trace,
    # a request longer than the model's context.
    ({"name": "x", "cases": [{"name": "c", "engine": "simulated",
                              "model": {"path": "qwen2.5-0.5b", "load_format": "dummy"},
                              "workload": {"trace": {"path": "nowhere.jsonl"}},
                              "slo": {"tpot_p99_ms": 50},
                              "configs": [{"name": "a"}]}]},
     "cases c: "),
    ({"name": "x", "cases": [{"name": "c", "engine": "simulated",
                              "model": {"path": "qwen2.5-0.5b", "load_format": "dummy"},
                              "workload": {"input_len": 30000, "output_len": 4000,
                                           "num_requests": 4},
                              "slo": {"tpot_p99_ms": 50},
                              "configs": [{"name": "a"}]}]},
     "cases c: "),
])
def test_bad_library_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict[str, Any],
        expected: str) -> None:
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["regress", str(path), "--no-mlflow", "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "w").exists(), "nothing is written before the library is valid"


def test_regressed_needs_the_threshold_and_the_interval() -> None:
    ref = FigureRef(samples=[100.0, 101.0, 99.0, 100.5])
    noisy = compare_figure("output_throughput", ref, [80.0, 120.0, 70.0, 125.0], 0.05)
    assert noisy.ratio < 0.95 or noisy.verdict == "held"
    assert noisy.verdict == "held", "a drop inside a wide interval is not a regression"
    slower = compare_figure("output_throughput", ref, [90.0, 90.5, 89.5, 90.2], 0.05)
    assert slower.verdict == "regressed" and slower.ci_high is not None and slower.ci_high < 1
    small = compare_figure("output_throughput", ref, [97.0, 97.2, 96.9, 97.1], 0.05)
    assert small.verdict == "held", "a real but sub-threshold change holds"
    faster_latency = compare_figure("tpot_p50_ms", FigureRef(samples=[10.0, 10.1]),
                                    [8.0, 8.1], 0.05)
    assert faster_latency.verdict == "improved" and faster_latency.ratio > 1, \
        "a lower latency is better: the ratio is oriented"
    from_interval = compare_figure(
        "output_throughput", FigureRef(mean=100.0, ci_low=98.0, ci_high=102.0, n=3),
        [85.0, 86.0], 0.05)
    assert from_interval.verdict == "regressed" and from_interval.spread_from == "both"
    assert math.isclose(compare_figure("output_throughput", FigureRef(samples=[5.0]), [5.0],
                                       0.05).ratio, 1.0)
    none_met = compare_figure("goodput", FigureRef(samples=[38.6]), [0.0, 0.0, 0.0], 0.05)
    assert none_met.verdict == "regressed" and "a sample of 0 has no log" in \
        none_met.sentence(0.05), "goodput 0 (no request met the SLO) regresses, said plainly"


def test_flag_check_names_dropped_and_renamed_flags() -> None:
    table = VllmVariant.from_dict({"version": "0.27.0", "renamed": {"max_num_seqs":
                                                                    "max_num_sequences"},
                                   "dropped": ["enable-chunked-prefill"]}).flag_table()
    config = LibraryConfig(name="a", flags={"max_num_seqs": 8, "enable_chunked_prefill": True,
                                            "sim_step_slowdown": 0.1, "block_size": 16,
                                            "no_async_scheduling": True})
    problems = {p.flag: p for p in flag_problems(config.flags, table)}
    assert set(problems) == {"--max-num-seqs", "--enable-chunked-prefill"}, \
        "sim_ faults and flags the parser knows pass, a negated one (--no-async-scheduling) too"
    assert problems["--max-num-seqs"].new_name == "max-num-sequences", "the declared rename"
    assert problems["--enable-chunked-prefill"].new_name is None


def test_flag_check_names_the_release_that_removed_a_flag_from_the_tables() -> None:
    table = VllmVariant.from_dict({"version": "0.27.0"}).flag_table()
    problems = flag_problems({"max_num_partial_prefills": 2, "max_num_seqs": 8}, table)
    assert [p.sentence for p in problems] == [
        "--max-num-partial-prefills was removed in vLLM 0.27.0 (the last release with it: "
        "0.26.0), so simulated vLLM 0.27.0's flags (0.27.0 table) refuses it"]
    assert flag_problems({"max_num_partial_prefills": 2},
                         VllmVariant().flag_table()) == [], "0.26 takes it"


def test_a_case_on_a_newer_release_is_shown_the_capacity_moving_changes_since_its_reference(
) -> None:
    from optimizer.regress.measure import CaseOutcome, Installed
    from optimizer.regress.report import capacity_lines
    from search_spaces.engine.tables import bundled_flags

    def outcome(version: str) -> CaseOutcome:
        return CaseOutcome(name="c", installed=Installed("vllm", version, "H200",
                                                         bundled_flags(version)),
                           configs=(), date="2026-12-06", rounds=1, repeats=1,
                           objective="goodput", reference_versions=("0.26.0",))

    lines = capacity_lines(outcome("0.29.0"))
    assert any(line.startswith("capacity-moving default change since vLLM 0.26.0: 0.28.0: "
                               "the KV budget") for line in lines), lines
    assert any("0.29.0: Model Runner V2 is the default for every model" in line
               for line in lines), lines
    assert capacity_lines(outcome("0.26.0")) == [], "same release: nothing moved"
    assert not any("0.29.0:" in line for line in capacity_lines(outcome("0.28.0"))), \
        "a change after the release the case ran on is not its"


def test_the_h200_library_is_a_valid_library() -> None:
    spec = load_library(Path(__file__).parents[1] / "fixtures" / "regress" / "h200-library.yaml")
    assert [c.name for c in spec.cases] == ["qwen7b-chat", "smollm2-135m"]
    assert all(c.engine == "vllm" and c.configs[0].reference is not None for c in spec.cases)


def test_export_to_library_refuses_a_trial_the_quality_gate_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    study_path = _study_file(tmp_path)
    study = open_study(load_study(study_path))
    for number, is_refused in ((0, False), (1, True)):
        trial = study.ask()
        if number == 0:
            trial.set_user_attr(ATTR_BASELINE, True)
        trial.set_constraint("quality", 1.0 if is_refused else 0.0)
        trial.set_user_attr("record", {
            "state": "complete", "flags": {}, "metrics": {"output_throughput": 100.0},
            "quality": {"failed": ["perplexity +3% (limit +1%)"]} if is_refused else None,
            "conclusion": ""})
        study.tell(trial, 1.0)
    lib = tmp_path / "bench.yaml"
    assert main(["export", str(study_path), "--trial", "1", "--to-library", str(lib)]) == 2
    err = capsys.readouterr().err
    assert "the quality gate refused it" in err and "--force-quality" in err
    assert not lib.exists(), "nothing is written for a refused trial"


def test_an_e2el_only_slo_defines_goodput_for_export_and_the_library(tmp_path: Path) -> None:
    """`vllm bench serve --goodput e2el:MS` counts goodput against an end-to-end bound alone,
    and so does a study (runners/workload.py `SLO.is_set`): its export keeps the goodput figure
    and the library takes the case with the goodput objective."""
    study_path = _study_file(tmp_path)
    data = yaml.safe_load(study_path.read_text())
    study_path.write_text(yaml.safe_dump({**data, "slo": {"e2el_ms": 5000.0}}))
    study = open_study(load_study(study_path))
    trial = study.ask()
    metrics = {"objective.goodput": 4.0, "request_goodput": 4.0, "output_throughput": 120.0,
               "median_tpot_ms": 9.0, "p99_ttft_ms": 40.0}
    trial.set_user_attr(ATTR_BASELINE, True)
    trial.set_user_attr("record", TrialRecord(
        state="complete", params={}, conclusion="measured", values=(4.0,), metrics=metrics,
        is_baseline=True).to_user_attr())
    study.tell(trial, 4.0)
    lib = tmp_path / "bench.yaml"
    assert main(["export", str(study_path), "--trial", "0", "--to-library", str(lib),
                 "--case", "e2el"]) == 0
    case = load_library(lib).cases[0]
    assert case.objective == "goodput" and case.slo.e2el_ms == 5000.0
    reference = case.configs[0].reference
    assert reference is not None and reference.figures["goodput"].values == [4.0]
