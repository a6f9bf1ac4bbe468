"""A gain over the vLLM defaults, always with what bounds it: the capacity brackets of both
configs, a confidence interval from re-measurement, or nothing (one measurement each, said so).

Every "Nx the defaults" nightshift prints (report, MLflow tags, CLI, daemon log, conclusions)
is formatted here, so none can state a bare ratio. Every gain is per GPU (`gain_over`,
`objectives.per_gpu`): a config on two GPUs is compared with the defaults per GPU, so that two
copies of the defaults are no loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from optimizer.results.at_load import AtLoads
from optimizer.results.objectives import OBJECTIVES, on_all_gpus
from runners.capacity.bracket import Bracket

Basis = Literal["capacity", "interval", "single"]


@dataclass(frozen=True)
class Gain:
    """How many times better a config is than the defaults (> 1 = better), and its bounds.

    `basis` says what the bounds are: "capacity": the ratio the two capacity brackets allow
    (best_low / defaults_high to best_high / defaults_low; an open end is None); "interval": a
    95% confidence interval over interleaved re-measurements; "single": one measurement each,
    no bounds.
    """

    value: float | None  # the point ratio; None when it is undefined (a capacity of 0)
    low: float | None  # lower bound; None = open (nothing shown)
    high: float | None  # upper bound; None = open (unbounded)
    basis: Basis
    num_rounds: int = 1  # measurements behind an "interval"
    # A "capacity" gain's axis: on "concurrency" the ratio is of concurrent requests, not of
    # the objective (goodput is in req/s): `objective_gain` then holds the objective's own.
    axis: str | None = None
    objective_gain: Gain | None = None  # the objective's ratio beside a concurrency ratio
    # The fixed load level both sides were measured at, where that is not both operating
    # points ("concurrency=8"): named after the ratio. None: at their operating points.
    load: str | None = None
    # Why no ratio is shown: the two were measured at no common load ("" = comparable).
    not_comparable: str = ""
    # The rounds each side was measured in, where fewer (`num_rounds`) were compared: a final
    # confirmation's round at no common load is set aside. None: every round was compared.
    rounds_each: int | None = None

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>` (the point) and `<prefix>.low` / `<prefix>.high` where the ends are
        closed: an open end is left out, never written as a number."""
        out = {}
        for key, value in ((prefix, self.value), (f"{prefix}.low", self.low),
                           (f"{prefix}.high", self.high)):
            if value is not None and math.isfinite(value):
                out[key] = float(value)
        return out

    @property
    def excludes_one(self) -> bool:
        """Whether the bounds show a difference: the whole range above 1, or below it."""
        return self.is_better or self.is_worse

    @property
    def is_better(self) -> bool:
        """Shown better than the defaults: the whole range above 1. A capacity range is open
        (each capacity is at least its lower end and below its upper one), so brackets that
        only touch, [8.9, 18.9) and [18.9, 40), already show it: the ratio exceeds 1.00."""
        if self.low is None:
            return False
        return self.low >= 1.0 if self.basis == "capacity" else self.low > 1.0

    @property
    def is_worse(self) -> bool:
        if self.high is None:
            return False
        return self.high <= 1.0 if self.basis == "capacity" else self.high < 1.0


def capacity_gain(best: Bracket, defaults: Bracket) -> Gain:
    """The capacity ratio two brackets allow. The point is the ratio of their lower ends (the
    loads each was shown to sustain); it is None when the defaults met the SLO nowhere."""
    b_low, b_high = best.met_load, best.missed_load
    d_low, d_high = defaults.met_load, defaults.missed_load
    value = b_low / d_low if b_low and d_low else None
    low = (b_low or 0.0) / d_high if d_high else None
    if low == 0.0:
        low = None  # nothing shown above 0: an open end
    high = b_high / d_low if b_high is not None and d_low else None
    return Gain(value, low, high, "capacity", axis=best.axis)


def point_gain(best: float | None, defaults: float | None, *, maximize: bool) -> Gain:
    """One measurement each: the ratio (oriented so > 1 is better), with no bounds."""
    value: float | None = None
    if best is not None and defaults is not None and math.isfinite(best) and \
            math.isfinite(defaults):
        if maximize:
            value = best / defaults if defaults > 0 else None
        else:
            value = defaults / best if best > 0 else None
    return Gain(value, None, None, "single")


