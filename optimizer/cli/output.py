"""Where the command line's output goes: `console` (stderr: messages, progress, logs) and `out`
(stdout: what a command reports), and the logging handlers; the only place that installs them."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

console = Console(stderr=True)
out = Console()


def add_log_file(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def setup_logging(verbose: bool) -> None:
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    else:  # a log file or CI: one plain line per event, never wrapped
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               "%H:%M:%S"))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    # MLflow logs each store error it raises at ERROR with its traceback and SQL; nightshift
    # says each one in a line of its own, so MLflow's go to the daemon's log file only.
    handler.addFilter(lambda record: not record.name.startswith("mlflow"))
    root.addHandler(handler)
    for noisy in ("mlflow", "alembic", "optuna", "ray", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Its retries of an unreachable tracking server are warnings of their own; the error that
    # follows says it once.
    logging.getLogger("urllib3").setLevel(logging.ERROR)
