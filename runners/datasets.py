"""Conversation datasets as prompts: ShareGPT-style files read, checked entry by entry, and
sampled per index, as vLLM's `ShareGPTDataset` samples them (vllm/benchmarks/datasets/
datasets.py:1346), with token counts from the model's tokenizer where there is one.

A file is a JSON list (or JSONL, one object a line, or one JSON object) of
`{"id": ..., "conversations": [{"from": "human" | "gpt" | ..., "value": str}, ...]}`, or of the
OpenAI chat shape `{"id": ..., "messages": [{"role": "user" | "assistant" | ..., "content":
str | [{"type": "text", "text": str}, ...]}, ...]}`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runners.workload import DatasetSource

if TYPE_CHECKING:
    from runners.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

# Where the model has no tokenizer: tokens estimated as UTF-8 bytes / 4. For English that is
# chars / 4; scripts stored in two to four bytes a character (Cyrillic, Arabic, Chinese,
# Japanese, Korean, emoji), on which byte-level BPE tokenizers spend more tokens a character
# than on English, estimate two to four times what chars / 4 did, which undercounted CJK most.
# An estimate, not checked against a tokenizer here.
BYTES_PER_TOKEN = 4
ESTIMATE = f"UTF-8 bytes / {BYTES_PER_TOKEN}"  # how an estimate is made, as messages say it
USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
_SHAPE = '{"from": "human" | "gpt", "value": "..."}'
_OPENAI_SHAPE = '{"role": "user" | "assistant", "content": "..."}'
_TURN_KEYS = (("from", "value"), ("role", "content"))  # ShareGPT's, then OpenAI chat's


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """`text` with each lone UTF-16 surrogate (a `\\ud83d` escape cut from its pair, common in
    scraped chat logs) replaced by U+FFFD: it cannot be sent as UTF-8 or tokenized, and
    would fail every request that carries it as if the server had."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def estimate_tokens(text: str) -> int:
    """Tokens of `text` where no tokenizer is at hand: an estimate (`ESTIMATE`), never a
    count."""
    return max(1, len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN)


@dataclass(frozen=True)
class Turn:
    """One user message and the reply the dataset gives it."""

    user: str
    user_len: int  # tokens: counted by the tokenizer (specials included) or estimated
    reply_len: int  # tokens of the dataset's reply (without specials), or estimated


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]  # user/reply pairs in order; at least one
    is_estimated: bool  # lengths are estimates (ESTIMATE): the model has no tokenizer here


def _fail(path: Path, where: str, problem: str) -> ValueError:
    return ValueError(f"{path}: {where}: {problem}")