def per_gpu_bracket(bracket: Bracket, num_gpus: int) -> Bracket:
    """A capacity bracket per GPU: both ends divided by the GPUs the config used (a capacity
    is a rate, or requests in flight, that grows with the GPUs: `objectives.per_gpu`)."""
    if num_gpus <= 1:
        return bracket
    return replace(bracket,
                   met_load=bracket.met_load / num_gpus if bracket.met_load is not None
                   else None,
                   missed_load=bracket.missed_load / num_gpus
                   if bracket.missed_load is not None else None)


def gain_over(value: float | None, defaults: float | None, capacity: Bracket | None,
              defaults_capacity: Bracket | None, *, maximize: bool, num_gpus: int = 1,
              defaults_num_gpus: int = 1, loads: AtLoads | None = None,
              defaults_loads: AtLoads | None = None) -> Gain:
    """A config's gain over the defaults per GPU, with what bounds it: the ratio their capacity
    brackets allow where both were bracketed (a capacity search; each bracket as measured,
    divided here by its config's GPUs; on the concurrency axis with the objective's own ratio
    beside it, `Gain.objective_gain`), else one measurement each (`value` and `defaults` are
    per GPU already: the values Optuna holds) at ONE load: with fixed levels (`loads`,
    `defaults_loads`, `at_load.at_loads`) a level whose load was not applied can leave two
    operating points at different loads, and then the ratio is taken at the level both
    applied (`same_load`), or none is shown (`Gain.not_comparable`)."""
    if capacity is not None and defaults_capacity is not None:
        gain = capacity_gain(per_gpu_bracket(capacity, num_gpus),
                             per_gpu_bracket(defaults_capacity, defaults_num_gpus))
        if gain.axis == "concurrency":
            return replace(gain, objective_gain=point_gain(value, defaults, maximize=maximize))
        return gain
    if loads is not None and defaults_loads is not None and \
            needs_one_load(loads, defaults_loads):
        return same_load(loads, defaults_loads, maximize=maximize)
    return point_gain(value, defaults, maximize=maximize)


def needs_one_load(mine: AtLoads, theirs: AtLoads) -> bool:
    """Whether two trials' fixed levels are compared at one load (`same_load`), not at their
    operating points: a level not applied may have moved an operating point to a lighter load
    than the config's best, so two at different levels, or one at no applied level (every
    level's load unapplied: two such are no equal loads), are compared at one load or not at
    all. Otherwise each operating point is its config's best within the SLO over the same
    levels, and best against best is the comparison (as two capacities are, at their own
    loads)."""
    return (mine.is_moved or theirs.is_moved) and (
        mine.operating is None or theirs.operating is None or mine.operating != theirs.operating)


def same_load(mine: AtLoads, theirs: AtLoads, *, maximize: bool) -> Gain:
    """The ratio of two trials' values (per GPU) at one fixed load, where their operating
    points are two: at `mine`'s operating point where `theirs` applied that level, else at
    theirs where `mine` applied it, else none (`Gain.not_comparable`). A ratio across two
    loads would credit (or blame) the config with the difference in load."""
    here, there = mine.operating, theirs.operating
    if here is None or there is None:
        whose = "no level of either" if here is None and there is None else \
            "none of its levels" if here is None else "none of theirs"
        return Gain(None, None, None, "single", not_comparable=f"{whose} applied its load")
    undefined = ""
    for label in (here, there):
        if label in mine.levels and label in theirs.levels:
            gain = point_gain(mine.value_at(label), theirs.value_at(label), maximize=maximize)
            if gain.value is not None:
                return replace(gain, load=label)
            undefined = f"at {label}, the one load both applied, a figure was 0"
    return Gain(None, None, None, "single", not_comparable=undefined or (
        f"its operating point is {here}, theirs {there}, and neither level's load was "
        "applied in both"))


