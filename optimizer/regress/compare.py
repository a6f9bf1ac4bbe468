"""A re-measurement against its reference: each figure's ratio with a 95% interval (Welch's t on
the log samples, `confirmation.t975`'s quantiles), the verdict (held, improved, regressed) against
the library's threshold, and the flags a vLLM version does not take (removed or renamed, as the
bundled flag tables of each release say)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from optimizer.regress.library import FIGURES, FigureRef
from optimizer.results.confirmation import t975
from search_spaces.engine.releases import flag_change
from search_spaces.engine.tables import VllmFlags, bundled_versions, flag_name

FigureVerdict = Literal["held", "improved", "regressed"]
# "measured only": no reference figure to compare with (nothing held or moved).
CaseVerdict = Literal["held", "improved", "regressed", "failed to start", "failed",
                      "measured only"]
# Worst first: a case takes the worst of its configs' verdicts.
VERDICT_ORDER: tuple[CaseVerdict, ...] = ("failed to start", "failed", "regressed", "improved",
                                          "held", "measured only")
PASSING: frozenset[str] = frozenset({"held", "improved", "measured only"})  # exit code 0


@dataclass(frozen=True)
class FigureComparison:
    """One figure of one config: measured against its reference."""

    figure: str  # a key of FIGURES
    reference: float  # the reference's centre (geometric mean of its samples)
    measured: float  # the same of the new samples
    ratio: float  # oriented so that > 1 is better (measured/reference for a rate)
    ci_low: float | None  # 95% interval of `ratio`; None where there is no spread to use
    ci_high: float | None
    num_reference: int  # samples on each side
    num_measured: int
    # Whose spread the interval covers: "both", "measured", "reference"; "none" (one sample
    # each side) or "zero" (a sample of 0: no log ratio) where there is no interval.
    spread_from: str
    verdict: FigureVerdict

    @property
    def change(self) -> float:
        """The oriented change as a fraction: -0.12 is 12% worse."""
        return self.ratio - 1.0

    def sentence(self, threshold: float) -> str:
        scope = {"both": "both sides' spread", "measured": "the new samples' spread only",
                 "reference": "the reference's spread only"}.get(self.spread_from, "")
        why = "a sample of 0 has no log" if self.spread_from == "zero" else \
            "one sample each side"
        interval = (f"95% CI {self.ci_low:.3f}-{self.ci_high:.3f} from {scope}"
                    if self.ci_low is not None and self.ci_high is not None else
                    f"no interval ({why}): the threshold alone decides")
        return (f"{self.figure}: reference {_fmt(self.reference)}, measured "
                f"{_fmt(self.measured)}, ratio {self.ratio:.3f} (>1 better; {interval}; "
                f"n={self.num_reference}/{self.num_measured}), threshold {threshold:.0%}: "
                f"{self.verdict}")


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _log_stats(values: Sequence[float]) -> tuple[float, float | None, int]:
    """Mean of the logs, the variance of that mean (None from one sample), and its df."""
    logs = [math.log(v) for v in values]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return mean, None, 0
    var = sum((x - mean) ** 2 for x in logs) / (n - 1)
    return mean, var / n, n - 1


def _ref_log_stats(ref: FigureRef) -> tuple[float, float | None, int]:
    if ref.samples is not None:
        return _log_stats(ref.samples)
    mean = math.log(ref.mean) if ref.mean else 0.0
    if ref.ci_low is None or ref.ci_high is None or not ref.ci_low > 0 or ref.n is None:
        return mean, None, 0
    # A 95% t-interval of the mean from n samples: its half-width on the log scale is
    # t975(n-1) standard errors (symmetric on logs, as `confirmation` writes it).
    se = (math.log(ref.ci_high) - math.log(ref.ci_low)) / (2 * t975(ref.n - 1))
    return mean, se * se, ref.n - 1


def compare_figure(figure: str, ref: FigureRef, measured: Sequence[float],
                   threshold: float) -> FigureComparison:
    """`measured` against `ref`: the ratio of their geometric means with Welch's 95% t-interval
    on the logs (each side's spread where it has one; df by Welch-Satterthwaite, rounded down);
    regressed when worse by more than `threshold` and the interval lies wholly below 1,
    improved likewise above; held otherwise. With one sample on each side there is no
    interval and the threshold alone decides (the report says so)."""
    maximize = FIGURES[figure][0] == "maximize"
    positive = ref.center > 0 and all(v > 0 for v in ref.values) and measured and \
        all(v > 0 for v in measured)
    low = high = None
    spread_from = "none"
    if positive:
        m_mean, m_var, m_df = _log_stats(measured)
        r_mean, r_var, r_df = _ref_log_stats(ref)
        diff = m_mean - r_mean
        terms = [(v, df) for v, df in ((m_var, m_df), (r_var, r_df)) if v is not None]
        spread_from = {2: "both", 0: "none"}.get(
            len(terms), "measured" if m_var is not None else "reference")
        ratio_raw = math.exp(diff)
        if terms:
            var = sum(v for v, _ in terms)
            denom = sum(v * v / df for v, df in terms)
            df = max(1, math.floor(var * var / denom)) if denom > 0 else \
                min(df for _, df in terms)
            half = t975(df) * math.sqrt(var)
            low, high = math.exp(diff - half), math.exp(diff + half)
        measured_center = math.exp(m_mean)
        reference_center = math.exp(r_mean)
    else:
        spread_from = "zero"
        measured_center = sum(measured) / len(measured) if measured else 0.0
        reference_center = ref.center
        ratio_raw = measured_center / reference_center if reference_center > 0 else \
            (1.0 if measured_center == 0 else math.inf)
    if maximize:
        ratio = ratio_raw
    else:
        ratio = 1.0 / ratio_raw if ratio_raw > 0 else math.inf
        low, high = (1.0 / high, 1.0 / low) if low is not None and high is not None else \
            (None, None)
    has_interval = low is not None and high is not None
    verdict: FigureVerdict = "held"
    if ratio < 1.0 - threshold and (not has_interval or (high is not None and high < 1.0)):
        verdict = "regressed"
    elif ratio > 1.0 + threshold and (not has_interval or (low is not None and low > 1.0)):
        verdict = "improved"
    return FigureComparison(figure=figure, reference=reference_center, measured=measured_center,
                            ratio=ratio, ci_low=low, ci_high=high,
                            num_reference=len(ref.values) if ref.samples is not None else
                            (ref.n or 1), num_measured=len(measured), spread_from=spread_from,
                            verdict=verdict)


def worst(verdicts: Sequence[str]) -> CaseVerdict:
    """The worst verdict of several ("measured only" when there are none)."""
    for verdict in VERDICT_ORDER:
        if verdict in verdicts:
            return verdict
    return "measured only"


@dataclass(frozen=True)
class FlagProblem:
    """A flag of a config the installed vLLM's parser does not take, and what the flag tables
    say of it: the release that removed or renamed it (and the new name), never a guess."""

    flag: str  # --kebab-case, as on the command line
    new_name: str | None  # renamed: the flag that took its place (kebab-case, no dashes)
    table_source: str  # whose parser: "vLLM 0.27.0-0.27.1's flags (bundled table)"
    change: str | None = None  # the tables' sentence: "--x was removed in vLLM 0.27 ..."

    @property
    def sentence(self) -> str:
        if self.change is not None:
            return f"{self.change}, so {self.table_source} refuses it"
        if self.new_name is not None:
            return (f"{self.flag} is not a flag of {self.table_source}: renamed "
                    f"--{self.new_name} there")
        return (f"{self.flag} is not a flag of {self.table_source}, and no bundled flag table "
                f"({bundled_range()}) has it: not a vLLM flag of these releases")


def bundled_range() -> str:
    versions = bundled_versions()
    return f"vLLM {versions[0]}-{versions[-1]}" if versions else "none"


def flag_problems(flags: Mapping[str, Any], table: VllmFlags) -> list[FlagProblem]:
    """The snake_case `flags` (`sim_` faults aside) that `table`'s parser does not know, each
    with what the tables say: renamed (the table's own renames, or a flag removed in a release
    that added one naming the same config field) or removed, and in which release."""
    out = []
    for key in flags:
        if key.startswith("sim_"):
            continue
        head = flag_name(key).partition(".")[0]
        # `no_async_scheduling: true` is `--no-async-scheduling`: a negatable flag's False.
        if head.startswith("no-") and table.is_negatable(head[3:]):
            continue
        if table.resolve(head) is not None:
            continue
        change = flag_change(head, table.version)
        if head in table.renamed:
            out.append(FlagProblem(flag=f"--{head}", new_name=table.renamed[head],
                                   table_source=table.source))
        elif change is not None:
            out.append(FlagProblem(flag=f"--{head}", new_name=change.new_name,
                                   table_source=table.source, change=change.sentence))
        else:
            out.append(FlagProblem(flag=f"--{head}", new_name=None,
                                   table_source=table.source))
    return out