def _entries(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no JSON
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _fail(path, f"line {exc.lineno}", f"expected a JSON list of conversations "
                        f"but got invalid JSON ({exc.msg}); fix the syntax.") from exc
        except RecursionError as exc:
            raise _fail(path, "line 1", "expected a JSON list of conversations but it is "
                        "nested too deeply to read; a conversation is a few levels deep."
                        ) from exc
        return list(data)
    if stripped.startswith("{"):
        # One conversation as a whole file (pretty-printed over many lines) is not JSONL.
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            return [whole]
    entries = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise _fail(path, f"line {line_no}", "expected one JSON conversation object a line "
                        f"(JSONL) or a JSON list but got invalid JSON ({exc.msg}); fix the "
                        "line.") from exc
        except RecursionError as exc:
            raise _fail(path, f"line {line_no}", "expected one JSON conversation object a line "
                        "but it is nested too deeply to read; fix the line.") from exc
    return entries


def _text(content: object) -> str | None:
    """A turn's text: a string, or OpenAI content parts whose text parts are joined (an image
    part carries no prompt text); None for anything else."""
    if isinstance(content, str):
        return well_formed(content)
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return well_formed("".join(str(part.get("text") or "") for part in content
                                   if part.get("type", "text") == "text"))
    return None


def _turn(turn: object) -> tuple[str, str] | None:
    """(role, text) of a ShareGPT `{"from", "value"}` or OpenAI `{"role", "content"}` turn."""
    if not isinstance(turn, dict):
        return None
    for role_key, text_key in _TURN_KEYS:
        role, text = turn.get(role_key), _text(turn.get(text_key))
        if isinstance(role, str) and text is not None:
            return role.lower(), text
    return None


def _pairs(path: Path, index: int, entry: Any) -> tuple[str, list[tuple[str, str | None]]]:
    """The entry's id and its (user, reply) pairs; a turn of another role (system) is
    skipped, as is a user message that is blank or has no reply after it, except the last
    turn: an unanswered last message pairs with None (usable with a fixed output length)."""
    if not isinstance(entry, dict):
        raise _fail(path, f"entry {index}", f"expected a JSON object with 'conversations' but "
                    f"got {type(entry).__name__}; each entry is {{\"id\": ..., "
                    f"\"conversations\": [{_SHAPE}, ...]}}.")
    ident = str(entry.get("id", index))
    key = "conversations" if "conversations" in entry or "messages" not in entry \
        else "messages"
    turns = entry.get(key)
    where = f"entry {index} (id {ident!r:.40})"
    if not isinstance(turns, list):
        raise _fail(path, where, f"expected a 'conversations' (or 'messages') list but got "
                    f"{type(turns).__name__ if turns is not None else 'none'}; add "
                    f"\"conversations\": [{_SHAPE}, ...].")
    parsed = []
    for k, turn in enumerate(turns):
        role_text = _turn(turn)
        if role_text is None:
            raise _fail(path, where, f"{key}[{k}] must be {_SHAPE} or {_OPENAI_SHAPE} but got "
                        f"{json.dumps(turn)[:60]}; give each turn a string 'from' and "
                        "'value' (or 'role' and 'content').")
        parsed.append(role_text)
    pairs: list[tuple[str, str | None]] = []
    for (role, user), (nxt, reply) in itertools.pairwise(parsed):
        if role in USER_ROLES and nxt in ASSISTANT_ROLES and user.strip():
            pairs.append((user, reply))
    if parsed and parsed[-1][0] in USER_ROLES and parsed[-1][1].strip():
        pairs.append((parsed[-1][1], None))
    return ident, pairs


@functools.cache
def _read(path: Path, mtime_ns: int, size: int
          ) -> tuple[tuple[str, tuple[tuple[str, str | None], ...]], ...]:
    del mtime_ns, size  # part of the cache key only: an edited file is read again
    return tuple((ident, tuple(pairs)) for index, entry in enumerate(_entries(path))
                 for ident, pairs in [_pairs(path, index, entry)])


def read_conversations(path: Path
                       ) -> tuple[tuple[str, tuple[tuple[str, str | None], ...]], ...]:
    """Every entry's id and (user, reply) pairs (None: a last message left unanswered), in
    file order; raises ValueError naming the
    first entry it refuses (OSError or UnicodeDecodeError where it cannot read the file)."""
    stat = path.stat()
    return _read(path, stat.st_mtime_ns, stat.st_size)


def _is_valid(source: DatasetSource, prompt_len: int, output_len: int) -> bool:
    """vLLM's `is_valid_sequence` (vllm/benchmarks/datasets/datasets.py:339), its bounds
    from `source`; the output's minimum is not checked where the output length is fixed."""
    return not (prompt_len < source.min_len
                or (source.output_len is None and output_len < source.min_len)
                or prompt_len > source.max_prompt_len
                or prompt_len + output_len > source.max_total_len)


def _conversation(source: DatasetSource, tokenizer: PromptTokenizer | None, ident: str,
                  pairs: tuple[tuple[str, str | None], ...], max_turns: int
                  ) -> Conversation | None:
    """The conversation's first `max_turns` turns that fit the bounds; None when not even the
    first does (vLLM's filter). A later turn whose whole context (earlier turns and replies)
    would pass `max_total_len` ends the conversation there."""
    turns: list[Turn] = []
    context = 0
    for user, reply in pairs[:max_turns]:
        if reply is None and source.output_len is None:
            break  # an unanswered message gives no output length to ask for
        if tokenizer is not None:
            user_len = tokenizer.count(user)
            reply_len = len(tokenizer.encode(reply)) if reply is not None else 0
        else:
            user_len = estimate_tokens(user)
            reply_len = estimate_tokens(reply) if reply is not None else 0
        output_len = source.output_len or max(1, reply_len)  # an empty reply: one token
        if not turns:
            if not _is_valid(source, user_len, output_len):
                return None
        elif context + user_len + output_len > source.max_total_len:
            break
        turns.append(Turn(user, user_len, output_len))
        context += user_len + output_len
    return Conversation(ident, tuple(turns), tokenizer is None) if turns else None


def iter_conversations(source: DatasetSource, tokenizer: PromptTokenizer | None, seed: int,
                       max_turns: int = 1) -> Iterator[Conversation]:
    """Usable conversations in a seeded shuffled order, then again from the start (vLLM
    oversamples a short dataset too): the i-th depends on the seed alone, never on how many
    are taken. Token counts are made only for what is taken (a large file stays cheap)."""
    entries = read_conversations(source.path)
    order = np.random.default_rng(seed).permutation(len(entries))
    usable: list[Conversation] = []
    for index in order:
        ident, pairs = entries[int(index)]
        conversation = _conversation(source, tokenizer, ident, pairs, max_turns)
        if conversation is not None:
            usable.append(conversation)
            yield conversation
    if not usable:
        raise ValueError(
            f"{source.path}: no conversation has a user turn and a reply (or, with "
            f"workload.dataset.output_len set, a user turn) within the bounds (prompt "
            f"{source.min_len}..{source.max_prompt_len} tokens, prompt + output <= "
            f"{source.max_total_len}); add conversations or widen workload.dataset's bounds.")
    while True:
        yield from usable


def check_dataset(source: DatasetSource, tokenizer: PromptTokenizer | None) -> int:
    """Read the file as the load generator will and find one usable conversation; the longest
    prompt a request may carry, in tokens (the bound, `max_prompt_len`). Raises ValueError
    naming the first entry it refuses, or saying that none is usable."""
    next(iter_conversations(source, tokenizer, seed=0))
    return source.max_prompt_len