def interval_gain(mean: float, low: float | None, high: float | None, num_rounds: int, *,
                  load: str | None = None, rounds_each: int | None = None) -> Gain:
    """The final confirmation's gain: the mean of `num_rounds` rounds' ratios with its 95%
    interval (None ends: no interval), at `load` where each round compared the two there (not
    at their operating points), of `rounds_each` rounds measured where more were (the rest were
    not comparable at that load)."""
    return Gain(mean, low, high, "interval" if low is not None else "single", num_rounds,
                load=load, rounds_each=rounds_each
                if rounds_each is not None and rounds_each > num_rounds else None)


def at_level(label: str, value: float | None, theirs: AtLoads, *, maximize: bool) -> Gain:
    """A trial's `value` (per GPU) at the fixed level `label` against the defaults' there
    (`theirs`): a config picked at one level (`export --max-tpot-ms`) is compared at that load,
    whatever the two operating points are; none where the defaults did not apply it
    (`Gain.not_comparable`)."""
    if label not in theirs.levels:
        why = f"the load of their {label} was not applied" if label in theirs.unapplied \
            else f"they measured nothing at {label}"
        return Gain(None, None, None, "single", not_comparable=why)
    if value is None:
        return Gain(None, None, None, "single", not_comparable=f"it has no figure at {label}")
    gain = point_gain(value, theirs.value_at(label), maximize=maximize)
    if gain.value is None:
        return Gain(None, None, None, "single", not_comparable=f"at {label} a figure was 0")
    return replace(gain, load=label)


def as_measured(gain: Gain, objective: str, value: float | None, defaults: float | None,
                capacity: Bracket | None, defaults_capacity: Bracket | None, *,
                num_gpus: int, defaults_num_gpus: int) -> Gain | None:
    """`gain` (`gain_over`'s, per GPU) on all of each side's GPUs: the ratio printed "as
    measured" beside a per-GPU gain (conclusions, the report, the export header). At the one
    load a per-GPU ratio was taken at (`Gain.load`), or with none (`Gain.not_comparable`), that
    ratio scaled by the two GPU counts (a rate; a latency is as measured already); else the
    values and brackets as measured, compared as `gain_over` compares them. `value`,
    `defaults`: per GPU, as Optuna holds them; the brackets as measured. None where both sides
    used one GPU (per GPU and as measured agree)."""
    if max(num_gpus, defaults_num_gpus) <= 1:
        return None
    if gain.load is not None or gain.not_comparable:
        ratio = num_gpus / max(defaults_num_gpus, 1) if OBJECTIVES[objective].is_per_gpu \
            else 1.0
        return replace(gain, value=gain.value * ratio if gain.value is not None else None)
    return gain_over(on_all_gpus(objective, value, num_gpus) if value is not None else None,
                     on_all_gpus(objective, defaults, defaults_num_gpus)
                     if defaults is not None else None,
                     capacity, defaults_capacity,
                     maximize=OBJECTIVES[objective].direction == "maximize")


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _down(value: float) -> str:
    """A lower bound shown to 2 decimals, rounded down so that "more than" stays true."""
    return f"{math.floor(value * 100 + 1e-9) / 100:.2f}"


def _up(value: float) -> str:
    """An upper bound shown to 2 decimals, rounded up so that "less than" stays true."""
    return f"{math.ceil(value * 100 - 1e-9) / 100:.2f}"


