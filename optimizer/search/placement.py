"""Where and when an asked trial runs: the trials waiting for their GPUs in the order asked, which
of them starts once GPUs are free (a trial that needs more GPUs than are free does not hold back
one that fits; one overtaken `MAX_OVERTAKEN` times holds the next free GPUs), the compile-cache
order among them (`startup.launch_order`: warm keys first, one compile of a key at a time), the
cluster's GPUs (a config that needs more than it or one node has is refused), and what a launch
predicts of its compile cache (`startup.trial_env`). Counts GPUs only: the executor holds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from optuna.trial import FrozenTrial

from optimizer.config import StudyConfig
from optimizer.results.trial_record import is_baseline, record_of, retries_of
from optimizer.search.startup import CompileCaches, launch_order, trial_env
from optimizer.search.trials import Running, Waiting
from runners.base import EngineConfig, Failure, FailureReason
from runners.vllm.compile_cache import compile_key

# A trial waiting for GPUs that later, smaller trials have overtaken this many times holds the
# next free GPUs: nothing behind it starts until it has (no starving a 2-GPU trial by 1-GPU ones).
MAX_OVERTAKEN = 2


class Placement:
    """One study's trials waiting for GPUs, and its compile caches. Not thread-safe."""

    def __init__(self, cfg: StudyConfig, *, total_gpus: int,
                 max_gpus_per_node: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 compiled_elsewhere: Callable[[], Collection[str]] | None = None) -> None:
        self.cfg = cfg
        self.total_gpus = total_gpus  # lowered by the caller when a cluster node dies
        self.max_gpus_per_node = max_gpus_per_node or total_gpus  # a trial's GPUs share a node
        self.clock = clock
        self.waiting: list[Waiting] = []  # asked, in order, waiting for their GPUs
        # The compile caches this study filled and is filling (optimizer/search/startup.py).
        self.caches = CompileCaches()
        # The keys other processes compiled on this cache root (the compile ledger's reader,
        # runners/vllm/compile_ledger.py), asked before each launch; never under per_trial.
        self.compiled_elsewhere = compiled_elsewhere

    def learn(self, trials: Sequence[FrozenTrial]) -> None:
        """What the cache root holds as a start finds it: the compile ledger's keys, else (no
        ledger) the keys the study's finished trials compiled or loaded."""
        startup = self.cfg.spec.startup
        # Where a compile ledger is read, it alone says what the cache root holds: it lives in
        # that root, so a study resumed on another machine, or after the root was cleared, finds
        # its earlier trials' keys cold (and predicting them warm would send VLLM_FORCE_AOT_LOAD
        # into a start that must compile). Without a ledger, the records are all there is.
        learn_from_records = startup.compile_cache == "shared" and self.compiled_elsewhere is None
        for frozen in trials:
            record = record_of(frozen)
            if record is not None and learn_from_records:
                self.caches.learn(record.startup)
        self.hear_compiled_elsewhere()

    def hear_compiled_elsewhere(self) -> None:
        if self.compiled_elsewhere is not None and \
                self.cfg.spec.startup.compile_cache == "shared":
            self.caches.elsewhere = frozenset(self.compiled_elsewhere())

    def max_parallel(self) -> int:
        return self.cfg.spec.max_parallel_trials or self.total_gpus

    def _max_waiting(self) -> int:
        """How many asked trials may wait for GPUs at once: enough to find one that fits the
        GPUs left free (on 2 GPUs most configs of a space need both), few enough that the
        sampler is not asked far ahead of what it has learnt."""
        return 2 * self.max_parallel()

    def has_room(self) -> bool:
        """Whether another trial may be asked to wait: the queue is not full and no trial
        waiting holds the next free GPUs."""
        return len(self.waiting) < self._max_waiting() and \
            not any(w.overtaken >= MAX_OVERTAKEN for w in self.waiting)

    def is_waiting_for_a_compile(self) -> bool:
        """Whether a waiting trial's key is being compiled by a running one."""
        return any(self.caches.is_compiling(compile_key(w.config)) for w in self.waiting)

    def problem(self, config: EngineConfig) -> str | None:
        """Why the cluster can never run `config` (too many GPUs), or None."""
        if config.num_gpus > self.total_gpus:
            return f"needs {config.num_gpus} GPUs but the cluster has {self.total_gpus}"
        if config.num_gpus > self.max_gpus_per_node:
            return (f"needs {config.num_gpus} GPUs on one node but the largest node of the "
                    f"cluster has {self.max_gpus_per_node}")
        return None

    def take_ready(self, can_start: Callable[[int], bool],
                   drop: Callable[[Waiting, Failure], None]) -> Waiting | None:
        """The waiting trial to start now, out of the queue, or None. One whose GPUs the
        cluster no longer has (a node died while it waited) leaves the queue through `drop`."""
        if self.waiting:
            self.hear_compiled_elsewhere()
        order: Sequence[int] = range(len(self.waiting))
        if self.cfg.spec.startup.order_by_compile_key and \
                self.cfg.spec.startup.compile_cache == "shared":
            # Warm keys first; a key being compiled waits for that compile (startup.py).
            order = launch_order(self.waiting, lambda w: compile_key(w.config), self.caches,
                                 is_reserved=lambda w: w.overtaken >= MAX_OVERTAKEN)
        for index in order:
            waiting = self.waiting[index]
            if waiting.config.num_gpus > self.total_gpus:  # a node died while it waited
                del self.waiting[index]
                drop(waiting, Failure(
                    FailureReason.NODE_LOST,
                    f"it needs {waiting.config.num_gpus} GPUs but the cluster has "
                    f"{self.total_gpus} left after a node died; not re-queued."))
                return self.take_ready(can_start, drop)
            if can_start(waiting.config.num_gpus):
                del self.waiting[index]
                for earlier in self.waiting[:index]:
                    earlier.overtaken += 1
                return waiting
            if waiting.overtaken >= MAX_OVERTAKEN:
                return None  # it holds the next free GPUs
        return None

    def launch(self, waiting: Waiting) -> Running:
        """`waiting` as it runs: its estimated compile key and what its cache is predicted to
        be (the key then counts as compiling), the warm-cache check in its environment."""
        trial, params, config = waiting.trial, waiting.params, waiting.config
        key = compile_key(config)
        startup = self.cfg.spec.startup
        prediction = self.caches.predict(key) if startup.compile_cache == "shared" else \
            ("none" if key is None else "cold")
        if startup.compile_cache == "shared":
            self.caches.launched(trial.number, key, prediction)
        return Running(trial, params, trial_env(config, startup, prediction),
                       is_baseline(trial), retries_of(trial),
                       started=self.clock(), compile_key=key, prediction=prediction)

    def started(self, running: Running) -> None:
        """`running` measured its first level: whatever it compiled is on disk now."""
        self.caches.started(running.trial.number, running.compile_key)

    def ended(self, running: Running, observed: str | None) -> None:
        """`running` ended; `observed` is the cache its start-up found (None: not known)."""
        self.caches.ended(running.trial.number, running.compile_key, observed)

    def release(self) -> list[Waiting]:
        """Empty the queue (the daemon stops); returns what waited."""
        waiting, self.waiting = self.waiting, []
        return waiting
