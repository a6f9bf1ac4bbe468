"""The `nightshift` command as a user meets it: usage errors, help, `hw` without a GPU, and the
trial table `status` prints and the live display draws, at 80 and 160 columns. Every case runs
the real `main` on the installed typer (issue 22)."""

from __future__ import annotations

import inspect
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import typer
import yaml
from rich.console import Console

from optimizer.bottleneck import LABELS
from optimizer.cli import app, main
from optimizer.cli.table import (
    TableRow,
    clip,
    clip_changes,
    figure,
    short_label,
    trial_table,
)
from optimizer.config import parse_study
from optimizer.storage.study import count_trials, open_study

USAGE_ERRORS = [
    pytest.param([], id="bare"),
    pytest.param(["status"], id="missing-argument"),
    pytest.param(["bogus"], id="unknown-command"),
    pytest.param(["--bogus"], id="unknown-top-option"),
    pytest.param(["status", "--bogus", "study.yaml"], id="unknown-option"),
    pytest.param(["export", "study.yaml", "--trial", "abc"], id="bad-value"),
    pytest.param(["stop", "study.yaml", "--wait", "3"], id="extra-argument"),
    pytest.param(["audit", "--bogus", "--", "vllm", "serve", "x"], id="audit-unknown-option"),
    pytest.param(["audit", "--jsn", "--", "vllm", "serve", "x"], id="audit-misspelt-json"),
]


def test_installed_typer_raises_its_bundled_clicks_usage_errors() -> None:
    """What `main` relies on (pyproject pins typer 0.29.x): typer's own click, not `click`."""
    from typer._click.exceptions import UsageError

    assert typer.__version__.startswith("0.29."), "pyproject.toml pins typer 0.29.x"
    with pytest.raises(UsageError):
        app(args=["status"], standalone_mode=False, prog_name="nightshift")


