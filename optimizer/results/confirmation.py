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
    pairs = [{"defaults": float(d.values[0]), "best": float(b.values[0])} for d, b in kept]
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
        values: dict[str, float] = {}
        measured_numbers: list[int] = []
        for label, source in (("defaults", baseline), ("best", best)):
            if is_stopping():
                return
            measured = measure(params_of(source), label)
            if measured is None or not has_measurement(measured):
                logger.warning("%s run %s failed; the comparison stops",
                               "repeat" if doing != "confirming" else "confirmation",
                               measured.number if measured is not None else "?")
                return
            values[label] = float(measured.values[0])
            measured_numbers.append(measured.number)
            runs.append(measured)
        pairs.append(values)
        numbers.append(measured_numbers)
    # Each round's values are per GPU (as Optuna holds them), so is the ratio: said so where
    # either config uses more than one GPU.
    num_gpus = [record.num_gpus if (record := record_of(t)) is not None else
                gpus_of(params_of(t)) for t in (best, baseline)]
    summary = confirm_summary(cfg.objectives[0], best.number, baseline.number, pairs,
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
                    pairs: Sequence[Mapping[str, float]], *,
                    per_gpu: bool = False, is_simulated: bool = False,
                    words: BaselineWords = DEFAULTS) -> dict[str, Any]:
    """The gain of `best` over `baseline` from interleaved rounds: the per-round ratios
    (oriented so > 1 is better), their geometric mean and its 95% t-interval, taken on the log
    ratios so that both ends are ratios too (an interval on the ratios themselves can reach
    below zero with two rounds); None bounds from one round. `per_gpu`: a config used more
    than one GPU, so the sentence says the ratio is per GPU (the values are). `is_simulated`:
    the rounds ran the simulated engine, so nothing was measured and nothing is confirmed:
    its repeats differ as far as the model and the host's load move them (on an idle host
    often not at all, on a busy one far), and an interval from them is neither measured noise
    nor the model's alone. A round whose divisor is 0 has no ratio (None, never inf): the
    summary's gain is then None and its sentence says why. `words` names the baseline (the
    vLLM defaults, or them + the study's fixed flags)."""
    maximize = OBJECTIVES[objective].direction == "maximize"
    ratios: list[float | None] = []
    for pair in pairs:
        a, b = pair["defaults"], pair["best"]
        # A round whose divisor measured 0 has no ratio (never inf: nothing is infinitely
        # better than a measured 0); the comparison then states none.
        ratios.append((b / a if a > 0 else None) if maximize else (a / b if b > 0 else None))
    n = len(ratios)
    undefined = [i + 1 for i, r in enumerate(ratios) if r is None]
    defined = [r for r in ratios if r is not None]
    is_finite = not undefined and all(math.isfinite(r) and r > 0 for r in defined)
    logs = [math.log(r) for r in defined] if is_finite else []
    mean: float | None = math.exp(sum(logs) / n) if is_finite else \
        (sum(defined) / n if not undefined else None)
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
    if mean is None:  # low and high are None too: no interval without every ratio
        zero = words.the if maximize else f"trial {best}"
        rounds_said = ", ".join(map(str, undefined))
        verdict = SIMULATED_VERDICT if is_simulated else "no ratio, not confirmed"
        sentence = (f"{head}: {objective}: no ratio to {what} ({zero} measured 0 in round"
                    f"{'s' if len(undefined) > 1 else ''} {rounds_said}): {verdict}")
        is_confirmed = False
    else:
        gain = gains.interval_gain(mean, low, high, n)
        verdict = SIMULATED_VERDICT if is_simulated else \
            gains.confirmation_verdict(gain, f"the {words.short}")
        sentence = f"{head}: {objective} {gains.format_gain(gain, what)}: {verdict}"
        is_confirmed = gain.is_better and not is_simulated
    return {"objective": objective, "best_trial": best, "baseline_trial": baseline,
            "rounds": [dict(p) for p in pairs], "ratios": ratios, "gain": mean,
            "is_confirmed": is_confirmed, "verdict": verdict,
            "is_simulated": is_simulated, "ci_low": low, "ci_high": high,
            "sentence": sentence}
