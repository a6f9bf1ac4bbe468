"""The workload's files read as the runner will read them before `nightshift start` writes or
starts anything: a prompts file, a trace, a dataset (each problem one `ConfigError` line), with
the longest prompt and output each holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer.config.fields import MAX_PROMPTS_FILE_BYTES, MAX_TRACE_FILE_BYTES
from optimizer.errors import ConfigError, one_line, translate

if TYPE_CHECKING:
    from runners.tokenizer import PromptTokenizer
    from runners.workload import DatasetSource


def _not_a_file(path: Path) -> str:
    """What a path that must be a regular file is instead."""
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():  # /dev/zero, a FIFO, a socket: endless or blocking to read
        return "is a device or pipe, not a regular file"
    return "does not exist"


def check_dataset_file(source: DatasetSource, study: str,
                   tokenizer: PromptTokenizer | None) -> None:
    from runners.datasets import check_dataset

    where = f"{study}: workload.dataset.path"
    path = source.path
    _require_input_file(where, path, "give a ShareGPT-style JSON (or JSONL) file of "
                        "{\"id\", \"conversations\"} objects", MAX_PROMPTS_FILE_BYTES,
                        "a benchmark needs a sample of conversations, not a corpus")
    with _read_as_the_runner(where, path, "give a JSON file"):
        check_dataset(source, tokenizer)


def _require_input_file(where: str, path: Path, fix: str, max_bytes: int, too_big: str) -> None:
    """One ConfigError line where `path` is not a regular file (`fix`: what to give) or is
    over `max_bytes` (`too_big`: what to give instead)."""
    if not path.is_file():
        raise ConfigError(f"{where}: {str(path)!r:.120} {_not_a_file(path)}; {fix}.")
    if path.stat().st_size > max_bytes:
        raise ConfigError(f"{where}: {str(path)!r:.120} is over {max_bytes:,} bytes; "
                          f"{too_big}.")


@contextmanager
def _read_as_the_runner(where: str, path: Path, fix: str) -> Iterator[None]:
    """A file read as the runner will read it, each way it can fail one ConfigError line:
    unreadable, not UTF-8 (`fix` says what to give), or refused by the reader (its message)."""
    try:
        yield
    except OSError as exc:
        raise translate(exc, f"{where}: cannot read {str(path)!r:.120} "
                        f"({type(exc).__name__}); check its permissions.",
                        into=ConfigError) from exc
    except UnicodeDecodeError as exc:
        raise translate(exc, f"{where}: {str(path)!r:.120} is not UTF-8 text; {fix}.") from exc
    except RecursionError as exc:
        raise translate(exc, f"{where}: {str(path)!r:.120} holds JSON nested too deeply to "
                        f"read; {fix}.", into=ConfigError) from exc
    except (ValueError, TypeError) as exc:
        raise translate(exc, f"{where}: {one_line(exc)}.", into=ConfigError) from exc


def check_prompts_file(path: Path, source: str, tokenizer: PromptTokenizer | None,
                        default_output_len: int, vocab_size: int | None = None
                        ) -> tuple[int, int]:
    """The longest prompt and the longest output (a line's `output_len`, else the default)."""
    from runners.loadgen.prompts_file import prompts_file_longest

    where = f"{source}: workload.prompts_file"
    _require_input_file(where, path, "give a JSONL file with one {\"prompt\": ...} object a "
                        "line", MAX_PROMPTS_FILE_BYTES,
                        "a benchmark needs a sample of prompts, not a corpus")
    with _read_as_the_runner(where, path, "give a JSONL file"):
        return prompts_file_longest(path, tokenizer, default_output_len, vocab_size)


def check_trace_file(path: Path, timestamp_unit_s: float, source: str, *,
                      has_shared_prefix: bool, max_gap_s: float | None = None,
                      has_tokenizer: bool = False,
                      vocab_size: int | None = None) -> tuple[int, int, list[float]]:
    """The trace read as the runner reads it: its longest prompt and output, in tokens, and its
    arrival times (s from the first)."""
    from runners.arrivals import read_trace
    from runners.loadgen.prompts_file import vocabulary_problem

    where = f"{source}: workload.trace.path"
    fix = ("give a JSONL file with one {\"timestamp\": s, \"input_length\": n, "
           "\"output_length\": n} object a line")
    _require_input_file(where, path, fix, MAX_TRACE_FILE_BYTES, "replay a slice of the trace")
    with _read_as_the_runner(where, path, fix):
        entries = read_trace(path, timestamp_unit_s, max_gap_s)
    for number, entry in enumerate(entries, start=1):
        problem = vocabulary_problem(entry.prompt, vocab_size)
        if problem is not None:
            raise ConfigError(f"{where}: request {number}: {problem}.")
    if has_shared_prefix:
        # As runners/loadgen/requests.py `_with_shared_prefix` joins them: every prompt token
        # ids, or every prompt text (an entry without one is synthesised: text where the model
        # has a tokenizer, token ids where not) counted again with the tokenizer.
        kinds = ["text" if isinstance(e.prompt, str) else "ids" if isinstance(e.prompt, list)
                 else "text" if has_tokenizer else "ids" for e in entries]
        if len(set(kinds)) > 1:
            first = kinds.index("text" if kinds[0] == "ids" else "ids")
            raise ConfigError(f"{where}: request {first + 1} gives a {kinds[first]} prompt "
                              f"where request 1 gives {kinds[0]}, but workload.shared_prefix "
                              "needs prompts of one kind; give all token ids or all text, or "
                              "leave shared_prefix out.")
        if kinds and kinds[0] == "text" and not has_tokenizer:
            raise ConfigError(f"{where}: the prompts are text, and workload.shared_prefix joins "
                              "text prompts only through the model's tokenizer, which "
                              "model.path does not have here; give token ids or leave "
                              "shared_prefix out.")
    return (max(e.input_len for e in entries), max(e.output_len for e in entries),
            [e.arrival_s for e in entries])
