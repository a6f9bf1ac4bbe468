"""A trace's or conversations' capacity search: a trace replays its own arrival pattern and a
conversation its own turns, so each probe is a level of its own, bounded by
`probe_duration_s` (not a steady-state window), judged by `meets_slo`.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from runners.base import OnStep, RunStatus, StepMetrics
from runners.capacity.search import Probe
from runners.capacity.slo import meets_slo
from runners.capacity.staircase import unapplied_of
from runners.levels import mean_prompt_tokens, mean_tokens, measure_repeated
from runners.session import EngineSession

logger = logging.getLogger(__name__)


def run_probes(session: EngineSession, steps: list[StepMetrics],
               on_step: OnStep | None) -> RunStatus:
    """Each probe `CapacitySearch.next_load` asks for, measured as a level, appended to
    `steps` and shown to `on_step` (True: stop, "stopped")."""
    workload = session.workload
    search = workload.capacity
    assert search is not None
    history: list[Probe] = []
    while (load := search.next_load(history)) is not None:
        index = len(history)
        step = measure_repeated(session, index, search.level(load),
                                max_duration_s=search.probe_duration_s)
        # A probe whose load was not applied (`runners/applied_load.py`: its `miss_reason`)
        # has not met the SLO at its load, whatever its percentiles; it ends no bracket
        # (`unapplied_of`).
        ok = step.miss_reason is None and meets_slo(
            step.metrics, workload.slo, workload.max_failed_fraction,
            step.is_saturated)
        step = replace(step, meets_slo=ok)
        served = search.served_of(
            step.metrics, step.server_metrics,
            mean_input_tokens=None if workload.prompts_file or workload.dataset
            or workload.multi_turn else mean_prompt_tokens(workload),
            mean_output_tokens=None if workload.trace else
            mean_tokens(workload.output_len))
        history.append((load, ok, served))
        steps.append(step)
        logger.info("capacity probe %d at %s: SLO %s (served %s); bracket %s", index,
                    step.level.label, "met" if ok else "missed",
                    "?" if served is None else f"{served:.3g}",
                    search.bracket(history, unapplied_of(search, steps)).describe())
        if on_step is not None and on_step(step):
            return "stopped"
    return "complete"
