"""The retry policy alone (what runs again): which failures re-queue a trial, what a re-queue
spends, and what the failure's message then says. A real in-memory Optuna study holds the queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.results.trial_record import ATTR_BASELINE, ATTR_CONFIRM, ATTR_RETRIES, ATTR_RETRY_OF
from optimizer.search.retries import RetryPolicy
from optimizer.search.trials import Running
from optimizer.storage.study import engine_config
from runners.base import Failure, FailureReason, RunResult
from tests.optimizer.search.conftest import Setup


def _settle(make_setup: Callable[..., Setup], reason: FailureReason, *, retries: int = 0,
            attrs: dict[str, Any] | None = None) -> tuple[RunResult, optuna.Study]:
    cfg, _, study = make_setup()
    trial = study.ask()
    for key, value in (attrs or {}).items():
        trial.set_user_attr(key, value)
    item = Running(trial, {"max_num_seqs": 64}, engine_config(cfg, {}),
                   is_baseline=bool((attrs or {}).get(ATTR_BASELINE)), retries=retries)
    policy = RetryPolicy(study, retries=1)
    result = policy.settle(item, RunResult(status="failed", failure=Failure(reason, "it broke.")))
    return result, study


def _queued(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.WAITING,))


def test_a_failure_lost_to_infrastructure_is_re_queued_while_retries_last(
        make_setup: Callable[..., Setup]) -> None:
    result, study = _settle(make_setup, FailureReason.WORKER_LOST)
    assert result.failure is not None and result.failure.message == "it broke; re-queued."
    (queued,) = _queued(study)
    assert queued.user_attrs[ATTR_RETRY_OF] == 0 and queued.user_attrs[ATTR_RETRIES] == 1, \
        "the re-run spends one retry"


def test_a_failure_with_no_retry_left_is_not_re_queued_and_says_so(
        make_setup: Callable[..., Setup]) -> None:
    result, study = _settle(make_setup, FailureReason.WORKER_LOST, retries=1)
    assert result.failure is not None and \
        result.failure.message == "it broke; not re-queued (retried 1 times already)."
    assert not _queued(study)


def test_a_stop_re_queues_without_spending_a_retry(make_setup: Callable[..., Setup]) -> None:
    _, study = _settle(make_setup, FailureReason.INTERRUPTED, retries=1)
    (queued,) = _queued(study)
    assert queued.user_attrs[ATTR_RETRIES] == 1, "a stop is nobody's fault"


def test_a_confirmation_run_is_never_re_queued(make_setup: Callable[..., Setup]) -> None:
    result, study = _settle(make_setup, FailureReason.INTERRUPTED,
                            attrs={ATTR_CONFIRM: "best"})
    assert not _queued(study)
    assert result.failure is not None and \
        result.failure.message.endswith(
            "its confirmation round is measured again on the next start.")


@pytest.mark.parametrize(("is_baseline", "is_requeued"), [(True, True), (False, False)])
def test_a_one_off_crash_is_retried_for_the_defaults_alone(
        make_setup: Callable[..., Setup], is_baseline: bool, is_requeued: bool) -> None:
    result, study = _settle(make_setup, FailureReason.CRASH_MID_RUN,
                            attrs={ATTR_BASELINE: True} if is_baseline else None)
    assert bool(_queued(study)) == is_requeued, \
        "every gain is measured against the defaults; another trial's crash may be its own"
    assert result.failure is not None
    assert result.failure.message == ("it broke; re-queued." if is_requeued else "it broke."), \
        "a config's own failure keeps its message"
