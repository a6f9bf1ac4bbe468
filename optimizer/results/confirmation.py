"""The final comparison: the recommended config and the defaults re-measured one at a time,
interleaved, and the gain stated as the geometric mean of the per-round ratios with a 95%
t-interval on their logs."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from optimizer.config import StudyConfig
from optimizer.results import gains
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.conclusion import reference_of
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.recommendation import (
    has_measurement,
    is_measured,
    no_baseline_reason,
    params_of,
    recommended_trial,
)
from optimizer.results.trial_record import (
    STUDY_ATTR_CONFIRM,
    confirm_label,
    confirmation_of,
    gpus_of,
    is_baseline,
    record_of,
)
from runners.simulated.launcher import is_simulated_argv

logger = logging.getLogger(__name__)

# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond, the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# The verdict of a comparison the simulated engine ran: a model's repeats confirm nothing.
# Their spread is not measured noise, nor only the model's: the simulated engine's figures
# follow the host's load too (docs/simulated-engine.md), so a busy host can move one repeat
# far from another. They never change the pick (`recommendation.is_confirmed_noise`).
SIMULATED_VERDICT = ("simulated: repeats of a model, not a confirmation (their spread is the "
                     "simulated engine's, which the host's load moves as well as the model; "
                     "not measured noise); they do not change the pick")


def t975(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (>= 1); the
    normal's beyond the table."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1 but got {df}.")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def confirm(study: optuna.Study, cfg: StudyConfig,
            measure: Callable[[Mapping[str, Any], str], FrozenTrial | None],
            is_stopping: Callable[[], bool]) -> None:
    """Measure the recommended config (what `export` writes: the best, or the simplest
    within noise of it) and the defaults again, one at a time and interleaved (defaults,
    best, defaults, best, ...), so drift in the machine hits both alike. `measure(params,
    label)` runs one confirmation trial to its end and returns it (None when stopped)."""
    rounds = cfg.spec.confirm_rounds
    best = recommended_trial(study)
    trials = study.get_trials(deepcopy=False)
    # The defaults as measured: a config failure (infeasible before launch, an OOM) is held
    # complete in Optuna to teach the sampler, yet it measured nothing; launching it again
    # would fail again (or divide by its 0), so there is no comparison to make.
    baseline = next((t for t in trials if is_baseline(t) and is_measured(t)), None)
    reason = no_baseline_reason(study) if baseline is None else None
    if rounds and best is not None and reason:
        logger.info("no final confirmation: %s could not run (%s); no gain over %s is "
                    "stated", cfg.baseline_words.the, reason,
                    "it" if cfg.baseline_words.has_fixed_flags else "them")
    if not rounds or cfg.is_multi_objective or best is None or baseline is None or \
            best.number == baseline.number or confirm_label(best) is not None:
        return
    if confirmation_of(study) is not None:
        return  # a resumed study that was confirmed already
    # On the simulated engine these are repeats of a model, never a confirmation: so named.
    doing = "simulated repeats (not a confirmation)" if is_simulated_run(best) or \
        is_simulated_run(baseline) else "confirming"
    logger.info("%s: trial %d (best) vs trial %d (defaults), %d interleaved rounds", doing,
                best.number, baseline.number, rounds)
    # A round an earlier start measured whole stands: the round goes on from it (a stop or a
    # dead daemon cut it), never measures it again.
    kept = measured_rounds(trials, params_of(baseline), params_of(best))[:rounds]
    objective = cfg.objectives[0]
    pairs = [round_values(objective, d, b) for d, b in kept]
    numbers = [[d.number, b.number] for d, b in kept]  # the trials of each round
    runs = [t for pair in kept for t in pair]  # the trials the rounds compare
    paired = {t.number for t in runs}
    cut = [t.number for t in trials if confirm_label(t) in ("defaults", "best")
           and t.number not in paired and t.number > baseline.number
           and params_of(t) in (params_of(baseline), params_of(best))]
    if kept:
        logger.info("%s: %d of %d rounds were measured whole before this start "
                    "(trials %s) and are kept", doing, len(kept), rounds,
                    ", ".join(f"{d.number}+{b.number}" for d, b in kept))
    if cut:
        logger.info("%s: trials %s are in no round (a round's two runs are measured "
                    "back to back, and theirs was cut): their rounds are measured again", doing,
                    ", ".join(map(str, cut)))
    for _ in range(rounds - len(pairs)):
        measured_runs: list[FrozenTrial] = []
        for label, source in (("defaults", baseline), ("best", best)):
            if is_stopping():
                return
            measured = measure(params_of(source), label)
            if measured is None or not has_measurement(measured):
                logger.warning("%s run %s failed; the comparison stops",
                               "repeat" if doing != "confirming" else "confirmation",
                               measured.number if measured is not None else "?")
                return
            measured_runs.append(measured)
            runs.append(measured)
        pairs.append(round_values(objective, *measured_runs))
        numbers.append([t.number for t in measured_runs])
    # Each round's values are per GPU (as Optuna holds them), so is the ratio: said so where
    # either config uses more than one GPU.
    num_gpus = [record.num_gpus if (record := record_of(t)) is not None else
                gpus_of(params_of(t)) for t in (best, baseline)]
    summary = confirm_summary(objective, best.number, baseline.number, pairs,
                              per_gpu=max(num_gpus) > 1,
                              is_simulated=any(is_simulated_run(t) for t in runs),
                              words=cfg.baseline_words)
    # Which runs the comparison used: a cut round's run is in none (named, not left unsaid).
    summary.update(round_trials=numbers, cut_trials=cut)
    study.set_user_attr(STUDY_ATTR_CONFIRM, summary)
    logger.info("%s against the defaults: %s", "simulated repeats" if summary["is_simulated"]
                else "re-measured", summary["sentence"])


def is_simulated_run(trial: FrozenTrial) -> bool:
    """Whether the trial ran the simulated engine (its record's launch command says so): its
    figures are a model's, never measurements."""
    record = record_of(trial)
    return record is not None and is_simulated_argv(record.argv)


def round_values(objective: str, defaults: FrozenTrial, best: FrozenTrial) -> dict[str, Any]:
    """One round's two values as its ratio compares them, per GPU (as Optuna holds them), by
    `gains.gain_over`'s rule: where every fixed level of both runs was applied, each run's
    operating point (best against best); where a level of either was not, the two at one load
    both applied, named (`"load"`) where it is not both operating points (two operating points
    at one level compare there, unnamed, as where nothing moved), or none (`"not_comparable"`:
    why, values as Optuna holds them; so where every level of a run was unapplied): an
    unapplied level can move one run's operating point to a lighter load than the other's, and
    a ratio across two loads is no gain. A capacity search's runs have no fixed
    levels: their operating points, as ever."""
    pair: dict[str, Any] = {"defaults": float(defaults.values[0]),
                            "best": float(best.values[0])}
    refs = [reference_of(t, None, objective) for t in (best, defaults)]
    mine, theirs = (ref.loads if ref is not None else None for ref in refs)
    if mine is None or theirs is None or not (mine.is_moved or theirs.is_moved):
        return pair
    gain = gains.gain_over(pair["best"], pair["defaults"], None, None, loads=mine,
                           defaults_loads=theirs,
                           maximize=OBJECTIVES[objective].direction == "maximize")
    if gain.not_comparable:
        return {**pair, "not_comparable": gain.not_comparable}
    # A load is named only where the two were compared away from their operating points:
    # two operating points at one level compare there as they do where nothing moved, so the
    # round is at the same place as such a round (`_averaged`), never set aside from it.
    load = gain.load
    at_load = (mine.value_at(load), theirs.value_at(load)) if load is not None else (None, None)
    if at_load[0] is None or at_load[1] is None:
        return pair
    return {"defaults": at_load[1], "best": at_load[0], "load": load}


def measured_rounds(trials: Sequence[FrozenTrial], defaults: Mapping[str, Any],
                    best: Mapping[str, Any]) -> list[tuple[FrozenTrial, FrozenTrial]]:
    """The rounds of the comparison of `best` against `defaults` (their params) measured
    whole so far, in trial order: a complete "defaults" confirmation run followed, as the
    next confirmation run of the two configs, by a complete "best" one. A defaults run whose
    partner failed or never ran is in no round: the two are measured back to back, so that
    drift in the machine hits both alike."""
    rounds: list[tuple[FrozenTrial, FrozenTrial]] = []
    waiting: FrozenTrial | None = None  # a defaults run its best run has not followed yet
    for trial in sorted(trials, key=lambda t: t.number):
        label = confirm_label(trial)
        if label not in ("defaults", "best") or not trial.state.is_finished() or \
                params_of(trial) != (defaults if label == "defaults" else best):
            continue
        is_measured = has_measurement(trial)
        if label == "defaults":
            waiting = trial if is_measured else None
        else:
            if waiting is not None and is_measured:
                rounds.append((waiting, trial))
            waiting = None
    return rounds


def confirm_summary(objective: str, best: int, baseline: int,
                    pairs: Sequence[Mapping[str, Any]], *,
                    per_gpu: bool = False, is_simulated: bool = False,
                    words: BaselineWords = DEFAULTS) -> dict[str, Any]:
    """The gain of `best` over `baseline` from interleaved rounds: the per-round ratios
    (oriented so > 1 is better), their geometric mean and its 95% t-interval, taken on the log
    ratios so that both ends are ratios too (an interval on the ratios themselves can reach
    below zero with two rounds); None bounds from one round. Each pair is a round's two values
    (`round_values`): one that names a `"load"` compared the two there, one that says
    `"not_comparable"` has no ratio. The rounds averaged are those compared at one place (the
    load most were compared at, the earliest on a tie): a round compared elsewhere, or at no
    one load, is named and set aside, never averaged. `per_gpu`: a config used more
    than one GPU, so the sentence says the ratio is per GPU (the values are). `is_simulated`:
    the rounds ran the simulated engine, so nothing was measured and nothing is confirmed:
    its repeats differ as far as the model and the host's load move them (on an idle host
    often not at all, on a busy one far), and an interval from them is neither measured noise
    nor the model's alone. A round whose divisor is 0 has no ratio (None, never inf): the
    summary's gain is then None and its sentence says why. A round whose ratio is 0 (the best's
    goodput 0: a miss) is a measurement: the mean is then the ratios' arithmetic one, with no
    interval, and the sentence names the round. `words` names the baseline (the
    vLLM defaults, or them + the study's fixed flags)."""
    maximize = OBJECTIVES[objective].direction == "maximize"
    ratios: list[float | None] = []
    for pair in pairs:
        a, b = pair["defaults"], pair["best"]
        # A round whose divisor measured 0 has no ratio (never inf: nothing is infinitely
        # better than a measured 0); the comparison then states none.
        ratios.append(None if pair.get("not_comparable") else
                      (b / a if a > 0 else None) if maximize else (a / b if b > 0 else None))
    averaged, aside = _averaged(pairs)
    load = pairs[averaged[0]].get("load") if averaged else None
    n, of = len(averaged), f" of {len(pairs)}"
    undefined = [i + 1 for i in averaged if ratios[i] is None]
    zeros = [i + 1 for i in averaged if ratios[i] == 0]
    defined = [r for r in (ratios[i] for i in averaged) if r is not None]
    is_finite = bool(averaged) and not undefined and \
        all(math.isfinite(r) and r > 0 for r in defined)
    logs = [math.log(r) for r in defined] if is_finite else []
    mean: float | None = math.exp(sum(logs) / n) if is_finite else \
        (sum(defined) / n if averaged and not undefined else None)
    low = high = None
    if n > 1 and is_finite:
        mean_log = sum(logs) / n
        sd = math.sqrt(sum((x - mean_log) ** 2 for x in logs) / (n - 1))
        half = t975(n - 1) * sd / math.sqrt(n)
        low, high = math.exp(mean_log - half), math.exp(mean_log + half)
    what = f"{words.the} per GPU" if per_gpu else words.the
    how = "re-run interleaved on the simulated engine" if is_simulated else \
        "re-measured interleaved"
    head = f"trial {best} (the exported config) vs the {words.short} (trial {baseline}), {how}"
    set_aside = f"; not averaged: {'; '.join(aside)}" if aside else ""
    is_confirmed = False
    if not averaged:  # no bounds either: no round compared the two at one load
        verdict = SIMULATED_VERDICT if is_simulated else "not comparable, not confirmed"
        why = "; ".join(f"round {i + 1}: {p['not_comparable']}" for i, p in enumerate(pairs))
        sentence = (f"{head}: {objective}: no ratio to {what}: not comparable at one load in "
                    f"any round{of} ({why}): {verdict}")
    elif mean is None:  # low and high are None too: no interval without every ratio
        zero = words.the if maximize else f"trial {best}"
        at = f" at {load}, a load both applied" if load is not None else ""
        verdict = SIMULATED_VERDICT if is_simulated else "no ratio, not confirmed"
        sentence = (f"{head}: {objective}: no ratio to {what}{at} ({zero} measured 0 in "
                    f"{_rounds(undefined)}{of}){set_aside}: {verdict}")
    else:
        gain = gains.interval_gain(mean, low, high, n, load=load, rounds_each=len(pairs))
        verdict = SIMULATED_VERDICT if is_simulated else \
            gains.confirmation_verdict(gain, f"the {words.short}")
        # A ratio of 0 is a measurement (a miss), averaged as one: named, with its rounds.
        missed = (f"; {f'trial {best}' if maximize else words.the} measured 0 (a miss) in "
                  f"{_rounds(zeros)}{of}" if zeros else "") + \
            (", so the mean is of the ratios, not their logs" if zeros and n > 1 else "")
        sentence = (f"{head}: {objective} {gains.format_gain(gain, what)}{missed}{set_aside}: "
                    f"{verdict}")
        is_confirmed = gain.is_better and not is_simulated
    return {"objective": objective, "best_trial": best, "baseline_trial": baseline,
            "rounds": [dict(p) for p in pairs], "ratios": ratios, "gain": mean,
            "num_rounds": n, "load": load,
            "is_confirmed": is_confirmed, "verdict": verdict,
            "is_simulated": is_simulated, "ci_low": low, "ci_high": high,
            "sentence": sentence}


def _rounds(numbers: Sequence[int]) -> str:
    """`round 1`, `rounds 1, 3`."""
    return f"round{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))}"


def _averaged(pairs: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[str]]:
    """The rounds (indices) a gain averages: those compared at one place, the load most of
    the comparable rounds were compared at (None: the two runs' operating points; the
    earliest round's on a tie), and a phrase for each round set aside, saying where it
    compared the two or why it could not."""
    places = [p.get("load") for p in pairs]
    comparable = [i for i, p in enumerate(pairs) if not p.get("not_comparable")]
    kept: list[int] = []
    if comparable:
        first = max(comparable, key=lambda i: (
            sum(places[j] == places[i] for j in comparable), -i))
        kept = [i for i in comparable if places[i] == places[first]]
    aside = []
    for i, pair in enumerate(pairs):
        if pair.get("not_comparable"):
            aside.append(f"round {i + 1}, not comparable at one load "
                         f"({pair['not_comparable']})")
        elif i not in kept:
            aside.append(f"round {i + 1}, compared at " + (
                f"{places[i]}" if places[i] is not None else "the two runs' operating points"))
    return kept, aside
