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
