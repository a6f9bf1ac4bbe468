"""Whether a failed trial runs again: a stop re-queues it for free, a failure lost to the
infrastructure (or a one-off failure of the defaults) while retries are left re-queues it and
spends one, a confirmation run never (its round is measured again). The failure's message
then says which it was, as the trial's record keeps it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import optuna

from optimizer.search.trials import Running
from optimizer.storage.study import requeue, requeueable
from runners.base import Failure, FailureReason, RunResult

logger = logging.getLogger(__name__)

# A lost baseline is worth another try when it failed for one of these: they can be one-off
# (a crash, a hang, a slow start on a busy host), and every gain is measured against the
# defaults. Config failures repeat; other trials are not retried for these, as a crash there
# is as likely the config's own doing and a retry costs a whole trial.
ONE_OFF_FAILURES = frozenset({
    FailureReason.CRASH_MID_RUN, FailureReason.HANG, FailureReason.STARTUP_TIMEOUT,
    FailureReason.STARTUP_CRASH})


class RetryPolicy:
    """Decides, and queues, the re-runs of one study's failed trials (`retries` of them at
    most per config, the study file's `retries`)."""

    def __init__(self, study: optuna.Study, retries: int) -> None:
        self.study = study
        self.retries = retries

    def settle(self, item: Running, result: RunResult) -> RunResult:
        """Re-queue `item` if its failure earns a re-run, before it is told (as `Recovery`
        does); returns `result` with the failure's message saying what became of it."""
        failure = result.failure
        again = failure is not None and self.is_requeued(item, failure)
        if failure is not None and (failure.is_retryable or again):
            # What became of the trial is decided here: its record says so, not its failure's
            # source, which cannot know the retries left.
            result = replace(result, failure=replace(
                failure, message=f"{failure.message.rstrip().rstrip('.')}; "
                                 f"{self.fate(item, again)}."))
        if failure is not None and again:
            # A stop (`stop --now`, a second Ctrl-C) is nobody's fault: it spends no retry.
            requeue(self.study, item.trial, item.params,
                    item.retries + (failure.reason != FailureReason.INTERRUPTED))
            logger.info("trial %d re-queued after %s%s", item.trial.number, failure.reason,
                        " (the defaults: every gain is measured against them)"
                        if item.is_baseline and not failure.is_retryable else "")
        return result

    def is_requeued(self, item: Running, failure: Failure) -> bool:
        """Whether a failed trial goes back in the queue: always after a stop; after a failure
        lost to infrastructure (or a one-off of the defaults) while it has retries left; never
        a confirmation run (its round is measured again on the next start)."""
        is_retried = item.retries < self.retries and (
            failure.is_retryable or (item.is_baseline and failure.reason in ONE_OFF_FAILURES))
        return (failure.reason == FailureReason.INTERRUPTED or is_retried) and \
            requeueable(item.trial)

    def fate(self, item: Running, again: bool) -> str:
        if again:
            return "re-queued"
        if not requeueable(item.trial):
            return "its confirmation round is measured again on the next start"
        return f"not re-queued (retried {item.retries} times already)"
