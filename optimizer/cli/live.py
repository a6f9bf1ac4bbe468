"""The live table of trials the `start` command draws on a terminal, redrawn from the daemon's
events (no progress object passes into the core)."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from optimizer.cli.output import console
from optimizer.config import StudyConfig


class LiveProgress:
    """A rich table of trials and a bar against the trial budget, redrawn from daemon events."""

    def __init__(self, cfg: StudyConfig) -> None:
        from rich.live import Live

        self.cfg = cfg
        self.rows: dict[int, dict[str, Any]] = {}
        self.started = time.monotonic()
        self.live = Live(self._render(), console=console, refresh_per_second=4)

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def on_event(self, event: Any) -> None:
        if event.kind == "study":
            return
        row = self.rows.setdefault(event.number, {"params": event.params, "label": ""})
        row.update(state=event.state, value=event.value, tpot=event.tpot_p99_ms,
                   message=event.message, elapsed=event.elapsed_s)
        if event.label:
            row["label"] = event.label
        self.live.update(self._render())

    def _render(self) -> Table:
        objective = self.cfg.objectives[0]
        budget = self.cfg.spec.budget.trials
        done = sum(1 for r in self.rows.values() if r["state"] in ("complete", "pruned",
                                                                      "failed"))
        elapsed = time.monotonic() - self.started
        title = f"{self.cfg.name}: {done}" + (f"/{budget}" if budget else "") + \
            f" trials, {elapsed / 60:.0f} min"
        if budget:
            filled = int(20 * min(1.0, done / budget))
            title += "  [" + "#" * filled + "-" * (20 - filled) + "]"
            if 0 < done < budget:  # at the pace so far, trials in parallel included
                title += f"  ETA ~{elapsed / done * (budget - done) / 60:.0f} min"
        table = Table(title=title, expand=True)
        for col in ("trial", "changes vs defaults", "state", objective, "TPOT p99 ms",
                    "bottleneck", "s", "conclusion"):
            table.add_column(col, overflow="fold")
        for number in sorted(self.rows)[-25:]:
            r = self.rows[number]
            params = " ".join(f"{k}={v}" for k, v in r["params"].items()) or "(defaults)"
            table.add_row(str(number), params[:80], r["state"],
                          "" if r["value"] is None else f"{r['value']:.3g}",
                          "" if r["tpot"] is None else f"{r['tpot']:.1f}", r["label"],
                          f"{r['elapsed']:.0f}", (r["message"] or "")[:100])
        return table