def format_gain(gain: Gain, what: str) -> str:
    """One phrase: `1.98x the vLLM defaults (95% CI [1.52x, 2.44x] over 3 rounds)`, `more than
    1.00x and less than 4.49x the vLLM defaults (capacity brackets; lower ends 2.12x)`, `1.25x
    the vLLM defaults (one measurement each: no interval)`. Never a bare ratio. `what` names
    the baseline as the study ran it (`BaselineWords.the`: "the vLLM defaults", or "the
    baseline (vLLM defaults + your fixed flags)"): no default, so no caller names the vLLM
    defaults for a baseline that ran fixed flags. On the concurrency axis the brackets' ratio
    is of concurrent requests, said so, and the objective's own ratio follows it under its own
    name; a ratio at a fixed level other than the operating points names that level."""
    if gain.basis == "capacity":
        text = _capacity_phrase(gain, what)
        if gain.axis != "concurrency":
            return text
        text = "capacity in concurrent requests " + text
        if gain.objective_gain is None or gain.objective_gain.value is None:
            return text
        return (f"{text}; the objective at the two capacities "
                f"{format_gain(gain.objective_gain, what)}")
    if gain.not_comparable:
        return f"no ratio to {what}: not comparable at one load ({gain.not_comparable})"
    if gain.value is None:
        return f"no ratio to {what}"
    if gain.load is not None:
        what = f"{what} at {gain.load}, a load both applied"
    # Rounds counted as compared, and of how many each side ran where fewer were compared.
    of = f" of {gain.rounds_each}" if gain.rounds_each is not None else ""
    if gain.basis == "interval" and gain.low is not None and gain.high is not None:
        return (f"{_x(gain.value)} {what} (95% CI [{_down(gain.low)}x, {_up(gain.high)}x] over "
                f"{gain.num_rounds}{of} rounds)")
    if gain.num_rounds > 1:
        return f"{_x(gain.value)} {what} ({gain.num_rounds}{of} rounds, no interval)"
    if of:
        return f"{_x(gain.value)} {what} (1{of} rounds compared: no interval)"
    return f"{_x(gain.value)} {what} (one measurement each: no interval)"


def _capacity_phrase(gain: Gain, what: str) -> str:
    point = f"; lower ends {_x(gain.value)}" if gain.value is not None else ""
    # Open ends: each capacity is at least its lower end and below its upper one.
    if gain.low is not None and gain.high is not None:
        return (f"more than {_down(gain.low)}x and less than {_up(gain.high)}x {what} "
                f"(capacity brackets{point})")
    if gain.low is not None:
        return f"more than {_down(gain.low)}x {what} (capacity brackets{point})"
    if gain.high is not None:
        return f"less than {_up(gain.high)}x {what} (capacity brackets{point})"
    lower_ends = f" (lower ends {_x(gain.value)})" if gain.value is not None else ""
    return f"no bound on the ratio to {what} from the capacity brackets{lower_ends}"


def short_gain(gain: Gain) -> str:
    """A table cell: `2.12x (1.00, 4.49)` (the ratio lies strictly inside: each capacity is
    at least its lower end and below its upper one), `1.33x [1.19, 1.48]`, `1.25x (1 run)`."""
    if gain.basis == "capacity":
        lo = _down(gain.low) if gain.low is not None else "0"
        hi = _up(gain.high) if gain.high is not None else "inf"
        point = _x(gain.value) if gain.value is not None else "?x"
        # Concurrent requests are not the objective's unit: the cell says whose ratio it is.
        named = "capacity " if gain.axis == "concurrency" else ""
        return f"{named}{point} ({lo}, {hi})"
    if gain.not_comparable:
        return "n/a (no common load)"
    if gain.value is None:
        return "n/a"
    if gain.basis == "interval" and gain.low is not None and gain.high is not None:
        return f"{_x(gain.value)} [{_down(gain.low)}, {_up(gain.high)}]"
    at = f" at {gain.load}" if gain.load is not None else ""
    return f"{_x(gain.value)} (1 run){at}"


def confirmation_verdict(gain: Gain, what: str) -> str:
    """"confirmed" only when the 95% interval excludes 1.0; otherwise says why not. `what`
    names the baseline, as `format_gain`'s; the load where the rounds compared the two is
    named (`Gain.load`)."""
    if gain.basis != "interval" or gain.low is None or gain.high is None:
        if gain.num_rounds > 1:
            # Several rounds and no interval: a round's ratio was 0 (a measured 0, a miss:
            # `confirmation.confirm_summary`), whose log is none.
            return "no interval (a round's ratio was 0), not confirmed"
        if gain.rounds_each is not None:
            return (f"one round of {gain.rounds_each} compared: no interval, not confirmed")
        return "one round: no interval, not confirmed"
    at = f" at {gain.load}" if gain.load is not None else ""
    if gain.is_better:
        return f"confirmed{at}: the 95% interval excludes 1.0"
    if gain.is_worse:
        return f"confirmed worse than {what}{at}: the 95% interval lies below 1.0"
    return f"not confirmed{at}: within noise (the 95% interval contains 1.0)"
