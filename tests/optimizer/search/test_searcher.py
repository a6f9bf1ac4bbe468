"""The searcher alone (what to try next): the queue it prepares, the repeats and refusals it
tells Optuna before anything launches. Real in-memory Optuna studies; no GPUs, Ray or runs."""

from __future__ import annotations

from collections.abc import Callable

from optuna.trial import TrialState

from optimizer.results.trial_record import (
    ATTR_BASELINE,
    ATTR_DUPLICATE_OF,
    ATTR_SEED_SOURCE,
    ATTR_SEEDED,
    TrialRecord,
    record_of,
)
from optimizer.search.searcher import Searcher
from optimizer.search.tell import MAX_CONSECUTIVE_DUPLICATES
from optimizer.search.trials import Told, Waiting
from runners.base import EngineConfig
from tests.optimizer.search.conftest import Setup


class Heard:
    """A `TrialLog` that keeps what it is told."""

    def __init__(self) -> None:
        self.heard: list[Told] = []

    def open_run(self, trial: object, params: object) -> str | None:
        return "run-1"

    def told(self, told: Told) -> None:
        self.heard.append(told)


def _searcher(make_setup: Callable[..., Setup], **choices: list[object]) -> Searcher:
    cfg, space, study = make_setup(choices or None)
    return Searcher(cfg, space, study, workload=cfg.workload, log=Heard())


def _no_problem(config: EngineConfig) -> str | None:
    return None


def test_prepare_queues_the_defaults_first_then_warm_seeds_templates_and_seeds(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256, 64, 128, 512])
    searcher.prepare([], seed_trials=[{"max_num_seqs": 512}],
                     warm_seeds=[({"max_num_seqs": 64}, "warm_start:earlier")],
                     template_trials=[({"max_num_seqs": 128}, {ATTR_SEED_SOURCE: "template:x"})])
    queued = searcher.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"]["max_num_seqs"] for t in queued] == \
        [256, 64, 128, 512], "defaults, warm seeds, templates, seeds"
    assert queued[0].user_attrs.get(ATTR_BASELINE), "the first is the defaults trial"
    assert all(t.user_attrs.get(ATTR_SEEDED) for t in queued[1:]), "the rest are seeds"
    assert queued[1].user_attrs[ATTR_SEED_SOURCE] == "warm_start:earlier"


def test_prepare_on_a_resume_queues_neither_the_defaults_nor_a_seed_again(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256, 64])
    searcher.prepare([], seed_trials=[{"max_num_seqs": 64}])
    searcher.prepare(searcher.study.get_trials(deepcopy=False),
                     seed_trials=[{"max_num_seqs": 64}])
    assert len(searcher.study.get_trials(deepcopy=False)) == 2, \
        "a resume finds the defaults and the seed queued already"


def test_a_config_an_unfinished_trial_holds_is_told_as_a_repeat_and_never_returned(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256])  # one config: the defaults
    searcher.prepare([])
    first = searcher.ask([], _no_problem)
    assert isinstance(first, Waiting), "the queued defaults come first"
    assert searcher.ask([first], _no_problem) is None, "the same config again: a repeat"
    repeat = max(searcher.study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert repeat.user_attrs[ATTR_DUPLICATE_OF] == first.trial.number
    assert repeat.state == TrialState.FAIL, "its original has no outcome yet: the repeat fails"
    assert searcher.duplicates_in_a_row == 1
    assert isinstance(searcher.log, Heard)
    assert [t.kind for t in searcher.log.heard] == ["duplicate"], "no run of its own"


def test_a_config_the_cluster_cannot_place_is_told_infeasible_with_the_reason(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256])
    searcher.prepare([])
    assert searcher.ask([], lambda config: "needs 8 GPUs but the cluster has 2") is None
    (trial,) = searcher.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.failure_reason == "infeasible"
    assert "needs 8 GPUs but the cluster has 2" in (record.failure_message or "")
    assert trial.state == TrialState.COMPLETE and trial.constraints["runs"] > 0, \
        "a config failure teaches the sampler: the worst value, a violated constraint"
    assert isinstance(searcher.log, Heard) and searcher.log.heard[0].run_id == "run-1", \
        "a refused config has a run of its own"


def test_a_long_run_of_repeats_ends_the_search_as_exhausted(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256])
    searcher.prepare([])
    held = searcher.ask([], _no_problem)
    assert held is not None
    for _ in range(MAX_CONSECUTIVE_DUPLICATES):
        assert not searcher.is_exhausted
        assert searcher.ask([held], _no_problem) is None
    assert searcher.is_exhausted, "the sampler has nothing new to offer"


def test_a_measured_configs_repeat_reuses_its_outcome(
        make_setup: Callable[..., Setup]) -> None:
    searcher = _searcher(make_setup, max_num_seqs=[256])
    searcher.prepare([])
    first = searcher.ask([], _no_problem)
    assert first is not None
    searcher.study.tell(first.trial, [5.0])
    searcher.remember(first.trial.number, TrialRecord(state="complete", params=first.params,
                                                      conclusion="", values=(5.0,)))
    assert searcher.ask([], _no_problem) is None
    repeat = max(searcher.study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert repeat.state == TrialState.COMPLETE and repeat.values == [5.0], \
        "the sampler is told the original's value again"