@pytest.mark.parametrize("argv", USAGE_ERRORS)
def test_usage_error_is_one_line_and_the_usage_with_exit_2(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2, "a usage error is bad input"
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == "", "nothing on stdout: a script reading it sees no output"
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2, f"one line and the usage, got {lines}"
    assert lines[0].startswith("error: ")
    assert lines[1].startswith("Usage: nightshift") and "--help" in lines[1]
    assert "{" not in lines[1], "the usage names arguments plainly"


def test_bare_and_unknown_command_name_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    main([])
    first = capsys.readouterr().err.splitlines()[0]
    assert "no command given" in first and "start, status, stop" in first
    main(["stup"])
    assert "Did you mean 'stop'" in capsys.readouterr().err


def test_audit_refuses_an_unknown_option_rather_than_auditing(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 22: `audit --bogus -- vllm serve x` said "no findings", exit 0."""
    assert main(["audit", "--bogus", "--", "vllm", "serve", "x"]) == 2
    captured = capsys.readouterr()
    assert "no findings" not in captured.out and "--bogus" in captured.err
    assert main(["audit", "--jsn", "--", "vllm", "serve", "x"]) == 2
    assert "--json" in capsys.readouterr().err, "the close option is suggested"


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def test_help_has_plain_placeholders_whole_sentences_and_an_example(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for name in _commands():
        line = next(x for x in top.splitlines() if x.strip().startswith(name + " "))
        assert "..." not in line, f"{name}'s summary is whole in the command list: {line!r}"
    for name, command in _commands().items():
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "Example" in text, f"{name} --help has an example"
        assert "{" not in text and "<bool>" not in text and "<str>" not in text, \
            f"{name} --help shows placeholders, not typer's type tags"
        summary = " ".join(inspect.getdoc(command.callback).split("\n\n")[0].split())
        assert summary in " ".join(text.split()), f"{name}: the description reads as written"
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.help, f"{name} {param.opts[0]} has a description"


def _bad_study(tmp_path: Path, kind: str) -> Path:
    """A study `start` refuses, each on a foreign error it chains: SQLite's (a damaged store,
    before the start), YAML's (the file itself), SQLAlchemy's (a check pydantic wrapped)."""
    from tests.builders import write_study

    if kind == "yaml":
        path = tmp_path / "study.yaml"
        path.write_text("name: s\nbudget: {trials: [1\n", encoding="utf-8")
        return path
    if kind == "damaged store":
        store = tmp_path / "garbled.db"
        store.write_bytes(b"SQLite format 3\x00" + b"\xa5" * 5000)
        return write_study(tmp_path, storage=f"sqlite:///{store}",
                           tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    return write_study(tmp_path, storage="not a url")


@pytest.mark.parametrize(("kind", "foreign"), [
    ("damaged store", "sqlite3.DatabaseError: file is not a database"),
    ("yaml", "yaml.parser.ParserError"),
    ("storage URL", "sqlalchemy.exc.ArgumentError: Could not parse SQLAlchemy URL"),
])
def test_debug_prints_the_chained_traceback_after_the_same_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        kind: str, foreign: str) -> None:
    """A start-up ConfigError kept its foreign cause but nothing wrote it: `--debug` prints it
    after the one line, which stays as it is; without `--debug` the line is all (and a
    `--debug` run leaves the next run without it)."""
    monkeypatch.chdir(tmp_path)
    study = _bad_study(tmp_path, kind)
    argv = ["start", str(study), "--dry-run", "--no-progress"]
    assert main(["--debug", *argv]) == 2, "still bad input"
    debug = capsys.readouterr()
    assert main(argv) == 2
    plain = capsys.readouterr()
    lines = [line for line in plain.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[:5]
    assert "Traceback" not in plain.err, "without --debug the one line is all"
    assert debug.err.splitlines()[0] == lines[0], "the same line first"
    assert "Traceback (most recent call last)" in debug.err
    assert foreign in debug.err, f"the foreign error is printed: {debug.err[-2000:]}"
    assert "optimizer.errors.ConfigError" in debug.err
    assert debug.out == plain.out == "", "stdout stays a command's report alone"
    assert not (tmp_path / "results").exists() and not (tmp_path / "m.db").exists(), \
        "refused before anything is written, with --debug too"


def test_an_error_holding_brackets_prints_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The console prints text, not markup: a seed's domain `[256, 64, 1024]` had vanished from
    its one line ("is outside its domain ;"), read as a markup tag."""
    from tests.builders import categorical_space, write_study

    monkeypatch.chdir(tmp_path)
    space = categorical_space(tmp_path, max_num_seqs=[256, 64])
    study = write_study(tmp_path, trials=1, engine="simulated", search_space=str(space),
                        seed_trials=[{"max_num_seqs": 3}])
    assert main(["start", str(study), "--dry-run", "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "max_num_seqs=3 is outside its domain [256, 64" in err, err


def test_hw_without_a_gpu_names_the_simulated_preset_and_how_to_choose(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runners.hardware import preset_names
    from runners.hardware_probe import probe

    if probe().has_gpu:
        pytest.skip("this machine has a GPU")
    assert main(["hw"]) == 0
    text = capsys.readouterr().out
    assert "no NVIDIA GPU found" in text and "simulated.hardware" in text
    assert "h200 unless set" in text, "the schema's default preset"
    assert all(name in text for name in preset_names()), "every preset is listed"
    assert '"gpus": []' not in text, "no all-zero profile"
    saved = tmp_path / "hw.json"
    assert main(["hw", "-o", str(saved)]) == 1 and not saved.exists(), "nothing to save"
    capsys.readouterr()
    assert main(["hw", "--preset", "l4"]) == 0 and "NVIDIA L4" in capsys.readouterr().out
    assert main(["hw", "--preset", "nope"]) == 2


def test_figures_are_rounded_to_three_digits_with_units() -> None:
    from optimizer.cli.results import values_text

    assert figure(34.378811948857305, "req/s") == "34.4 req/s"
    assert figure(8192.4, "tok/s") == "8,192 tok/s"
    assert figure(0.98123) == "0.981" and figure(7.0) == "7.00" and figure(None) == ""
    assert values_text(["goodput"], [34.378811948857305]) == "goodput 34.4 req/s/GPU"
    assert values_text(["throughput", "tpot"], [8190.4, 8.1]) == \
        "throughput 8,190 tok/s/GPU, 8.10 ms TPOT p99"


def test_clipping_cuts_at_words_and_counts_the_flags_left_out() -> None:
    text = "tensor_parallel_size=2 +6: 4.15x (1 run) vs defaults; memory-bound"
    assert clip(text, 30, 2) == "tensor_parallel_size=2 +6:\n4.15x (1 run) vs defaults…"
    assert clip(text, 80, 1) == text
    flags = ["tensor_parallel_size=2", "attention_backend=TRITON_ATTN", "quantization=fp8"]
    assert clip_changes(flags, 30, 1) == "tensor_parallel_size=2 +2 more"
    assert clip_changes(flags, 80, 1) == " ".join(flags)


FLAGS = {"tensor_parallel_size": 2, "attention_backend": "TRITON_ATTN", "kv_cache_dtype": "fp8",
         "max_num_batched_tokens": 16384, "max_num_seqs": 512, "gpu_memory_utilization": 0.94,
         "max_model_len": 8192}
# As the daemon stores it: at most conclusions.SHORT_CHARS (70) characters.
SHORT = "tensor_parallel_size=2 +6: 4.15x (1 run) vs defaults; memory-bound"


def _rows() -> list[TableRow]:
    return [
        TableRow(0, "complete", {}, (3.9612,), 13.61, "memory-bound",
                 "defaults: 3.96 req/s; memory-bound", 28.1, "(vLLM defaults)"),
        *[TableRow(n, "complete", FLAGS, (16.43,), 12.52, "communication-bound", SHORT, 16.3)
          for n in range(1, 12)],
        TableRow(12, "failed", {"max_num_seqs": 2048}, (), None, "",
                 "max_num_seqs=2048: failed (oom_at_start)", 4.0),
        TableRow(13, "complete", FLAGS, (7.54,), 11.6, "", "confirmation (best): goodput "
                 "7.54 req/s", 18.4, "(confirmation: best)"),
    ]


def _draw(renderable: Any, width: int) -> list[str]:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(renderable)
    return buffer.getvalue().splitlines()


def _row_heights(lines: list[str]) -> list[int]:
    """Lines per trial: a row starts where the trial column holds a number."""
    starts = [i for i, line in enumerate(lines) if re.match(r"^\s*\d+\s", line)]
    return [b - a for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]


def test_trial_table_fits_80_columns_in_at_most_three_lines_a_trial() -> None:
    """Issue 22: at 80 columns every conclusion wrapped to 10+ lines."""
    lines = _draw(trial_table(_rows(), ["goodput"], 80), 80)
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert max(_row_heights(lines)) <= 3, "changes over a short conclusion, clipped"
    text = "\n".join(lines)
    assert "tensor_parallel_size=2 +6 more" in text, "the flags left out are counted"
    assert "comm " in text, "labels shortened: communication-bound"


def test_trial_table_at_160_columns_keeps_every_token_whole() -> None:
    """Issue 22: at 160 columns cells were cut mid-token."""
    lines = _draw(trial_table(_rows(), ["goodput"], 160), 160)
    assert max(len(line.rstrip()) for line in lines) <= 160
    text = "\n".join(lines)
    assert SHORT in text, "the short conclusion whole, on one line"
    tokens = set(text.split())
    shown = [f"{k}={v}" for k, v in FLAGS.items() if f"{k}={v}" in tokens]
    assert len(shown) >= 3 and "+4 more" in text, "whole flags, the rest counted"
    for word in " ".join(SHORT.split()).split():
        assert word in tokens, f"{word!r} is whole"
    assert "16.4" in tokens and "…" not in text, "nothing cut"


def test_live_table_counts_confirmation_runs_apart_and_fits_the_terminal(
        tmp_path: Path) -> None:
    from optimizer.cli.live import LiveProgress
    from optimizer.run.events import TrialEvent

    cfg = parse_study({"name": "live", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 10},
                       "results_dir": str(tmp_path)})
    progress = LiveProgress(cfg)
    progress.on_event(TrialEvent("finished", 0, {}, "complete", 3.9612, 13.6,
                                 "defaults: 3.96 req/s; memory-bound", 28.0, "memory-bound"))
    progress.on_event(TrialEvent("finished", 1, FLAGS, "complete", 16.43, 12.5, SHORT, 16.0,
                                 "communication-bound"))
    progress.on_event(TrialEvent("started", 2, FLAGS, confirm="best"))
    for width in (80, 160):
        lines = _draw(progress, width)
        assert max(len(line.rstrip()) for line in lines) <= width
        assert "2/2 trials" in lines[0] and "1 confirmation run" in lines[0], \
            "a confirmation run is no trial of the budget"
        assert "(confirmation: best)" in "\n".join(lines)
    assert SHORT in "\n".join(_draw(progress, 160))


def test_live_table_after_a_resume_counts_the_earlier_trials_and_paces_on_this_start(
        tmp_path: Path) -> None:
    from optimizer.cli.live import LiveProgress
    from optimizer.run.events import TrialEvent

    cfg = parse_study({"name": "resumed", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 8}, "slo": {"tpot_p99_ms": 10},
                       "results_dir": str(tmp_path)})
    now = [1000.0]
    progress = LiveProgress(cfg, done_before=5, clock=lambda: now[0])
    assert progress.title().startswith("resumed: 5/8 trials, 0 min"), progress.title()
    assert "ETA" not in progress.title(), "no pace yet: no estimate"
    progress.on_event(TrialEvent("finished", 5, {}, "complete", 3.9, 13.6, "x", 600.0, ""))
    now[0] += 600.0  # this start's first trial took 10 minutes: 2 trials left
    assert progress.title() == "resumed: 6/8 trials, 10 min  [###############-----]  ETA ~20 min"


def _record(state: str, flags: dict[str, Any], value: float | None, short: str) -> dict[str, Any]:
    return {"state": state, "params": {}, "flags": flags,
            "values": [value] if value is not None else None,
            "metrics": {"p99_tpot_ms": 8.123456} if value is not None else {},
            "conclusion": short + " and a long explanation " * 12, "conclusion_short": short,
            "verdict": {"label": "memory-bound"}, "wall_s": 61.26}


def test_status_counts_confirmations_and_repeats_apart_with_rounded_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22: `status` said "16 complete" where the report said "12 trials"."""
    from optimizer.cli import results

    data = {"name": "counted", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 3},
            "slo": {"tpot_p99_ms": 10}, "results_dir": str(tmp_path / "results")}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    study = open_study(parse_study(data, path=path))
    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    trials = [
        ({"baseline": True}, "complete", {}, 29.612345, "defaults: 29.6 req/s"),
        ({}, "complete", {"quantization": "fp8"}, 34.378811948857305,
         "quantization=fp8: 1.16x (1 run) vs defaults; memory-bound"),
        ({"duplicate_of": 1}, "complete", {"quantization": "fp8"}, 34.378811948857305,
         "same config as trial 1"),
        ({"confirm": "defaults"}, "complete", {}, 29.1, "confirmation (defaults)"),
        ({"confirm": "best"}, "complete", {"quantization": "fp8"}, 33.9, "confirmation (best)"),
    ]
    for attrs, state, flags, value, short in trials:
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": flags.get("quantization", "none")}, distributions=dist,
            value=value, user_attrs={**attrs, "record": _record(state, flags, value, short)}))
    study.enqueue_trial({"quantization": "none"})
    counts = count_trials(study.get_trials(deepcopy=False))
    assert (counts.trials, counts.confirmation_runs, counts.repeats, counts.queued) == \
        (2, 2, 1, 1)

    buffer = io.StringIO()
    monkeypatch.setattr(results, "out", Console(file=buffer, width=80, color_system=None))
    assert main(["status", str(path)]) == 0
    text = buffer.getvalue()
    first = text.splitlines()[0]
    assert "2 trials (2 complete); 2 confirmation runs; 1 repeat of a measured config " \
           "(not launched); 1 queued" in first
    assert "recommended: trial 1, goodput 34.4 req/s" in text
    assert not re.search(r"\d\.\d{4,}", text), "no raw floats"
    assert "(confirmation: best)" in text and "and a long explanation" not in text, \
        "short conclusions in the table; the full ones are in MLflow and the report"

    assert "SIMULATED" not in text and "simulated" not in text, \
        "a study of vLLM's measurements carries no simulated mark"


def test_status_of_a_simulated_study_marks_every_figure_line_simulated(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 7 (session 13): the quickstart's `status` showed the simulated engine's figures
    as measurements ("recommended: trial 5, goodput 42.5 req/s/GPU", "re-measured: ...
    confirmed: the 95% interval excludes 1.0") with no word of the simulated engine."""
    from optimizer.cli import results
    from optimizer.results.confirmation import confirm_summary

    data = {"name": "modelled", "engine": "simulated", "model": {"path": "qwen2.5-7b"},
            "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 10},
            "results_dir": str(tmp_path / "results")}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    study = open_study(parse_study(data, path=path))
    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    argv = ["/usr/bin/python3", "-m", "runners.simulated", "--port", "8000"]
    for attrs, flags, value in (({"baseline": True}, {}, 32.90),
                                ({}, {"quantization": "fp8"}, 42.48),
                                ({"confirm": "defaults"}, {}, 32.90),
                                ({"confirm": "best"}, {"quantization": "fp8"}, 42.48)):
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": flags.get("quantization", "none")}, distributions=dist,
            value=value, user_attrs={**attrs, "record": {
                **_record("complete", flags, value, "x"), "argv": argv}}))
    study.set_user_attr("confirm", confirm_summary(
        "goodput", 1, 0, [{"defaults": 32.90, "best": 42.48}] * 2, is_simulated=True))
    buffer = io.StringIO()
    monkeypatch.setattr(results, "out", Console(file=buffer, width=100, color_system=None))
    assert main(["status", str(path)]) == 0
    lines = buffer.getvalue().splitlines()
    assert lines[1] == "engine: SIMULATED (figures from a model, not measurements)", lines
    assert lines[2].strip() == "simulated figures (a model, not measurements)", \
        "the table's title"
    pick = next(line for line in lines if line.startswith("recommended: "))
    assert pick.startswith("recommended: trial 1, goodput 42.5 req/s/GPU (simulated)"), pick
    last = next(line for line in lines if "vs the defaults" in line)
    assert last.startswith("simulated repeats: trial 1 (the exported config)") and \
        "confirmed:" not in last and "repeats of a model, not a confirmation" in last, last


def test_counts_say_which_failures_were_lost_to_infrastructure_and_re_run() -> None:
    """A trial lost to a worker and queued again is "failed" in its record, but its config is
    measured under another number: the count says so rather than look like a config failure."""
    from optimizer.storage.study import TrialCounts

    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    trials = [
        optuna.trial.create_trial(params={"quantization": "none"}, distributions=dist,
                                  value=1.0, user_attrs={"record": _record("complete", {}, 1.0,
                                                                           "d")}),
        optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                  params={"quantization": "fp8"}, distributions=dist),
        optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                  params={"quantization": "fp8"}, distributions=dist),
        optuna.trial.create_trial(params={"quantization": "fp8"}, distributions=dist,
                                  value=2.0, user_attrs={"retry_of": 1, "record": _record(
                                      "complete", {"quantization": "fp8"}, 2.0, "f")}),
    ]
    for number, t in enumerate(trials):
        t.number = number
    counts = count_trials(trials)
    assert counts == TrialCounts({"complete": 2, "pruned": 0, "failed": 2, "running": 0},
                                 0, 0, 0, 0, rerun=1)
    assert counts.describe() == "4 trials (2 complete, 2 failed, 1 of them re-run)"
    waiting = optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING,
                                        params={"quantization": "fp8"}, distributions=dist,
                                        user_attrs={"retry_of": 2})
    waiting.number = 4
    assert count_trials([*trials, waiting]).rerun == 1, "a copy still queued has not run"


