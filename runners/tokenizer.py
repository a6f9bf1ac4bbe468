"""The model's own tokenizer (its `tokenizer.json`, through the `tokenizers` library): counts the
tokens of text prompts as the server will, and synthesises text of an exact token length.

No chat template is applied: the load generator sends raw text to `/v1/completions`, which
tokenizes the prompt as it is, adding the tokenizer's special tokens (BOS) by default
(vllm/entrypoints/openai/completion/protocol.py:113, `add_special_tokens` defaults to True).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
# As vLLM's `gen_prompt_decode_to_target_len` (vllm/benchmarks/datasets/datasets.py:495):
# decode, re-encode, trim or extend, at most this many times.
_MAX_RETRIES = 10


@dataclass(frozen=True)
class PromptTokenizer:
    """A model's tokenizer, as the load generator uses it."""

    path: Path  # the tokenizer.json it was read from
    tokenizer: Tokenizer
    vocab_size: int  # tokens, added tokens included
    num_special_tokens: int  # tokens the server adds to a single prompt (BOS/EOS), >= 0
    special_ids: frozenset[int]  # never drawn into a synthesised prompt
    note: str | None = None  # a doubt about the counts, for the study's start notes

    def count(self, text: str) -> int:
        """Tokens of `text` as `/v1/completions` counts them: special tokens added."""
        return len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` alone, without the special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    @functools.cached_property
    def _drawable_ids(self) -> list[int]:
        """Ids that decode to text re-encoding to themselves, special tokens left out: a
        byte-level vocabulary's lone continuation bytes decode to U+FFFD, which re-encodes to
        three tokens, and drawn among others they keep a prompt off its target length.
        Computed once, on first use (a 50k vocabulary: well under a second)."""
        ids = [i for i in range(self.vocab_size) if i not in self.special_ids]
        texts = self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        clean = [i for i, enc in zip(ids, encoded, strict=True) if enc.ids == [i]]
        return clean or ids

    def draw_ids(self, rng: np.random.Generator, num: int) -> list[int]:
        """`num` ids drawn uniformly from the vocabulary's tokens that round-trip through
        text (special tokens left out)."""
        pool = self._drawable_ids
        return [pool[i] for i in rng.integers(0, len(pool), size=num).tolist()]

    def synthesise(self, num_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """Text the server counts as `num_tokens` tokens (special tokens included, as vLLM's
        RandomDataset subtracts them: vllm/benchmarks/datasets/utils.py:70), and that count.

        vLLM's way (`gen_prompt_decode_to_target_len`): random ids decoded to text, the text
        re-encoded (a decoded sequence does not always re-encode to as many tokens), then
        trimmed or extended with more random ids until the re-encoded length is the target.
        Where ten rounds do not get there (rare) the count returned is the true count of the
        text, not the target."""
        target = max(1, num_tokens - self.num_special_tokens)
        ids = self.draw_ids(rng, target)
        text = ""
        for attempt in range(_MAX_RETRIES + 1):
            text = self.decode(ids)
            ids = self.encode(text)
            if len(ids) == target or attempt == _MAX_RETRIES:
                break
            if len(ids) < target:
                ids.extend(self.draw_ids(rng, target - len(ids)))
            else:
                ids = ids[:target]
        return text, len(ids) + self.num_special_tokens


def tokenizer_dir_for(model_dir: Path | None, *, skip_tokenizer_init: bool) -> Path | None:
    """The directory whose tokenizer the load generator uses, or None (`why_no_tokenizer`
    says why)."""
    if skip_tokenizer_init or model_dir is None or not (model_dir / TOKENIZER_FILE).is_file():
        return None
    return model_dir


def why_no_tokenizer(model_dir: Path | None, *, skip_tokenizer_init: bool) -> str | None:
    """Why `tokenizer_dir_for` gives None, in a sentence; None where it gives a directory."""
    if skip_tokenizer_init:
        return ("no tokenizer: the engine runs with skip_tokenizer_init, so prompts are token "
                "ids")
    if model_dir is None:
        return ("no tokenizer: the model is not a local directory, so synthesised prompts are "
                "token ids and text prompts' lengths are estimates (UTF-8 bytes / 4)")
    if not (model_dir / TOKENIZER_FILE).is_file():
        return (f"no tokenizer: {model_dir} has no {TOKENIZER_FILE} (a config-only model), so "
                "synthesised prompts are token ids and text prompts' lengths are estimates "
                "(UTF-8 bytes / 4)")
    return None


@functools.cache
def load_tokenizer(model_dir: Path | None) -> PromptTokenizer | None:
    """The tokenizer in `model_dir/tokenizer.json`, read once per process; None where there is
    none (said once in the log). Raises ValueError where the file is there but unreadable."""
    if model_dir is None:
        return None
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        logger.debug("no tokenizer: %s has no %s", model_dir, TOKENIZER_FILE)
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own Exception subclasses
        message = " ".join(str(exc).split())[:200]
        raise ValueError(f"{path}: expected a tokenizers-library tokenizer.json but it could "
                         f"not be read ({message}); re-save it with the model's tokenizer.") \
            from exc
    special = frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items()
                        if tok.special)
    num_special = int(tokenizer.num_special_tokens_to_add(False))
    note = None
    if num_special == 0 and _config_adds_bos(model_dir):
        # transformers may add that BOS itself (vLLM tokenizes through transformers), which
        # tokenizer.json alone does not say: the level's prompt-length gap will show it.
        note = (f"{model_dir}: tokenizer_config.json sets add_bos_token but tokenizer.json "
                "adds no special token; the server may count one token more per prompt than "
                "the load generator (see server.prompt_tokens_server_minus_client_mean)")
    logger.debug("tokenizer: %s (%d tokens); prompt lengths are counted with it", path,
                tokenizer.get_vocab_size())
    return PromptTokenizer(
        path=path, tokenizer=tokenizer,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        num_special_tokens=num_special, note=note,
        special_ids=special)


def _config_adds_bos(model_dir: Path) -> bool:
    import json

    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("add_bos_token") is True
