"""Pruners on a real in-memory Optuna study: `MarginPruner`'s margin, and `BottleneckPruner`'s
verdict rules on top of a base pruner."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, TrialState

from optimizer.results.trial_record import ATTR_VERDICT
from optimizer.search.pruners import BottleneckPruner, MarginPruner

TP = {"tensor_parallel_size": IntDistribution(1, 8)}


def _study(pruner: optuna.pruners.BasePruner, direction: str = "maximize") -> optuna.Study:
    return optuna.create_study(direction=direction, pruner=pruner,
                               sampler=optuna.samplers.RandomSampler(seed=0))


def _add(study: optuna.Study, tp: int, values: dict[int, float],
         state: TrialState = TrialState.COMPLETE, **attrs: Any) -> None:
    study.add_trial(optuna.trial.create_trial(
        params={"tensor_parallel_size": tp}, distributions=TP, state=state,
        value=max(values.values()) if state == TrialState.COMPLETE else None,
        intermediate_values=values, user_attrs=attrs))


def _running(study: optuna.Study, tp: int, value: float, label: str | None,
             step: int = 0) -> tuple[optuna.Trial, FrozenTrial]:
    """A trial in flight that reported `value` at `step` and stored a verdict first, as the
    daemon does before `should_prune`."""
    trial = study.ask({"tensor_parallel_size": IntDistribution(tp, tp)})
    if label is not None:
        trial.set_user_attr(ATTR_VERDICT, {"label": label, "tensor_parallel_size": tp,
                                           "objective_value": value})
    trial.report(value, step)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    return trial, frozen


# --- MarginPruner -------------------------------------------------------------------------------

def test_margin_pruner_prunes_only_beyond_the_margin() -> None:
    study = _study(MarginPruner(n_startup_trials=3, min_relative_gap=0.1))
    for v in (10.0, 10.0, 10.0):
        _add(study, 1, {0: v})
    within, _ = _running(study, 1, 9.5, None)
    assert not within.should_prune(), "5% under the median is noise"
    study.tell(within, state=TrialState.FAIL)
    beyond, _ = _running(study, 1, 8.0, None)
    assert beyond.should_prune()


# --- BottleneckPruner ---------------------------------------------------------------------------

def test_tp2_communication_bound_slower_than_best_tp1_is_pruned() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner())
    study = _study(pruner)
    _add(study, 1, {0: 4.0})
    _add(study, 1, {0: 5.0})
    _add(study, 4, {0: 9.0})  # a faster TP=4 trial is not the TP=1 reference
    trial, frozen = _running(study, 2, 4.5, "communication-bound")
    assert trial.should_prune(), "TP=2 serves less than TP=1 trial 1 does on one GPU"
    reason = pruner.explain(study, frozen)
    assert reason is not None
    assert "communication-bound at TP=2" in reason and "TP=1 trial 1 (5)" in reason


def test_tp2_communication_bound_faster_than_tp1_is_kept() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner())
    study = _study(pruner)
    _add(study, 1, {0: 5.0})
    trial, frozen = _running(study, 2, 5.5, "communication-bound")
    assert not trial.should_prune() and pruner.explain(study, frozen) is None


def test_tp1_is_never_pruned_by_the_communication_rule() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner())
    study = _study(pruner)
    _add(study, 1, {0: 5.0})
    trial, frozen = _running(study, 1, 1.0, "communication-bound")
    assert not trial.should_prune(), "TP=1 has nothing to split; the rule compares to TP=1"
    assert pruner.explain(study, frozen) is None


def test_communication_rule_compares_at_the_same_step_and_direction() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner())
    study = _study(pruner, direction="minimize")  # e.g. TPOT p99
    _add(study, 1, {0: 9.0, 1: 20.0})
    slower, _ = _running(study, 2, 21.0, "communication-bound", step=1)
    assert slower.should_prune(), "21 ms is worse than TP=1's 20 ms at step 1"
    study.tell(slower, state=TrialState.PRUNED)
    faster, _ = _running(study, 2, 15.0, "communication-bound", step=1)
    assert not faster.should_prune(), "compared with TP=1 at step 1 (20), not step 0 (9)"


def test_communication_rule_needs_a_tp1_reference() -> None:
    study = _study(BottleneckPruner(optuna.pruners.NopPruner()))
    _add(study, 4, {0: 9.0})
    trial, _ = _running(study, 2, 1.0, "communication-bound")
    assert not trial.should_prune()


def test_launch_bound_is_pruned_beyond_the_margin_only() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner(), launch_margin=0.25)
    study = _study(pruner)
    _add(study, 1, {0: 10.0})
    _add(study, 1, {0: 6.0}, state=TrialState.PRUNED)
    close, frozen_close = _running(study, 1, 8.0, "launch-bound")
    assert not close.should_prune(), "20% worse is inside the 25% margin"
    assert pruner.explain(study, frozen_close) is None
    study.tell(close, state=TrialState.FAIL)
    far, frozen_far = _running(study, 1, 5.0, "launch-bound")
    assert far.should_prune()
    reason = pruner.explain(study, frozen_far)
    assert reason is not None and "launch-bound" in reason and "-50%" in reason


@pytest.mark.parametrize("label", ["memory-bound", "compute-bound", "at-physical-limit", None])
def test_other_verdicts_leave_the_decision_to_the_base_pruner(label: str | None) -> None:
    study = _study(BottleneckPruner(optuna.pruners.NopPruner()))
    _add(study, 1, {0: 10.0})
    trial, _ = _running(study, 2, 1.0, label)
    assert not trial.should_prune()


def test_the_base_pruner_still_prunes_and_is_named() -> None:
    pruner = BottleneckPruner()  # MarginPruner by default
    study = _study(pruner)
    for _ in range(4):
        _add(study, 1, {0: 10.0})
    trial, frozen = _running(study, 1, 5.0, "memory-bound")
    assert trial.should_prune()
    reason = pruner.explain(study, frozen)
    assert reason is not None and reason.startswith("MarginPruner:")


def test_a_trial_without_a_report_is_not_pruned() -> None:
    pruner = BottleneckPruner(optuna.pruners.NopPruner())
    study = _study(pruner)
    trial = study.ask()
    trial.set_user_attr(ATTR_VERDICT, {"label": "launch-bound"})
    assert not trial.should_prune()


def test_negative_launch_margin_is_refused() -> None:
    with pytest.raises(ValueError, match="launch_margin"):
        BottleneckPruner(launch_margin=-0.1)
