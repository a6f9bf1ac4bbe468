"""A study's SQLite stores found empty, garbled or cut short: refused in one line naming the
field and the fix, before anything starts (exit 2), by `start`, `status`, `report`, `export`."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
import pytest

from optimizer.cli import main
from optimizer.config.store_checks import sqlite_file_problem
from tests.builders import write_study


def _real_study_db(path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
    study = optuna.create_study(study_name="s", storage=storage)
    for _ in range(40):
        trial = study.ask()
        trial.set_user_attr("record", {"padding": "x" * 2000})
        study.tell(trial, 1.0)
    storage.engine.dispose()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "optuna.db"
    _real_study_db(path)
    assert path.stat().st_size > 64_000
    return path


def test_a_sound_store_passes(db: Path) -> None:
    assert sqlite_file_problem("storage", f"sqlite:///{db}") is None


def test_an_empty_store_is_refused_not_taken_for_a_new_study(db: Path) -> None:
    db.write_bytes(b"")
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "0 bytes" in problem and "backup" in problem


def test_a_store_cut_short_is_refused_as_damaged(db: Path) -> None:
    with db.open("r+b") as f:
        f.truncate(db.stat().st_size // 2)
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "damaged" in problem, problem


def test_a_store_with_garbled_pages_is_refused_as_damaged(db: Path) -> None:
    data = bytearray(db.read_bytes())
    for offset in range(4096, len(data) - 4096, 8192):  # every other page after the first
        data[offset:offset + 4096] = b"\xa5" * 4096
    db.write_bytes(bytes(data))
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "damaged" in problem, problem


@pytest.mark.parametrize("command", ["status", "report", "export", "start"])
def test_reading_commands_refuse_a_garbled_store_in_one_line_with_exit_2(
        db: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "damaged.db"
    shutil.copy(db, damaged)
    with damaged.open("r+b") as f:
        f.truncate(damaged.stat().st_size // 3)
    study = write_study(tmp_path, name="s", trials=1, file_name="s.yaml",
                        storage=f"sqlite:///{damaged}",
                        tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    code = main([command, str(study)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{command}: exit 2 for a damaged store, got {code}: {err[-400:]}"
    assert len(lines) == 1 and "storage:" in lines[0] and "damaged" in lines[0], lines[:5]
    assert "Traceback" not in err
    # `start` (issue 35, item 7: it looped on "resume with", then refused after Ray started).
    assert not (tmp_path / "results").exists() and not (tmp_path / "m.db").exists(), \
        "refused before anything is written"
