"""A prompts file (JSONL: {"prompt": text or token ids, "output_len": tokens?}) read line by line
and checked as `build_requests` reads it: `parse_prompt_line`, `check_prompts_file`,
`prompts_file_longest`, `vocabulary_problem`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runners import arrivals, datasets
from runners.tokenizer import PromptTokenizer

# (prompt, its length in tokens, output_len or None, whether the length is an estimate)
PromptEntry = tuple[str | list[int], int, int | None, bool]


def check_prompts_file(path: Path, tokenizer: PromptTokenizer | None = None) -> int:
    """Read a prompts file line by line as `build_requests` reads it; the longest prompt's
    length in tokens (counted with `tokenizer`, else estimated). Raises ValueError naming the
    first line it would refuse (OSError or UnicodeDecodeError where it cannot read the file)."""
    return prompts_file_longest(path, tokenizer)[0]


def vocabulary_problem(prompt: str | Sequence[int] | None,
                       vocab_size: int | None) -> str | None:
    """Why a prompt of token ids cannot be sent to a model of `vocab_size` ids (the server
    refuses an id past it), or None: text, no vocabulary known, or every id within it."""
    if vocab_size is None or isinstance(prompt, str) or not prompt or max(prompt) < vocab_size:
        return None
    return (f"token id {max(prompt)} is beyond the model's vocabulary of {vocab_size} ids; "
            "give ids of the model's tokenizer")


def prompts_file_longest(path: Path, tokenizer: PromptTokenizer | None = None,
                         default_output_len: int = 0, vocab_size: int | None = None
                         ) -> tuple[int, int]:
    """`check_prompts_file`'s reading: the longest prompt and the longest output, in tokens
    (a line without `output_len` gets `default_output_len`, the workload's longest); token ids
    must lie below `vocab_size` where it is given (the server refuses any other)."""
    longest = 0
    longest_output = 0
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is no JSON
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                prompt, prompt_len, output_len, _ = parse_prompt_line(path, line_no, line,
                                                                       tokenizer)
                problem = vocabulary_problem(prompt, vocab_size)
                if problem is not None:
                    raise ValueError(f"{path}:{line_no}: {problem}.")
                longest = max(longest, prompt_len)
                longest_output = max(longest_output, output_len or default_output_len)
    if longest == 0:
        raise ValueError(f"{path}: expected JSONL lines with a 'prompt' but the file is empty.")
    return longest, longest_output


def parse_prompt_line(path: Path, line_no: int, line: str,
                       tokenizer: PromptTokenizer | None = None) -> PromptEntry:
    """(prompt, its length in tokens, output_len or None, whether the length is an estimate).
    A text prompt is counted with the tokenizer; without one a `prompt_len` the line gives
    is taken, else it is estimated (UTF-8 bytes / 4)."""
    where = f"{path}:{line_no}"
    entry = arrivals.json_object(where, line)
    prompt = entry.get("prompt")
    prompt_len: int
    is_estimated = False
    if isinstance(prompt, str) and prompt:
        prompt = datasets.well_formed(prompt)
        if tokenizer is not None:
            prompt_len = tokenizer.count(prompt)
        elif isinstance(entry.get("prompt_len"), int) and entry["prompt_len"] >= 1:
            prompt_len = int(entry["prompt_len"])
        else:
            prompt_len, is_estimated = datasets.estimate_tokens(prompt), True
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        prompt_len = len(prompt)
    else:
        raise ValueError(
            f"{where}: 'prompt' must be a non-empty string or list of token ids "
            f"but got {prompt!r:.60}."
        )
    output_len = entry.get("output_len")
    if output_len is not None and (
        not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1
    ):
        raise ValueError(f"{where}: 'output_len' must be an integer >= 1 but got {output_len!r}.")
    return prompt, prompt_len, output_len, is_estimated
