"""When to stop a trial (Ray Tune's `TrialScheduler`): each measured load level of a running
trial is reported to Optuna, classified (`bottleneck.classify`), and handed to the study's pruner
(`optimizer.search.pruners`), which decides. Also the bottleneck verdict of a finished trial,
which its record keeps. Reads the study; launches nothing, tells Optuna no outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck
from optimizer.config import StudyConfig
from optimizer.results.objectives import described_step, objective_values
from optimizer.results.trial_record import ATTR_VERDICT, confirm_label, record_of
from optimizer.search.trials import Running
from runners.base import EngineConfig, RunResult, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.workload import Workload

logger = logging.getLogger(__name__)


class PruningScheduler:
    """Judges one study's running trials level by level. Not thread-safe."""

    def __init__(self, cfg: StudyConfig, study: optuna.Study, *, workload: Workload,
                 hardware: HardwareProfile | None = None,
                 model: ModelInfo | None = None) -> None:
        self.cfg = cfg
        self.study = study
        self.workload = workload
        self.hardware = hardware  # for the roofline of the bottleneck classifier
        self.model = model

    def should_prune(self, item: Running, step: StepMetrics) -> bool:
        """Whether to stop `item` after `step`, the last of `item.steps`; sets its
        `prune_reason` when it does."""
        if self.cfg.is_multi_objective or item.is_baseline or \
                confirm_label(item.trial) is not None:
            return False  # Optuna prunes single-objective only; these always complete
        values = objective_values(self.cfg.objectives, item.steps, item.config.num_gpus)
        if values is None:
            return False
        item.trial.report(values[0], step.step)
        if step.step >= len(self.workload.levels) - 1 or self.workload.capacity is not None:
            # The last level: stopping now saves nothing. A capacity search's probes are at
            # loads of its own, not comparable between trials.
            return False
        m = step.metrics
        if m.request_goodput is not None and m.request_throughput > 0 and \
                m.request_goodput >= 0.95 * m.request_throughput:
            # Every request met the SLO: this load is below the trial's capacity, where configs
            # differ by latency, not by what they can serve (two replicas look like one at a
            # light load). Judge it where it saturates.
            return False
        # The pruner reads the verdict the trial stores (BottleneckPruner): classify first.
        verdict = self.verdict(item.steps, item.config)
        item.trial.set_user_attr(ATTR_VERDICT, verdict.as_user_attr(
            tensor_parallel_size=item.config.tensor_parallel_size,
            objective_value=values[0], step=step.step))
        if not item.trial.should_prune():
            return False
        frozen = next(t for t in self.study.get_trials(deepcopy=False,
                                                       states=(TrialState.RUNNING,))
                      if t.number == item.trial.number)
        explain = getattr(self.study.pruner, "explain", None)
        item.prune_reason = (explain(self.study, frozen) if explain else None) or \
            f"{self.cfg.objectives[0]} {values[0]:.3g} below the median of earlier trials"
        logger.info("trial %d pruned at step %d: %s params=%s", item.trial.number, step.step,
                    item.prune_reason, item.params)
        return True

    def verdict(self, steps: Sequence[StepMetrics], config: EngineConfig,
                result: RunResult | None = None) -> bottleneck.Verdict:
        """Classify a trial from what it has measured so far (or its whole result)."""
        # The TP=1 reference at the level the verdict describes (its operating point).
        described = described_step(self.cfg.objectives[0],
                                   result.steps if result is not None else steps)
        tp1 = self._tp1_tpot_ms(described.step) if described is not None and \
            config.tensor_parallel_size > 1 else None
        evidence = bottleneck.evidence_from(result if result is not None else steps, config,
                                            self.hardware, self.model, tp1_tpot_ms=tp1,
                                            objective=self.cfg.objectives[0])
        return bottleneck.classify(evidence)

    def _tp1_tpot_ms(self, step_index: int) -> float | None:
        """The best median TPOT at this load level among finished TP=1 trials: what a TP>1
        trial must beat for its split to be worth the communication."""
        best: float | None = None
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            record = record_of(t)
            if record is None or int(record.flags.get("tensor_parallel_size") or 1) != 1:
                continue
            for s in record.steps:
                tpot = (s.get("metrics") or {}).get("median_tpot_ms")
                if s.get("step") == step_index and tpot and (best is None or tpot < best):
                    best = float(tpot)
        return best
