"""`nightshift` command line: the composition root. Builds typed config once, wires the study,
workers, tracker and progress display, and maps errors to exit codes (0 ok, 1 failure, 2 bad
input). Only this package installs logging handlers or prints. This module is its public face
(`main`, the `nightshift` entry point); `commands` holds the subcommands, `live` the live table,
`output` the consoles and logging handlers.
"""

from __future__ import annotations

import os
import sys

from optimizer.cli.commands import app
from optimizer.cli.output import console
from optimizer.errors import NightshiftError

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code: 0 ok, 1 failure, 2 bad input."""
    import click

    # MLflow configures its own logger at import, at INFO; its table-creation chatter is noise.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # An unreachable tracking server must fail in seconds, not after MLflow's long back-off.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    try:
        # Without standalone mode click returns a command's `typer.Exit(code)` as a value.
        code = app(args=argv if argv is not None else sys.argv[1:], standalone_mode=False,
                   prog_name="nightshift")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    except click.exceptions.Abort:
        return 1
    except click.ClickException as exc:
        exc.show()
        return 2
    except NightshiftError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return exc.exit_code
    return 0
