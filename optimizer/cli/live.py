"""The live table of trials the `start` command draws on a terminal, redrawn from the daemon's
events (no progress object passes into the core) and fitted to the terminal's width; its p99
columns are the SLO's own, as `status`'s are."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult

from optimizer.cli.output import console as stderr_console
from optimizer.cli.table import TableRow, trial_table
from optimizer.config import StudyConfig
from optimizer.results.tail_samples import slo_latencies

_SHOWN_ROWS = 25  # the latest trials; `nightshift status` lists them all


class LiveProgress:
    """A table of trials and a bar against the trial budget, redrawn from daemon events. The
    final confirmation runs are shown and counted apart from the budget's trials."""

    def __init__(self, cfg: StudyConfig, console: Console | None = None, *,
                 done_before: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from rich.live import Live

        self.cfg = cfg
        # The p99 columns of the SLO's own bounds (TTFT where it bounds TTFT), as `status`.
        self.latencies = slo_latencies(cfg.spec.slo.model_dump())
        self.rows: dict[int, dict[str, Any]] = {}
        # The daemon's thread writes rows; rich's refresh thread draws them.
        self._lock = threading.Lock()
        # A resume: the search's trials that finished on earlier starts count against the
        # budget; the pace (the ETA) is this start's own.
        self.done_before = done_before
        self.clock = clock
        self.started = clock()
        self.live = Live(self, console=console or stderr_console, refresh_per_second=4)

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def on_event(self, event: Any) -> None:
        if event.kind == "study":
            return
        with self._lock:
            row = dict(self.rows.get(event.number) or {"params": event.params, "label": "",
                                                       "confirm": event.confirm})
            row.update(state=event.state, value=event.value, tpot=event.tpot_p99_ms,
                       tpot_n=event.tpot_p99_num_requests, ttft=event.ttft_p99_ms,
                       ttft_n=event.ttft_p99_num_requests,
                       message=event.message, elapsed=event.elapsed_s)
            if event.label:
                row["label"] = event.label
            self.rows[event.number] = row
        self.live.refresh()

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """Drawn at the width the terminal has at each refresh."""
        yield self.render(options.max_width)

    def _snapshot(self) -> dict[int, dict[str, Any]]:
        with self._lock:
            return dict(self.rows)

    def title(self, rows: dict[int, dict[str, Any]] | None = None) -> str:
        rows = self._snapshot() if rows is None else rows
        budget = self.cfg.spec.budget.trials
        search = [r for r in rows.values() if not r["confirm"]]
        here = sum(1 for r in search if r["state"] in ("complete", "pruned", "failed"))
        done = self.done_before + here
        confirmations = len(rows) - len(search)
        elapsed = self.clock() - self.started
        title = f"{self.cfg.name}: {done}" + (f"/{budget}" if budget else "") + \
            f" trials, {elapsed / 60:.0f} min"
        if budget:
            filled = int(20 * min(1.0, done / budget))
            title += "  [" + "#" * filled + "-" * (20 - filled) + "]"
            if here > 0 and done < budget:  # at this start's pace, trials in parallel included
                title += f"  ETA ~{elapsed / here * (budget - done) / 60:.0f} min"
        if confirmations:
            title += f"; {confirmations} confirmation run{'s' if confirmations > 1 else ''}"
        return title

    def render(self, width: int) -> Any:
        snapshot = self._snapshot()
        rows = []
        for number in sorted(snapshot)[-_SHOWN_ROWS:]:
            r = snapshot[number]
            rows.append(TableRow(
                number=number, state=r["state"], changes=r["params"],
                values=(r["value"],), tpot_p99_ms=r.get("tpot"),
                tpot_p99_num_requests=r.get("tpot_n"), ttft_p99_ms=r.get("ttft"),
                ttft_p99_num_requests=r.get("ttft_n"), label=r["label"],
                conclusion=r["message"] or "", elapsed_s=r["elapsed"],
                changes_note=f"(confirmation: {r['confirm']})" if r["confirm"] else ""))
        return trial_table(rows, self.cfg.objectives[:1], width, title=self.title(snapshot),
                           baseline=self.cfg.baseline_words, latencies=self.latencies)
