"""The controller over its parts, driven as `bench/replay.py` drives it (no daemon, no executor): a
config waiting for GPUs is held for the searcher, a lost node reaches placement, and a finished
trial is recorded once. The daemon's own use: tests/optimizer/test_search_policy.py."""

from __future__ import annotations

from collections.abc import Callable

from optimizer.results.trial_record import ATTR_BASELINE, ATTR_DUPLICATE_OF, record_of
from optimizer.search.controller import SearchController
from runners.base import RunResult
from tests.optimizer.search.conftest import Setup, step


def _controller(make_setup: Callable[..., Setup], total_gpus: int = 1,
                **choices: list[object]) -> SearchController:
    cfg, space, study = make_setup(choices or None)
    controller = SearchController(cfg, space, study, workload=cfg.workload,
                                  total_gpus=total_gpus, clock=lambda: 0.0)
    controller.prepare()
    return controller


def test_the_defaults_run_first_and_a_finished_trial_is_recorded_once(
        make_setup: Callable[..., Setup]) -> None:
    controller = _controller(make_setup, max_num_seqs=[256, 64])
    defaults = controller.next_launch(lambda n: not controller.running)
    assert defaults is not None and defaults.trial.user_attrs.get(ATTR_BASELINE)
    levels = controller.workload.levels
    for index, level in enumerate(levels):
        assert not controller.on_step(defaults, step(index, level, 5.0, 5.0))
    controller.on_result(defaults, RunResult(status="complete", steps=tuple(defaults.steps)))
    record = record_of(controller.study.get_trials(deepcopy=False)[defaults.trial.number])
    assert record is not None and record.state == "complete" and record.is_baseline
    assert controller.finished_here == 1 and not controller.running


def test_a_config_waiting_for_gpus_is_never_asked_again_meanwhile(
        make_setup: Callable[..., Setup]) -> None:
    controller = _controller(make_setup, total_gpus=2, max_num_seqs=[256])
    # GPUs free to ask (twice), never free for the waiting trial: it keeps waiting.
    answers = iter([True, False, True, False])
    assert controller.next_launch(lambda n: next(answers, False)) is None
    (waiting,) = controller.waiting
    repeats = [t for t in controller.study.get_trials(deepcopy=False)
               if ATTR_DUPLICATE_OF in t.user_attrs]
    assert [t.user_attrs[ATTR_DUPLICATE_OF] for t in repeats] == [waiting.trial.number], \
        "a config is launched at most once, whatever stage its first trial is at"


def test_gpus_lost_to_a_dead_node_reach_placement(make_setup: Callable[..., Setup]) -> None:
    controller = _controller(make_setup, total_gpus=2)
    controller.total_gpus = 1  # what the daemon does when Ray counts a node out
    assert controller.placement.total_gpus == 1 and controller.placement.max_parallel() == 1


def test_a_level_whose_load_was_not_applied_meets_no_slo_and_the_conclusion_says_it_and_a_thin_p99(
        make_setup: Callable[..., Setup]) -> None:
    """The defaults' every level within the SLO by its figures, but its client held a third of
    the concurrency (runners/applied_load.py): the trial met the SLO at no load it was shown,
    and its conclusion names the level and why; its p99s, over 16 requests each, are thin."""
    from dataclasses import replace

    from optimizer.results.recommendation import met_slo
    from optimizer.results.tail_samples import THIN_P99_REQUESTS

    controller = _controller(make_setup, max_num_seqs=[256, 64])
    defaults = controller.next_launch(lambda n: not controller.running)
    assert defaults is not None
    reason = "load not applied: 3 of 8 requests in flight on average over the 2 s window"
    for index, level in enumerate(controller.workload.levels):
        unapplied = replace(step(index, level, 5.0, 5.0),
                            server_metrics={"steady.is_load_unapplied": 1.0},
                            miss_reason=reason)
        assert not controller.on_step(defaults, unapplied)
    controller.on_result(defaults, RunResult(status="complete", steps=tuple(defaults.steps)))
    trial = controller.study.get_trials(deepcopy=False)[defaults.trial.number]
    record = record_of(trial)
    assert record is not None
    assert not met_slo(trial), "no level met the SLO at its load"
    assert "Load not applied at" in record.conclusion and reason in record.conclusion
    assert THIN_P99_REQUESTS > 16 and "p99s are over 16 requests: thin" in record.conclusion
