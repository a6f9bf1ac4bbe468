"""The exception tree of nightshift. Foreign exceptions are translated at the boundary and chained.

    NightshiftError
     ├── ConfigError          bad study/space file or flag (exit code 2)
     ├── EngineError          an engine could not be measured
     │    ├── EngineStartError
     │    ├── ReadinessTimeout
     │    └── WorkerLost      the Ray worker (or its node) died
     ├── StudyLockedError     another daemon runs this study
     └── TrackingError        the tracking store refused a write (MLflow)

Trial-level failures never raise through the daemon: runners return them as data
(`RunResult.failure`). These exceptions are for what stops a command.
"""

from __future__ import annotations


class NightshiftError(Exception):
    """Base of every error nightshift raises on purpose."""

    exit_code = 1


class ConfigError(NightshiftError, ValueError):
    """A study file, search space or command-line value is invalid. The message is one line:
    what was expected, what was got, what to do."""

    exit_code = 2


class EngineError(NightshiftError):
    pass


class EngineStartError(EngineError):
    pass


class ReadinessTimeout(EngineError):
    pass


class WorkerLost(EngineError):
    pass


class StudyLockedError(NightshiftError):
    exit_code = 2


class TrackingError(NightshiftError):
    pass
