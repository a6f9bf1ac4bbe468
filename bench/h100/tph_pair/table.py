"""Issue 32's trials-per-hour pair as tables: the "before" arm (fixed capacity probes, the code
before the steady staircase) and the "after" arm (today's staircase with its warm-up and hold),
one trial each, read from their Optuna storages. Usage, on the packed results brought back from
the device (or on a dry run's):
    python3 bench/h100/tph_pair/table.py RESULTS_DIR
where RESULTS_DIR holds tph-before/ and tph-after/ (the two study files' results_dir), each with
its optuna.db. Records of both code versions are read as stored (dicts), not through today's
record class, so the old code's record needs nothing of today's. Simulated runs are labelled."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna

from optimizer.results.trial_record import ATTR_RECORD

ARMS = (("before", "tph-before"), ("after", "tph-after"))
# daemon.log: "2026-12-06 17:46:16,954 INFO optimizer.run.daemon: trial 0 started: ..."
TRIAL_STARTED = re.compile(
    r"^(\d{4})-(\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO \S+: trial (\d+) started")
# the trial's server.log, vLLM's lines: "(APIServer pid=1411) INFO 12-06 09:06:37 [loggers.py..."
SERVER_LINE = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                         r"(\d\d-\d\d \d\d:\d\d:\d\d) \[")


class BadResults(Exception):
    """RESULTS_DIR is not what the pair writes: one line names what and the fix."""


@dataclass(frozen=True)
class Arm:
    name: str
    study: str
    record: dict[str, Any] | None  # the first trial's that has one; None: no trial ended
    state: str  # the Optuna state of that trial
    commit: str | None  # the before arm's COMMIT file (bench/h100/tph_pair/before.sh)
    num_trials: int
    # A trial that did not end (the device time ran out): how long it ran at least, from its
    # start in daemon.log to its server's last log line.
    ran_at_least_s: float | None = None

    @property
    def is_simulated(self) -> bool:
        return self.record is not None and "runners.simulated" in self.record.get("argv", [])

    @property
    def startup_s(self) -> float | None:
        """The trial's start-up as the record says (the simulated engine's is modelled)."""
        value = (self.record or {}).get("startup", {}).get("total_s")
        return float(value) if value is not None else None

    @property
    def startup_wall_s(self) -> float | None:
        """Seconds the start-up took on the trial's clock: the simulated engine sleeps its
        modelled start-up times its --startup-time-scale."""
        if self.startup_s is None:
            return None
        argv = (self.record or {}).get("argv", [])
        if self.is_simulated and "--startup-time-scale" in argv:
            return self.startup_s * float(argv[argv.index("--startup-time-scale") + 1])
        return self.startup_s

    @property
    def wall_s(self) -> float | None:
        value = (self.record or {}).get("wall_s")
        return float(value) if value is not None else None

    @property
    def per_hour(self) -> float | None:
        return 3600.0 / self.wall_s if self.wall_s else None


def read_arm(name: str, folder: Path) -> Arm:
    """One arm from `folder`/optuna.db (the one study it holds, whatever its name)."""
    db = folder / "optuna.db"
    if not db.is_file():
        raise BadResults(f"{db}: not found; RESULTS_DIR must hold tph-before/ and tph-after/ "
                         "(the h200-results folder of the packed results)")
    storage = f"sqlite:///{db}"
    summaries = optuna.get_all_study_summaries(storage)
    if len(summaries) != 1:
        raise BadResults(f"{db}: {len(summaries)} studies; a pair's arm holds one")
    study = optuna.load_study(study_name=summaries[0].study_name, storage=storage)
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    found = next((t for t in trials if isinstance(t.user_attrs.get(ATTR_RECORD), dict)), None)
    commit_file = folder / "COMMIT"
    return Arm(name=name, study=summaries[0].study_name,
               record=found.user_attrs[ATTR_RECORD] if found else None,
               state=(found or trials[0]).state.name if trials else "NONE",
               commit=commit_file.read_text().strip()[:12] if commit_file.is_file() else None,
               num_trials=len(trials), ran_at_least_s=None if found else ran_at_least(folder))


def ran_at_least(folder: Path) -> float | None:
    """Seconds from the first trial's start (daemon.log) to its server's last log line, or
    None where either is missing: a lower bound on the wall of a trial that did not end."""
    daemon = folder / "daemon.log"
    lines = daemon.read_text(errors="replace").splitlines() if daemon.is_file() else []
    start = next((m for line in lines if (m := TRIAL_STARTED.match(line))), None)
    if start is None:
        return None
    server = folder / "trials" / f"{int(start.group(3)):04d}" / "server.log"
    if not server.is_file():
        return None
    stamps = [m.group(1) for line in server.read_text(errors="replace").splitlines()
              if (m := SERVER_LINE.search(line))]
    if not stamps:
        return None
    fmt = "%Y-%m-%d %H:%M:%S"
    begun = datetime.strptime(f"{start.group(1)}-{start.group(2)}", fmt)
    last = datetime.strptime(f"{start.group(1)}-{stamps[-1]}", fmt)
    return (last - begun).total_seconds()


def _num(value: Any, fmt: str = ".0f") -> str:
    return "-" if value is None else format(float(value), fmt)


def claim(arm: Arm) -> str:
    """The capacity claim with its bracket, as the record states it."""
    cap = (arm.record or {}).get("capacity") or {}
    met, missed = cap.get("met_load"), cap.get("missed_load")
    if met is not None and missed is not None:
        text = f"[{met:g}, {missed:g}) req/s"
    elif met is not None:
        text = f">= {met:g} req/s"
    elif missed is not None:
        text = f"< {missed:g} req/s (no load met)"
    else:
        return "none"
    return f"{text}, {cap.get('status', '?')}"


def _kind(step: dict[str, Any]) -> str:
    server = step.get("server") or {}
    if not any(key.startswith("steady.") for key in server):
        return "probe"
    if server.get("steady.is_hold"):
        return "hold"
    return "step (missed in warm-up)" if server.get("steady.is_missed_in_warmup") else "step"


def judged(arm: Arm) -> str:
    """How the claim's lower end was judged: the fixed probe's figures (before), or whether a
    hold held it (after)."""
    record = arm.record or {}
    cap = record.get("capacity") or {}
    met = cap.get("met_load")
    steps = record.get("steps") or []
    at_met = [s for s in steps if s.get("meets_slo") and
              (s.get("level") or {}).get("request_rate_rps") == met]
    if met is None or not at_met:
        return "no load met"
    step = at_met[-1]
    metrics, server = step.get("metrics") or {}, step.get("server") or {}
    tpot = f"TPOT p99 {_num(metrics.get('p99_tpot_ms'), '.2f')} ms"
    if _kind(step) == "probe":
        completed, duration = metrics.get("completed"), metrics.get("duration_s")
        rate = completed / duration if completed and duration else None
        return (f"fixed probe at {met:g}: {tpot} over its {_num(completed)} requests, sent "
                f"for a fixed time then drained ({_num(duration, '.1f')} s in all: "
                f"{_num(rate, '.2f')} req/s completed of {met:g} offered)")
    window = f"{_num(server.get('steady.window_s'))} s window, " \
             f"{_num(server.get('steady.num_measured'))} requests, {tpot}"
    if cap.get("held") is True:
        return f"held: the hold at {met:g} met the SLO ({window})"
    if cap.get("held") is False:
        return f"not held: every hold missed; the lower end is a short step's ({window})"
    return f"short steps only, no hold ({window})"


def summary_table(arms: Sequence[Arm]) -> list[str]:
    lines = ["| arm | code | trial started UTC | trial wall s | start-up s (compile cache) | "
             "wall - start-up s | probes or steps | capacity claim | how the claim was judged | "
             "trials/hour |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        record = arm.record
        code = f"fixed probes, {arm.commit}" if arm.name == "before" and arm.commit else \
            "fixed probes" if arm.name == "before" else "staircase + hold"
        if record is None:
            ran = "" if arm.ran_at_least_s is None else \
                f"; its logs ran >= {arm.ran_at_least_s:.0f} s"
            most = "-" if not arm.ran_at_least_s else f"<= {3600 / arm.ran_at_least_s:.1f}"
            lines.append(f"| {arm.name} ({arm.study}) | {code} | - | no trial ended "
                         f"(state {arm.state}){ran} | - | - | - | - | - | {most} |")
            continue
        started = record.get("engine_started_unix_s")
        when = datetime.fromtimestamp(started, UTC).strftime("%H:%M:%S") if started else "-"
        startup = _num(arm.startup_s)
        if arm.is_simulated:
            startup += f" modelled, {_num(arm.startup_wall_s, '.1f')} slept"
        cache = (record.get("startup") or {}).get("compile_cache", "?")
        rest = arm.wall_s - arm.startup_wall_s if arm.wall_s is not None and \
            arm.startup_wall_s is not None else None
        steps = record.get("steps") or []
        holds = sum(1 for s in steps if _kind(s) == "hold")
        count = f"{len(steps) - holds} + {holds} hold(s)" if holds else str(len(steps))
        lines.append(f"| {arm.name} ({arm.study}) | {code} | {when} | {_num(arm.wall_s)} | "
                     f"{startup} ({cache}) | {_num(rest)} | {count} | {claim(arm)} | "
                     f"{judged(arm)} | {_num(arm.per_hour, '.1f')} |")
    return lines


def steps_table(arm: Arm) -> list[str]:
    """Each probe or step of an arm: what it cost (seconds since the previous one ended, the
    first since the engine was ready) and what it read."""
    record = arm.record or {}
    lines = [f"{arm.name} ({arm.study}), state {record.get('state', arm.state)}:", "",
             "| # | kind | load req/s | verdict | s since previous | "
             "window s (a probe: sent + drained) | requests | TPOT p99 ms | completed req/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    previous = arm.startup_wall_s or 0.0
    for step in record.get("steps") or []:
        metrics, server = step.get("metrics") or {}, step.get("server") or {}
        kind = _kind(step)
        if kind == "probe":  # arrivals for a fixed time, then the drain
            window, count = metrics.get("duration_s"), metrics.get("completed")
            completed = count / window if count and window else None
        else:
            window = server.get("steady.window_s") or server.get("steady.warmup_s")
            count = server.get("steady.num_measured", metrics.get("completed"))
            completed = metrics.get("window.completed_rate_rps")
        verdict = "met" if step.get("meets_slo") else "missed"
        reason = step.get("miss_reason")
        if reason:
            verdict += f": {reason[:90]}{'...' if len(reason) > 90 else ''}"
        elapsed = step.get("elapsed_s")
        lines.append(f"| {step.get('step')} | {kind} | "
                     f"{_num((step.get('level') or {}).get('request_rate_rps'), 'g')} | "
                     f"{verdict} | {_num(elapsed - previous if elapsed is not None else None)} | "
                     f"{_num(window, '.1f')} | {_num(count)} | "
                     f"{_num(metrics.get('p99_tpot_ms'), '.2f')} | {_num(completed, '.2f')} |")
        previous = elapsed if elapsed is not None else previous
    return lines


def ratio_line(before: Arm, after: Arm) -> str:
    if before.per_hour is not None and after.per_hour is None and after.ran_at_least_s:
        most = 3600 / after.ran_at_least_s
        return (f"after / before: <= {most / before.per_hour:.2f}x trials per hour (the after "
                f"arm's trial did not end: it ran >= {after.ran_at_least_s:.0f} s, so <= "
                f"{most:.1f} an hour, against {before.per_hour:.1f}; one trial each; no interval)")
    if before.per_hour is None or after.per_hour is None:
        return "after / before: not given (an arm has no trial that ended)"
    return (f"after / before: {after.per_hour / before.per_hour:.2f}x trials per hour "
            f"({after.per_hour:.1f} against {before.per_hour:.1f}; one trial each, the before "
            f"arm's engine started {'first' if _first(before, after) else 'second'}, side by "
            "side on one machine; no interval)")


def _first(before: Arm, after: Arm) -> bool:
    b = (before.record or {}).get("engine_started_unix_s") or 0.0
    a = (after.record or {}).get("engine_started_unix_s") or 0.0
    return bool(b <= a)


def report(results: Path) -> str:
    arms = [read_arm(name, results / folder) for name, folder in ARMS]
    lines: list[str] = []
    if any(arm.is_simulated for arm in arms):
        lines += ["SIMULATED engine: every figure below comes from its model, never a "
                  "measurement (its start-up is modelled and slept at a fraction).", ""]
    lines += summary_table(arms)
    for arm in arms:
        if arm.num_trials > 1:
            lines += ["", f"{arm.name}: {arm.num_trials} trials stored; the first with a "
                      "record is shown"]
        lines += ["", *steps_table(arm)]
    lines += ["", "trials/hour = 3600 / trial wall (the record's wall_s: engine launch to its "
              "end, start-up included).", ratio_line(arms[0], arms[1])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, metavar="RESULTS_DIR")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        text = report(args.results)
    except BadResults as exc:
        print(f"table.py: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
