"""The `nightshift` typer app and what every subcommand shares: the usage line, the study
argument and storage option, loading the study file, checking an output file. The subcommands
register on `app` from their modules (`run`, `results`, `history`, `checks`); `--help` lists
them in COMMAND_ORDER."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from optimizer.config import StudyConfig, load_study
from optimizer.errors import ConfigError

# The order `--help` and the "no command given" line list the subcommands in.
COMMAND_ORDER = ("start", "status", "stop", "export", "regress", "report", "audit", "history",
                 "hw")


class Command(TyperCommand):
    """A subcommand whose usage line names a required argument plainly (`STUDY.yaml`), where
    typer 0.29 writes `{STUDY.yaml}`."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        pieces = [piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
                  for piece in super().collect_usage_pieces(ctx)]
        if self.context_settings.get("allow_extra_args"):  # audit: the launch it checks
            pieces.append("[-- vllm serve MODEL ...]")
        return pieces


# Click's plain help (rich_markup_mode=None): paragraphs rewrapped to the terminal, no type
# column; a paragraph that starts with \b (the examples) is kept as written.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="nightshift: tune vLLM serving configs overnight (Optuna + Ray + MLflow)."
                       "\n\nRun `nightshift COMMAND --help` for a command's options and an "
                       "example. Exit codes: 0 ok, 1 failure, 2 bad input.")



class GlobalOptions:
    """The options given before the subcommand (`nightshift --debug start ...`), which `main`
    reads once the command has ended; set afresh on each run (tests run `main` many times in
    one process)."""

    is_debug: bool = False  # print an error's traceback, its causes too, after its one line


@app.callback()
def _global_options(debug: Annotated[bool, typer.Option(
        "--debug", help="On an error, also print its traceback, with the errors that caused "
                        "it (SQLite's, YAML's, MLflow's...), after the one line.")] = False
                    ) -> None:
    GlobalOptions.is_debug = debug


StudyArg = Annotated[Path, typer.Argument(
    metavar="STUDY.yaml", show_default=False,
    help="The study file (see examples/quickstart.yaml).")]
StorageOpt = Annotated[str | None, typer.Option(
    metavar="URL", help="Optuna RDB URL, where the study file's storage is not the one to read.")]



def load_config(study: Path) -> StudyConfig:
    return load_study(study)


def check_output_file(option: str, path: Path) -> None:
    """A file the command is to write: refused (ConfigError) where it is a directory or its
    directory does not exist, before anything is read or written."""
    if path.is_dir():
        raise ConfigError(f"{option}: {str(path)!r:.120} is a directory; give a file name.")
    if not path.absolute().parent.is_dir():
        raise ConfigError(f"{option}: the directory of {str(path)!r:.120} does not exist; "
                          "create it or give a file in an existing directory.")
