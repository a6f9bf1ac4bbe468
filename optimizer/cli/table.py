"""The trial table that `status` prints and the live display redraws, fitted to the terminal's
width: rounded figures with units and short forms in its cells (a trial's `conclusion_short`);
the full conclusions are in MLflow and the report."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.tail_samples import LATENCY_HEADERS, P99Basis

# The room the changes and conclusion columns need side by side (a long flag and most of a
# short conclusion); with less, each trial's changes sit over its conclusion in one column.
WIDE_TEXT_COLUMNS = 72
_GAP = 3  # rich's column separator and padding (SIMPLE_HEAD box, no outer edge)
_CHANGES_MIN = 32  # a long flag (max_num_batched_tokens=16384) and its "+N more"
_CHANGE_LINES = 3  # a trial's flags beyond the defaults: at most this many lines, then "+N"
_CONCLUSION_LINES = 2


@dataclass(frozen=True)
class TableRow:
    """One trial as the table shows it."""

    number: int
    state: str  # complete, pruned, failed, running, pruning, confirm ...
    changes: Mapping[str, Any] | None  # flags beyond the defaults; None: not known yet
    values: Sequence[float | None] = ()  # one per objective, in the study's order
    tpot_p99_ms: float | None = None
    label: str = ""  # the bottleneck classifier's verdict
    conclusion: str = ""  # the short form (a record's `conclusion_short`)
    elapsed_s: float | None = None
    # shown in place of the changes, e.g. "(vLLM defaults)"; "" to list `changes`
    changes_note: str = field(default="")
    # the requests the TPOT p99 is over (optimizer/results/tail_samples.py); None: not known
    tpot_p99_num_requests: int | None = None
    ttft_p99_ms: float | None = None
    ttft_p99_num_requests: int | None = None  # the completed requests the TTFT p99 is over
    # Where its operating point moved (a level's load not applied: `AtLoads.figures_at`),
    # where its figures are ("at concurrency=8", or that no level's load was applied): its
    # first figure marked, the place named under the table (`moved_note`); "": not moved.
    at_load: str = ""

    def p99(self, latency: str) -> tuple[float | None, int | None]:
        """The p99 (ms) and the requests it is over of `latency` (`ttft` or `tpot`)."""
        if latency == "ttft":
            return self.ttft_p99_ms, self.ttft_p99_num_requests
        return self.tpot_p99_ms, self.tpot_p99_num_requests


def figure(value: float | None, unit: str = "") -> str:
    """A measured figure to three significant digits (thousands grouped, no digits below the
    unit past them), with its unit: `34.4 req/s`, `8,192 tok/s`, `0.981`."""
    if value is None or not math.isfinite(value):
        return ""
    if abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif value == 0:
        text = "0"
    else:
        digits = max(0, 2 - math.floor(math.log10(abs(value))))
        text = f"{value:.{digits}f}"
    return f"{text} {unit}".rstrip()


def p99_cell(value_ms: float | None, num_requests: int | None) -> str:
    """A p99 with the requests it is over: `15.4 n=2,000`, `15.4 n=37 thin`
    (optimizer/results/tail_samples.py); the figure alone where the count is not known."""
    shown = figure(value_ms)
    if not shown or num_requests is None or num_requests < 1:
        return shown
    return f"{shown} {P99Basis(num_requests).cell}"


MOVED_MARK = "*"


def value_cell(value: float | None, at_load: str = "") -> str:
    """An objective's figure, marked where the trial's operating point moved
    (`TableRow.at_load`: `8.93*`); `moved_note` names the load under the table. One mark, not
    the load in the cell: the narrowest layout has no column to spare at 80 columns."""
    shown = figure(value)
    return f"{shown}{MOVED_MARK}" if shown and at_load else shown


def moved_note(rows: Sequence[TableRow]) -> str:
    """The line under the table naming where each marked row's figures are: `*: a level's
    load was not applied, so the row's figures are at the load named: trial 11 at
    concurrency=8.`, or, of a row none of whose levels' loads was, that said; "" where no row
    moved."""
    marked = [r for r in rows if r.at_load and r.values]
    if not marked:
        return ""
    where = "at the load named" if all(r.at_load.startswith("at ") for r in marked) else \
        "as named"
    return (f"{MOVED_MARK}: a level's load was not applied, so the row's figures are {where}: "
            f"{'; '.join(f'trial {r.number} {r.at_load}' for r in marked)}.")


def objective_header(name: str) -> str:
    """`goodput req/s per GPU` (a rate is shown per GPU, as Optuna is told it:
    `objectives.per_gpu`; short words, so the column stays narrow); an objective whose unit
    names it already is its unit: `ms TPOT p99`."""
    entry = OBJECTIVES.get(name)
    unit = entry.unit if entry is not None else ""
    if entry is not None and entry.is_per_gpu:
        unit += " per GPU"
    return unit if name.lower() in unit.lower() else f"{name} {unit}".rstrip()


_SHORT_LABELS = {"communication-bound": "comm", "kv-capacity-bound": "kv-cap",
                 "at-physical-limit": "at limit", "compute-and-memory-bound": "comp+mem"}


def short_label(label: str) -> str:
    """A bottleneck label for a narrow column: `memory` for memory-bound, `comm` for
    communication-bound."""
    return _SHORT_LABELS.get(label, label.removesuffix("-bound"))


def clip(text: str, width: int, lines: int) -> str:
    """`text` wrapped at spaces to `width` columns in at most `lines` lines; cut at a word
    with "…" where it is longer (a word longer than the width is broken, as nothing else
    fits)."""
    width = max(width, 2)
    wrapped = textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    kept = wrapped[:lines]
    last = kept[-1]
    while len(last) + 1 > width and " " in last:
        last = last.rsplit(" ", 1)[0]
    kept[-1] = (last[:width - 1] if len(last) + 1 > width else last).rstrip(" ,;:") + "…"
    return "\n".join(kept)


def clip_changes(changes: Sequence[str], width: int, lines: int) -> str:
    """`name=value` tokens wrapped to `width` in at most `lines` lines; those that do not fit
    are counted: `+3 more`."""
    width = max(width, 8)
    for shown in range(len(changes), -1, -1):
        more = f"+{len(changes) - shown} more" if shown < len(changes) else ""
        tokens = [*changes[:shown], *([more] if more else [])]
        wrapped = textwrap.wrap(" ".join(tokens), width, break_on_hyphens=False)
        if len(wrapped) <= lines or shown == 0:
            return "\n".join(wrapped[:lines])
    return ""  # unreachable: shown == 0 returns


def _changes_text(row: TableRow, words: BaselineWords) -> list[str]:
    if row.changes_note:
        return [row.changes_note]
    if row.changes is None:
        return []
    return [f"{k}={v}" for k, v in row.changes.items()] or [f"({words.short})"]


def trial_table(rows: Sequence[TableRow], objectives: Sequence[str], width: int,
                title: str | None = None, baseline: BaselineWords = DEFAULTS,
                latencies: Sequence[str] = ("tpot",)) -> Table:
    """The trials as a rich table at most `width` columns wide. Side by side where there is
    room: trial, changes, state, the objectives, the SLO's p99s, bottleneck, seconds, conclusion
    (the bottleneck shortened to `memory` and then the seconds dropped before a conclusion
    wraps); where the two text columns would have less than WIDE_TEXT_COLUMNS, each trial's
    changes sit over its conclusion in the last column. Cells wrap at spaces, never inside a
    flag that fits its column; a cell too long for its lines ends in "…" (a conclusion) or
    "+N more" (the changes). `baseline` names what the changes are from (the vLLM defaults, or
    the baseline with the study's fixed flags). `latencies`: the p99 columns (`slo_latencies`),
    each shown unless an objective already is that latency."""
    shown = [k for k in latencies if k not in objectives]
    values = [[value_cell(v, r.at_load if i == 0 else "") for i, v in enumerate(r.values)]
              for r in rows]
    longest = max((len(r.conclusion) for r in rows), default=0)
    # Side by side, the first layout that shows the conclusions whole beside the flags: full
    # labels and seconds, then short labels, then no seconds; else the last that leaves the
    # two text columns room enough; else stacked.
    layout: tuple[bool, bool] | None = None  # (full labels, seconds)
    for full_labels, seconds in ((True, True), (False, True), (False, False)):
        fixed = _fixed_columns(rows, values, objectives, shown, full_labels, seconds)
        free = width - sum(w for _, w in fixed) - _GAP * (len(fixed) + 1)
        if free >= longest + _CHANGES_MIN or \
                ((full_labels, seconds) == (False, False) and free >= WIDE_TEXT_COLUMNS):
            layout = (full_labels, seconds)
            break
    is_wide = layout is not None
    full_labels, seconds = layout if layout is not None else (False, False)
    if not is_wide:
        fixed = _fixed_columns(rows, values, objectives, shown, False, False)
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1), title_justify="left")
    if is_wide:
        # The conclusion whole where it fits beside the longest flag (+ "+N more").
        conclusion_w = max(24, min(longest, free - _CHANGES_MIN))
        changes_w = free - conclusion_w
        table.add_column("trial", width=fixed[0][1], justify="right", no_wrap=True)
        table.add_column(f"changes vs {baseline.short}", width=changes_w, overflow="fold")
        for header, w in fixed[1:]:
            table.add_column(header, width=w, overflow="fold",
                             justify="left" if header in _TEXT_HEADERS else "right")
        table.add_column("conclusion", width=conclusion_w, overflow="fold")
    else:
        text_w = max(16, width - sum(w for _, w in fixed) - _GAP * len(fixed))
        for header, w in fixed:
            table.add_column(header, width=w, overflow="fold",
                             justify="left" if header in _TEXT_HEADERS else "right")
        table.add_column(f"changes vs {baseline.short} / conclusion", width=text_w,
                         overflow="fold")
    for r, cells in zip(rows, values, strict=True):
        middle = [r.state, *cells, *[""] * (len(objectives) - len(cells))]
        middle.extend(p99_cell(*r.p99(k)) for k in shown)
        middle.append(r.label if full_labels else short_label(r.label))
        if seconds:
            middle.append(figure(r.elapsed_s))
        if is_wide:
            table.add_row(str(r.number), clip_changes(_changes_text(r, baseline), changes_w,
                                                      _CHANGE_LINES),
                          *middle, clip(r.conclusion, conclusion_w, _CONCLUSION_LINES))
        else:
            stacked = Text(clip_changes(_changes_text(r, baseline), text_w,
                                        _CHANGE_LINES - 1))
            if r.conclusion:
                if stacked:
                    stacked.append("\n")
                stacked.append(clip(r.conclusion, text_w, _CONCLUSION_LINES), style="dim")
            table.add_row(str(r.number), *middle, stacked)
    return table


_TEXT_HEADERS = ("state", "bottleneck", "bound")


def _fixed_columns(rows: Sequence[TableRow], values: Sequence[Sequence[str]],
                   objectives: Sequence[str], latencies: Sequence[str], full_labels: bool,
                   seconds: bool) -> list[tuple[str, int]]:
    """(header, width) of each column but the text ones, in order; each as wide as its
    longest cell or header word."""
    def width_of(header: str, cells: Sequence[str], least: int) -> tuple[str, int]:
        words = [len(w) for w in header.split()]
        return header, max(least, *words, *(len(c) for c in cells))

    columns = [width_of("trial", [str(r.number) for r in rows], 5),
               width_of("state", [r.state for r in rows], 8)]
    for i, name in enumerate(objectives):
        columns.append(width_of(objective_header(name), [v[i] for v in values if i < len(v)],
                                7))
    for k in latencies:
        columns.append(width_of(LATENCY_HEADERS[k], [p99_cell(*r.p99(k)) for r in rows], 8))
    if full_labels:
        columns.append(width_of("bottleneck", [r.label for r in rows], 10))
    else:
        columns.append(width_of("bound", [short_label(r.label) for r in rows], 6))
    if seconds:
        columns.append(width_of("s", [figure(r.elapsed_s) for r in rows], 5))
    return columns


# The `nightshift history` table: one row per earlier study. Side by side from this width; below
# it the row's text sits in two columns, each cell two or three short lines.
HISTORY_WIDE = 140


def _longest_word(cells: Iterable[str], at_most: int = 32) -> int:
    """The longest space-separated word of `cells`, capped at `at_most` (a longer one breaks
    in any layout)."""
    return min(at_most, max((len(w) for c in cells for w in c.split()), default=0))


def history_table(rows: Sequence[Any], width: int, title: str | None = None) -> Table:
    """`optimizer.tuning_memory.earlier_studies.HistoryRow`s at most `width` columns wide, newest
    first as given: study, date, engine and card, the best's change from the defaults, its figure
    with what bounds it, the study's conclusion. Cells wrap at spaces; a longer one ends in "…"."""
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1), title_justify="left")
    study_w = max(12, min(24, max((len(r.study) for r in rows), default=12)))
    card_w = max(16, min(30, max((len(r.card) for r in rows), default=16)))
    free = width - study_w - 16 - card_w - 16 - _GAP * 7
    # The figure keeps its bound (an interval, brackets): the widest text column. Each text
    # column is at least as wide as its longest word (a flag, `name=value,`), else the cell
    # would break inside it: the narrow layout's wider column then wraps at spaces.
    change_w = max(free // 4, _longest_word(r.change for r in rows))
    metric_w = max(free * 2 // 5, _longest_word(r.metric for r in rows))
    conclusion_w = free - change_w - metric_w
    if width >= HISTORY_WIDE and conclusion_w >= _longest_word(r.conclusion for r in rows):
        for header, w in (("study", study_w), ("date (UTC)", 16), ("engine", 16),
                          ("card", card_w), ("best change", change_w),
                          ("best figure, bounds", metric_w), ("conclusion", conclusion_w)):
            table.add_column(header, width=w, overflow="fold")
        for r in rows:
            # Text, not markup: a bound reads `CI [1.52x, 2.44x]`.
            table.add_row(*(Text(c) for c in (
                clip(r.study, study_w, 2), r.date, clip(r.engine_version, 16, 2),
                clip(r.card, card_w, 2), clip(r.change, change_w, 3),
                clip(r.metric, metric_w, 5), clip(r.conclusion, conclusion_w, 3))))
        return table
    left_w = max(20, min(36, width // 3))
    text_w = max(16, width - left_w - _GAP * 2)
    table.add_column("study / date / engine, card", width=left_w, overflow="fold")
    table.add_column("best change / figure, bounds / conclusion", width=text_w,
                     overflow="fold")
    for r in rows:
        left = Text(clip(r.study, left_w, 1) + "\n" + r.date[:left_w] + "\n")
        left.append(clip(f"{r.engine_version}, {r.card}", left_w, 2), style="dim")
        right = Text(clip(r.change or "(no best recorded)", text_w, 1))
        if r.metric:
            right.append("\n" + clip(r.metric, text_w, 4))
        if r.conclusion:
            right.append("\n")
            right.append(clip(r.conclusion, text_w, 2), style="dim")
        table.add_row(left, right)
    return table
