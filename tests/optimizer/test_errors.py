"""The one translation of foreign exceptions into nightshift's tree (optimizer/errors.py): each
foreign type met for real becomes the class the table names, with its exit code, the site's
one line, and the foreign exception chained as its cause."""

from __future__ import annotations

import ast
import importlib
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from optimizer.errors import (
    FOREIGN_ERRORS,
    ConfigError,
    NightshiftError,
    StorageError,
    StudyLockedError,
    TrackingError,
    WorkerLost,
    describe,
    error_class,
    headline,
    one_line,
    translate,
)


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # what the foreign call raised, kept for translation
        return exc
    raise AssertionError("the call was to raise")


def _yaml() -> object:
    import yaml

    return yaml.safe_load("a: [1, 2")


def _pydantic() -> object:
    from pydantic import BaseModel

    class Spec(BaseModel):
        trials: int

    return Spec.model_validate({"trials": "many"})


def _sqlalchemy(tmp_path: Path) -> Callable[[], object]:
    def connect() -> object:
        import sqlalchemy

        engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/missing/dir/optuna.db")
        with engine.connect():
            return None
    return connect


def _optuna() -> object:
    import optuna

    raise optuna.exceptions.StorageInternalError("an error occurred while committing")


def _mlflow() -> object:
    from mlflow.exceptions import MlflowException

    raise MlflowException("RESOURCE_DOES_NOT_EXIST: no experiment 'x'")


def _ray() -> object:
    from ray.exceptions import GetTimeoutError

    raise GetTimeoutError("Get timed out: some object(s) not ready.")


def _space() -> object:
    from search_spaces import SpaceError

    raise SpaceError("max_num_seqs: low must be <= high")


def _facts() -> object:
    from search_spaces.known_facts import FactError

    raise FactError("known_facts.yaml: fact 3 names no id")


def _version() -> object:
    from search_spaces.engine.tables import UnknownVersionError

    raise UnknownVersionError("no flag table for vLLM 0.1")


# (the foreign call, the class it becomes, its exit code)
CASES: dict[str, tuple[Callable[[Path], Callable[[], object]], type[NightshiftError], int]] = {
    "yaml": (lambda _: _yaml, ConfigError, 2),
    "pydantic": (lambda _: _pydantic, ConfigError, 2),
    "json": (lambda _: lambda: json.loads('{"a": '), ConfigError, 2),
    "utf8": (lambda _: lambda: b"\xff\xfe".decode("utf-8"), ConfigError, 2),
    "space": (lambda _: _space, ConfigError, 2),
    "facts": (lambda _: _facts, ConfigError, 2),
    "vllm version": (lambda _: _version, ConfigError, 2),
    "sqlalchemy": (_sqlalchemy, StorageError, 1),
    "optuna storage": (lambda _: _optuna, StorageError, 1),
    "mlflow": (lambda _: _mlflow, TrackingError, 1),
    "ray": (lambda _: _ray, WorkerLost, 1),
    "a type the table lacks": (lambda _: lambda: int("x"), NightshiftError, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_foreign_error_becomes_its_class_with_one_line_and_its_cause_chained(
        name: str, tmp_path: Path) -> None:
    make, into, exit_code = CASES[name]
    foreign = _raised(make(tmp_path))
    message = f"{name}: what was expected, what was got; what to do."
    try:
        raise translate(foreign, message) from foreign
    except NightshiftError as exc:
        error = exc
    assert type(error) is into, f"{type(foreign).__name__} becomes {into.__name__}"
    assert error.exit_code == exit_code
    assert str(error) == message, "the site's message, unchanged"
    assert error.__cause__ is foreign, "the foreign exception is the cause"
    shown = "".join(traceback.format_exception(error))
    assert type(foreign).__name__ in shown and "direct cause" in shown, \
        "the logged traceback keeps the foreign one"


def test_into_decides_where_the_site_knows_better_than_the_type(tmp_path: Path) -> None:
    foreign = _raised(_sqlalchemy(tmp_path))  # a storage URL refused at the start: bad input
    error = translate(foreign, "storage: cannot be opened; give a reachable URL.",
                      into=ConfigError)
    assert type(error) is ConfigError and error.exit_code == 2
    assert error.__cause__ is foreign
    assert translate(BlockingIOError(11, "busy"), "held", into=StudyLockedError).exit_code == 2


def test_one_of_ours_keeps_its_class_when_rewrapped() -> None:
    inner = translate(_raised(_mlflow), "MLflow store refused the study.", into=TrackingError)
    assert error_class(inner) is TrackingError
    outer = translate(inner, f"cases a: {inner}")
    assert type(outer) is TrackingError and outer.__cause__ is inner
    assert type(translate(ConfigError("x"), "study.yaml: x")) is ConfigError


def test_a_message_of_several_lines_becomes_one() -> None:
    foreign = _raised(_mlflow)
    error = translate(foreign, "store x could not be read (MlflowException: first\n  second\n)")
    assert str(error) == "store x could not be read (MlflowException: first second )"


def test_every_foreign_type_the_table_names_exists() -> None:
    """The table names types by their qualified names (errors.py imports none of their
    packages): a rename upstream must fail here, not leave the entry matching nothing."""
    for qualified, into in FOREIGN_ERRORS.items():
        module, _, name = qualified.rpartition(".")
        found = getattr(importlib.import_module(module), name, None)
        assert isinstance(found, type) and issubclass(found, BaseException), qualified
        assert issubclass(into, NightshiftError)


def test_describe_goes_to_the_foreign_root_but_stops_at_ours(tmp_path: Path) -> None:
    foreign = _raised(_sqlalchemy(tmp_path))
    assert describe(foreign) == "OperationalError: unable to open database file"
    wrapped = translate(foreign, "the Optuna storage x stayed locked for 60 s; close it")
    assert describe(wrapped) == "StorageError: the Optuna storage x stayed locked for 60 s; " \
        "close it", "our line already says its cause"


def test_one_line_joins_a_lower_layers_message_and_drops_its_period() -> None:
    assert one_line(ValueError("config.json:\n  not JSON (ValueError);  give it.")) == \
        "config.json: not JSON (ValueError); give it"
    assert len(one_line(ValueError("x" * 500))) == 300


def test_every_raise_from_none_says_why() -> None:
    """A raise that drops its cause (`from None`) says why on its line or its `except` line:
    only our own control flow may (a registry miss, an exit code), never a foreign failure."""
    root = Path(__file__).resolve().parents[2]
    silent = []
    for package in ("optimizer", "runners", "search_spaces"):
        for path in sorted((root / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for handler in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(handler, ast.ExceptHandler):
                    continue
                for node in ast.walk(handler):
                    if isinstance(node, ast.Raise) and isinstance(node.cause, ast.Constant) \
                            and node.cause.value is None:
                        said = lines[handler.lineno - 1] + "".join(
                            lines[node.lineno - 1:node.end_lineno or node.lineno])
                        if "#" not in said:
                            silent.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not silent, f"raised from None without saying why: {silent}"


def test_headline_is_the_exception_itself_on_one_line() -> None:
    refusal = _raised(_mlflow)
    assert headline(refusal) == "MlflowException: RESOURCE_DOES_NOT_EXIST: no experiment 'x'"
    assert headline(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert headline(RuntimeError("x" * 500)) == "RuntimeError: " + "x" * 160
    assert headline(RuntimeError()) == "RuntimeError: "
