"""`nightshift` command line: the composition root. Builds typed config once, wires the study,
workers, tracker and progress display, and maps errors to exit codes (0 ok, 1 failure, 2 bad
input). Only this package installs logging handlers or prints. This module is its public face
(`main`, the `nightshift` entry point); `app` the typer app the subcommands share, `run`
(start, stop), `results` (status, report, export), `history`, `checks` (regress, audit, hw)
the subcommands, `live` the live table, `table` the trial table it and `status` draw, `output`
the consoles and logging handlers.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.text import Text

# typer 0.29 bundles its own click (`typer._click`); the `click` package's exceptions never
# match what it raises. pyproject.toml pins typer to 0.29.x, and tests/optimizer/test_cli.py
# runs `main` on the installed version's usage errors.
from typer._click.exceptions import (
    ClickException,
    NoArgsIsHelpError,
    NoSuchOption,
    UsageError,
)

# Importing a subcommand's module registers it on `app`.
from optimizer.cli import checks, history, results, run  # noqa: F401
from optimizer.cli.app import COMMAND_ORDER, GlobalOptions, app
from optimizer.cli.output import console, print_debug_traceback
from optimizer.errors import NightshiftError

__all__ = ["app", "main"]

# `--help` lists the subcommands in COMMAND_ORDER, whichever module registered each.
app.registered_commands.sort(key=lambda command: COMMAND_ORDER.index(
    command.name or (command.callback.__name__ if command.callback else "")))

PRIVATE_UMASK = 0o077


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code: 0 ok, 1 failure, 2 bad input."""
    # Results, stores and logs are the user's alone (0600 files, 0700 directories): a trial's
    # env and server log may hold a secret. Ray's local workers, started from here, inherit it.
    os.umask(PRIVATE_UMASK)
    # MLflow configures its own logger at import, at INFO; its table-creation chatter is noise.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # Nor its own stderr handler: its records go through ours, and its store errors (a
    # traceback and SQL each, which nightshift says in one line) to the daemon's log only.
    os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    # An unreachable tracking server must fail in seconds, not after MLflow's long back-off.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    GlobalOptions.is_debug = False  # `--debug` sets it, before the subcommand runs
    try:
        # Without standalone mode typer returns a command's `typer.Exit(code)` (and --help's
        # exit) as a value and raises usage errors to us instead of printing them itself.
        code = app(args=argv if argv is not None else sys.argv[1:], standalone_mode=False,
                   prog_name="nightshift")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except typer.Abort:
        return 1
    except UsageError as exc:
        _show_usage_error(exc)
        return 2
    except ClickException as exc:  # a file typer could not open, say: bad input too
        console.print(Text.assemble(("error: ", "red"), " ".join(exc.format_message().split())),
                      soft_wrap=True)
        return 2
    except NightshiftError as exc:
        # Text, not markup: a message may hold brackets (a domain `[auto, fp8]`, a bracket
        # `[57, 64)`), which markup would take for tags and drop.
        console.print(Text.assemble(("error: ", "red"), str(exc)), highlight=False,
                      soft_wrap=True)
        if GlobalOptions.is_debug:
            print_debug_traceback(exc)
        return exc.exit_code
    except OSError as exc:
        from optimizer.run.executor import is_host_refusal

        if not is_host_refusal(exc):
            raise  # a bug of ours as often as not: its traceback says where
        # A full or read-only disk, a permission: the host's, said in one line. What nightshift
        # was writing is whole or absent (runners/atomic.py), never cut.
        where = f" ({exc.filename})" if exc.filename else ""
        console.print(Text.assemble(
            ("error: ", "red"), f"the host refused a file operation{where}: "
            f"{exc.strerror or exc}; nothing was left half-written; free space or fix the "
            "permissions and run the command again."), highlight=False, soft_wrap=True)
        if GlobalOptions.is_debug:
            print_debug_traceback(exc)
        return 1
    return 0


def _show_usage_error(exc: UsageError) -> None:
    """One line naming what is wrong, then the command's usage and where its help is."""
    ctx = exc.ctx
    root = ctx.find_root() if ctx is not None else None
    names = root.command.list_commands(root) if root is not None and \
        hasattr(root.command, "list_commands") else []
    commands = ", ".join(names)
    if isinstance(exc, NoArgsIsHelpError):  # its message is the whole help text
        message = f"no command given; the commands are: {commands}."
    else:
        message = " ".join(exc.format_message().split())
        if message.startswith("No such command"):
            message = f"{message.rstrip('.')}; the commands are: {commands}."
        elif isinstance(exc, NoSuchOption) and ctx is not None and \
                ctx.command.context_settings.get("allow_extra_args"):
            # audit: an option of the launch it checks, given before `--`.
            message = (f"{message.rstrip('.')}; if it is the launch's, put the launch after "
                       f"`--`: {ctx.command_path} -- vllm serve MODEL {exc.option_name} ...")
    console.print(Text.assemble(("error: ", "red"), message), soft_wrap=True)
    if ctx is not None:
        usage = " ".join(ctx.get_usage().split())
        console.print(Text(f"{usage}  (see `{ctx.command_path} --help`)"), soft_wrap=True)

