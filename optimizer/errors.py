"""The exception tree of nightshift: what stops a command, as one line that says what to fix.

    NightshiftError
     ├── ConfigError          bad study/space file or flag (exit code 2)
     ├── WorkerLost           the Ray worker (or its node) died
     ├── StudyLockedError     another daemon runs this study (exit code 2)
     ├── StorageError         the Optuna storage failed mid-study (the daemon stops; resume)
     └── TrackingError        the tracking store refused a write (MLflow)

Foreign exceptions (YAML, pydantic, JSON, OSError, SQLAlchemy, Optuna's storage, MLflow, Ray,
and the ValueErrors of runners/ and search_spaces/, which may not import this tree) become one
of these in one way: `raise translate(exc, message) from exc`. `FOREIGN_ERRORS` maps a
foreign type to the class it becomes; a site passes `into=` where what it was doing decides
instead (a foreign error met while checking input before a study starts is bad input,
ConfigError). The message is the site's one line (what was expected, what was got, what to
do); `describe`, `headline` and `one_line` render a foreign exception for it (a YAML refusal:
`search_spaces.bounded_yaml.yaml_message`, which search spaces share). A check that returns
its line rather than raising it returns a `Problem`, which keeps the foreign exception it
caught; the error raised from that line chains it (`cause_of`). The CLI prints the line alone
(`nightshift --debug`: then the traceback, its causes with it); the chained cause keeps the
foreign traceback in the daemon's log (for an error that stops a running study) and for
whoever debugs. Four raises drop their cause (`from None`), each saying why: a miss in one of
our own registries and an interrupt or logged failure turned into an exit code, never a
foreign failure (a test in tests/optimizer/test_errors.py holds each to its comment).
Trial-level failures never raise through the daemon: runners return them as data
(`RunResult.failure`).
"""

from __future__ import annotations

from typing import Final


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


# The class a foreign exception becomes where its site does not say (`translate`'s `into`):
# the first base of its type found here decides, a type with none becomes a NightshiftError
# (exit 1). Keys are qualified names, so that this module imports none of these packages.
FOREIGN_ERRORS: Final[dict[str, type[NightshiftError]]] = {
    # A file or value the user gave: bad input.
    "yaml.error.YAMLError": ConfigError,
    "pydantic_core._pydantic_core.ValidationError": ConfigError,
    "json.decoder.JSONDecodeError": ConfigError,
    "builtins.UnicodeDecodeError": ConfigError,
    "search_spaces.errors.SpaceError": ConfigError,
    "search_spaces.known_facts.FactError": ConfigError,
    "search_spaces.engine.tables.UnknownVersionError": ConfigError,
    # A store or the cluster failing under a study that runs.
    "sqlalchemy.exc.SQLAlchemyError": StorageError,
    "optuna.exceptions.StorageInternalError": StorageError,
    "mlflow.exceptions.MlflowException": TrackingError,
    "ray.exceptions.RayError": WorkerLost,
}


def error_class(exc: BaseException) -> type[NightshiftError]:
    """The class `exc` becomes by `FOREIGN_ERRORS` (its own, for one of ours)."""
    if isinstance(exc, NightshiftError):
        return type(exc)
    for base in type(exc).__mro__:
        into = FOREIGN_ERRORS.get(f"{base.__module__}.{base.__qualname__}")
        if into is not None:
            return into
    return NightshiftError


def translate(exc: BaseException, message: str, *,
              into: type[NightshiftError] | None = None) -> NightshiftError:
    """`exc` as the NightshiftError that says `message`: of class `into`, else the one
    `FOREIGN_ERRORS` maps its type to, with `exc` as its cause. Raise it `from exc` (a
    traceback, as the daemon's log writes one, keeps the foreign one; the CLI prints the
    message alone). A message of several lines (a foreign text within it) is joined into one."""
    if len(message.splitlines()) > 1:
        message = " ".join(message.split())
    error = (into or error_class(exc))(message)
    error.__cause__ = exc
    return error


class Problem(str):
    """A check's one line (`storage_problem`, `sqlite_file_problem`, ...: what was expected, what
    was got, what to do) with the foreign exception that showed it, where one did, as `cause`.
    A str, read and joined as any message is; the ConfigError raised from it chains the cause
    (`raise ConfigError(f"{source}: {problem}.") from cause_of(problem)`), so the traceback
    `--debug` prints shows what the line sums up."""

    cause: BaseException | None

    def __new__(cls, message: str, cause: BaseException | None = None) -> Problem:
        problem = super().__new__(cls, message)
        problem.cause = cause
        return problem


def cause_of(problem: str | None) -> BaseException | None:
    """The foreign exception behind a check's `problem` (a `Problem`'s cause), or None (a plain
    message, or no problem): what the error raised from it chains."""
    return problem.cause if isinstance(problem, Problem) else None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """A lower layer's own message (runners' and search_spaces' ValueErrors name the file and
    the fix) as one line for a message of ours: whitespace joined, at most `limit`
    characters, no final period (the message adds its own)."""
    return " ".join(str(exc).split())[:limit].rstrip(".")


def headline(exc: BaseException, limit: int = 160) -> str:
    """A foreign exception itself (not its root cause, as `describe`) as its type and the
    first line of its text, cut at `limit` characters: what MLflow or Ray said on refusing."""
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit]}"


def describe(exc: BaseException) -> str:
    """A foreign exception as one line for a message: the type and first line of what caused
    it (SQLAlchemy and MLflow wrap the driver's error and append the SQL), at most 200
    characters. The walk down the causes stops at one of ours: its line already says its
    cause."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root and \
            not isinstance(root, NightshiftError):
        root = root.__cause__
    lines = str(getattr(root, "orig", None) or root).strip().splitlines()
    text = lines[0].strip() if lines else ""
    text = text.removeprefix(f"({type(root).__module__}.{type(root).__name__}) ")
    return f"{type(root).__name__}: {text}"[:200] if text else type(root).__name__
