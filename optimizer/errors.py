"""The exception tree of nightshift: what stops a command, as one line that says what to fix.

    NightshiftError
     ├── ConfigError          bad study/space file or flag (exit code 2)
     ├── WorkerLost           the Ray worker (or its node) died
     ├── StudyLockedError     another daemon runs this study
     ├── StorageError         the Optuna storage failed mid-study (the daemon stops; resume)
     └── TrackingError        the tracking store refused a write (MLflow)

Foreign exceptions (YAML, pydantic, OSError, SQLAlchemy, MLflow, Ray) are translated where they
enter into one of these, with a one-line message (`describe` renders a foreign cause for it);
the CLI prints that line alone. Most drop the cause (`raise ... from None`): a bad input's line
names the field and the fix, and the parser's traceback would add nothing. Where the cause may
matter to whoever debugs (a storage, MLflow or Ray call that failed) it is chained
(`from exc`). Trial-level failures never raise through the daemon: runners return them as data
(`RunResult.failure`).
"""

from __future__ import annotations


class NightshiftError(Exception):
    """Base of every error nightshift raises on purpose."""

    exit_code = 1


class ConfigError(NightshiftError, ValueError):
    """A study file, search space or command-line value is invalid. The message is one line:
    what was expected, what was got, what to do."""

    exit_code = 2


class WorkerLost(NightshiftError):
    """A Ray worker (or its node) died under a trial (`optimizer.run.ray_executor`)."""


class StudyLockedError(NightshiftError):
    exit_code = 2


class StorageError(NightshiftError):
    """The Optuna storage, the study's source of truth, failed a read or write while the daemon
    ran: the daemon stops its trials and exits, and a resume recovers them."""


class TrackingError(NightshiftError):
    pass


def describe(exc: BaseException) -> str:
    """A foreign exception as one line for a message: the type and first line of what caused
    it (SQLAlchemy and MLflow wrap the driver's error and append the SQL), at most 200
    characters."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    lines = str(getattr(root, "orig", None) or root).strip().splitlines()
    text = lines[0].strip() if lines else ""
    text = text.removeprefix(f"({type(root).__module__}.{type(root).__name__}) ")
    return f"{type(root).__name__}: {text}"[:200] if text else type(root).__name__