def test_an_interrupt_while_starting_prints_the_resume_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C before the daemon's own handler is installed (Ray takes seconds to start).
    Patched by path, as a last resort: a real signal cannot be timed into that window."""
    from tests.builders import write_study

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr("optimizer.run.runtime.build_daemon", interrupted)
    path = write_study(tmp_path, trials=1)
    assert main(["start", str(path), "--dry-run", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert f"resume with: nightshift start {path} --dry-run" in err and "Traceback" not in err

    # Every option that decides which study and stores it runs on, quoted for the shell:
    # without --storage the printed command would start a new study elsewhere.
    storage = f"sqlite:///{tmp_path}/other dir/optuna.db"
    given = ["--storage", storage, "--tracking-uri", f"sqlite:///{tmp_path}/m lf.db",
             "--ray-address", "127.0.0.1:6379", "--trials", "3"]
    assert main(["start", str(path), "--dry-run", "--no-progress", "-v", *given]) == 130
    line = next(x for x in capsys.readouterr().err.splitlines() if "resume with: " in x)
    assert shlex.split(line.split("resume with: ", 1)[1]) == \
        ["nightshift", "start", str(path), "--dry-run", *given], \
        "the resume command repeats every override given, and no display option"


def test_what_nightshift_writes_is_private_to_the_user(tmp_path: Path) -> None:
    # A subprocess: the umask is the process's, and this one's must stay as the tests set it.
    script = ("import os, sys\nfrom optimizer.cli import main\n"
              "code = main(['hw', '--preset', 'h200', '--output', sys.argv[1]])\n"
              "os.makedirs(sys.argv[2])\n"
              "print(code)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hw.json"),
                          str(tmp_path / "dir")], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"})
    assert out.stdout.strip().splitlines()[-1] == "0", out.stderr[-500:]
    assert (tmp_path / "hw.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "dir").stat().st_mode & 0o777 == 0o700, "directories made are 0700"


def test_status_never_shows_a_failed_trial_of_another_config_as_the_defaults(
        tmp_path: Path) -> None:
    from optimizer.cli.results import status_rows

    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/o.db")
    defaults = {"max_num_seqs": 256, "block_size": 16}
    study.enqueue_trial(defaults, user_attrs={"baseline": True})
    study.enqueue_trial({"max_num_seqs": 64, "block_size": 16})
    for _ in range(2):
        trial = study.ask()
        trial.suggest_categorical("max_num_seqs", [64, 256])
        trial.suggest_categorical("block_size", [16, 32])
        # What Recovery writes for a trial lost with the daemon: params, no flags.
        trial.set_user_attr("record", {"state": "failed", "params": trial.params, "flags": {},
                                       "failure_reason": "daemon_lost"})
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    rows = status_rows(study.get_trials())
    assert rows[0].changes_note == "(vLLM defaults)"
    assert rows[1].changes == {"max_num_seqs": 64}, "its own change, never '(defaults)'"


def test_the_status_table_calls_a_baseline_that_ran_fixed_flags_the_baseline(
        tmp_path: Path) -> None:
    """The session-14 H100 study (fixed quantization and kv_cache_dtype fp8) showed its
    baseline as "(vLLM defaults)" under "changes vs defaults"."""
    from optimizer.cli.results import status_rows
    from optimizer.results.baseline_words import baseline_words

    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/o.db")
    study.enqueue_trial({"max_num_seqs": 256}, user_attrs={"baseline": True})
    trial = study.ask()
    trial.suggest_categorical("max_num_seqs", [64, 256])
    trial.set_user_attr("record", {"state": "complete", "params": trial.params, "flags": {},
                                   "is_baseline": True, "conclusion_short": "baseline: 11 req/s"})
    study.tell(trial, 11.0)
    fixed = baseline_words({"quantization": "fp8", "kv_cache_dtype": "fp8"})
    assert status_rows(study.get_trials(), fixed)[0].changes_note == "(baseline)"
    assert status_rows(study.get_trials())[0].changes_note == "(vLLM defaults)", \
        "no fixed flags: the vLLM defaults, as before"
    text = "\n".join(_draw(trial_table([TableRow(0, "complete", {}, (11.0,))], ["goodput"],
                                       160, baseline=fixed), 160))
    assert "changes vs baseline" in text and "(baseline)" in text and "defaults" not in text


def test_every_label_has_a_short_form_of_its_own_that_fits_the_bound_column() -> None:
    """The status table's `bound` column shows `short_label`: `-bound` cut, else a short form
    (`comp+mem` for compute-and-memory-bound, which cut would leave 18 characters wide)."""
    shorts = {label: short_label(label) for label in LABELS}
    assert len(set(shorts.values())) == len(shorts), shorts
    assert all(len(short) <= 8 for short in shorts.values()), shorts
    assert shorts["compute-and-memory-bound"] == "comp+mem"
