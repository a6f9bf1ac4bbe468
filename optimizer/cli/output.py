"""Where the command line's output goes: `console` (stderr: messages, progress, logs) and `out`
(stdout: what a command reports), and the logging handlers; the only place that installs them.
`--debug`'s traceback of an error, its causes with it (`print_debug_traceback`)."""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

# Markup off: what is printed holds user text and figures with brackets (a domain
# `[auto, fp8]`, a capacity `[57, 64)`, a launch's `-cc.cudagraph_sizes=[1,2]`) that markup
# would take for tags and drop. Colour goes through `Text` (`styled`).
console = Console(stderr=True, markup=False)
out = Console(markup=False)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Plain strings and (text, style) pairs as one `Text`: colour without markup."""
    return Text.assemble(*parts)


def debug_traceback(exc: BaseException) -> str:
    """`exc`'s traceback with the chain of its causes, as Python prints it; and, where pydantic
    stands in that chain, the traceback of each check it wrapped (a check's ValueError, which
    chains the foreign error the check caught: pydantic keeps it in the error's context, where
    a traceback does not look)."""
    from pydantic import ValidationError

    parts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, ValidationError):
            for error in link.errors():
                wrapped = (error.get("ctx") or {}).get("error")
                if isinstance(wrapped, BaseException):
                    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
                    parts.append(f"\nThe check pydantic wrapped in the ValidationError above "
                                 f"({where}):\n\n" +
                                 "".join(traceback.format_exception(wrapped)))
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return "".join(parts).rstrip("\n")


def print_debug_traceback(exc: BaseException) -> None:
    """`--debug`: `exc`'s traceback and its causes (`debug_traceback`) on stderr, after the one
    line that said it."""
    console.print(Text(debug_traceback(exc)), highlight=False, soft_wrap=True)


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
