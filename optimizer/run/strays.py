"""Engines left without a daemon or a worker: the ones a dead daemon left, reaped at the start
(here and on every node of the executor), and the ones whose workers died, reaped at the end."""

from __future__ import annotations

import logging
from pathlib import Path

from optimizer.run.executor import Executor
from runners.process import reap_strays

logger = logging.getLogger(__name__)


def reap_left_by_dead_daemon(registry_dir: Path, executor: Executor) -> None:
    """End the engines a dead daemon left behind, here and on the executor's other nodes."""
    killed = reap_strays(registry_dir)
    if killed:
        logger.warning("reaped %d engine processes left by a dead daemon: %s",
                       len(killed), killed)
    for node_id, pids in executor.reap_elsewhere(registry_dir).items():
        logger.warning("reaped %d engine processes left by a dead daemon on node %s: "
                       "%s", len(pids), node_id[:12], pids)


def reap_orphans(registry_dir: Path) -> None:
    """End the engines still recorded once every trial was collected."""
    # Every trial was collected, so an engine still recorded has no worker left (Ray went
    # down under it, as a killed driver takes its local cluster): end it now rather than at
    # the next start.
    orphans = reap_strays(registry_dir)
    if orphans:
        logger.warning("reaped %d engine processes whose workers were gone: %s",
                       len(orphans), orphans)
