"""Placement alone (where and when a trial runs): which waiting trial starts on the GPUs free,
the overtaking rule, a node lost under a waiting trial, the compile-key order and what a launch
predicts of its cache. GPUs are counted by a `can_start` of the test's own; no executor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna

from optimizer.search.placement import MAX_OVERTAKEN, Placement
from optimizer.search.trials import Waiting
from optimizer.storage.study import engine_config
from runners.base import Failure, FailureReason
from runners.vllm.compile_cache import FORCE_AOT_LOAD
from tests.optimizer.search.conftest import Setup


def _placement(make_setup: Callable[..., Setup], *, total_gpus: int = 2,
               **startup: Any) -> tuple[Placement, optuna.Study]:
    cfg, _, study = make_setup(startup=startup) if startup else make_setup()
    return Placement(cfg, total_gpus=total_gpus, clock=lambda: 0.0), study


def _waiting(placement: Placement, study: optuna.Study, num_gpus: int = 1,
             **flags: Any) -> Waiting:
    config = engine_config(placement.cfg, {"tensor_parallel_size": num_gpus, **flags})
    return Waiting(study.ask(), {"tensor_parallel_size": num_gpus, **flags}, config)


def _never_dropped(waiting: Waiting, failure: Failure) -> None:
    raise AssertionError(f"trial {waiting.trial.number} dropped: {failure.message}")


def test_a_trial_needing_more_gpus_than_are_free_does_not_hold_back_one_that_fits(
        make_setup: Callable[..., Setup]) -> None:
    placement, study = _placement(make_setup)
    big, small = _waiting(placement, study, 2), _waiting(placement, study, 1)
    placement.waiting += [big, small]
    assert placement.take_ready(lambda n: n <= 1, _never_dropped) is small
    assert placement.waiting == [big] and big.overtaken == 1, "the 2-GPU trial was overtaken"


def test_a_trial_overtaken_enough_holds_the_next_free_gpus(
        make_setup: Callable[..., Setup]) -> None:
    placement, study = _placement(make_setup)
    big, small = _waiting(placement, study, 2), _waiting(placement, study, 1)
    big.overtaken = MAX_OVERTAKEN
    placement.waiting += [big, small]
    assert placement.take_ready(lambda n: n <= 1, _never_dropped) is None, \
        "nothing behind it starts until it has"
    assert not placement.has_room(), "and nothing more is asked"
    assert placement.take_ready(lambda n: True, _never_dropped) is big


def test_a_waiting_trial_whose_gpus_a_dead_node_took_leaves_the_queue_as_node_lost(
        make_setup: Callable[..., Setup]) -> None:
    placement, study = _placement(make_setup)
    big, small = _waiting(placement, study, 2), _waiting(placement, study, 1)
    placement.waiting += [big, small]
    placement.total_gpus = 1  # a node died
    dropped: list[tuple[Waiting, Failure]] = []
    assert placement.take_ready(lambda n: n <= 1,
                                lambda w, f: dropped.append((w, f))) is small
    assert [(w, f.reason) for w, f in dropped] == [(big, FailureReason.NODE_LOST)]


def test_a_config_the_cluster_or_its_largest_node_cannot_hold_is_a_problem(
        make_setup: Callable[..., Setup]) -> None:
    cfg, _, _ = make_setup()
    placement = Placement(cfg, total_gpus=4, max_gpus_per_node=2)
    assert placement.problem(engine_config(cfg, {"tensor_parallel_size": 2})) is None
    assert "largest node" in (placement.problem(
        engine_config(cfg, {"tensor_parallel_size": 4})) or "")
    assert "cluster has 4" in (placement.problem(
        engine_config(cfg, {"tensor_parallel_size": 8})) or "")


def test_a_key_being_compiled_waits_and_starts_warm_once_its_compile_is_on_disk(
        make_setup: Callable[..., Setup]) -> None:
    placement, study = _placement(make_setup, order_by_compile_key=True,
                                  compile_cache="shared", verify_warm=True)
    first, same_key = _waiting(placement, study), _waiting(placement, study)
    placement.waiting += [first, same_key]
    ready = placement.take_ready(lambda n: True, _never_dropped)
    assert ready is first
    running = placement.launch(ready)
    assert running.prediction == "cold" and placement.is_waiting_for_a_compile()
    assert placement.take_ready(lambda n: True, _never_dropped) is None, \
        "one compile of a key at a time"
    placement.started(running)  # its engine served a level: the compile is on disk
    ready = placement.take_ready(lambda n: True, _never_dropped)
    assert ready is same_key
    warm = placement.launch(ready)
    assert warm.prediction == "warm" and warm.config.env.get(FORCE_AOT_LOAD) == "1", \
        "a launch predicted warm carries the warm-cache check"
