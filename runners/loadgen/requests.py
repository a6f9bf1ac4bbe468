"""The requests a load level sends: `RequestSpec` and `build_requests` (a dataset's first turns,
a prompts file, a trace's entries or synthesised prompts), deterministic in the study's seed;
`replayed_lengths`, the token lengths a file's requests really ask."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from runners import arrivals, datasets, prefixes
from runners.loadgen.prompts_file import PromptEntry, parse_prompt_line
from runners.tokenizer import PromptTokenizer, load_tokenizer
from runners.workload import LengthDistribution, Workload

logger = logging.getLogger(__name__)

_FIRST_TOKEN_ID = 10  # ids below are special tokens (bos, eos, pad) in most vocabularies


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the same list for every trial of a study (same seed)."""

    prompt: str | list[int]  # text, or token ids (servers started with --skip-tokenizer-init)
    # tokens, as the server counts them (special tokens included) where the model's tokenizer
    # counted it; an estimate (UTF-8 bytes / 4) where `is_prompt_len_estimated`
    prompt_len: int
    output_len: int  # tokens; sent as max_tokens with ignore_eos
    is_prompt_len_estimated: bool = False  # text without a tokenizer to count it


@dataclass(frozen=True)
class LengthRange:
    """Token lengths of a set of requests."""

    min_tokens: int
    max_tokens: int
    mean_tokens: float

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthRange:
        return cls(min(lengths), max(lengths), float(np.mean(lengths)))


@dataclass(frozen=True)
class ReplayedLengths:
    """What the requests of a workload whose prompts come from a file ask, in tokens."""

    source: Literal["trace", "dataset", "prompts_file"]
    num_requests: int  # the requests measured (built), a level's
    input: LengthRange  # prompt tokens, before any shared prefix
    output: LengthRange  # max_tokens (sent with ignore_eos: the tokens produced)


def replayed_lengths(workload: Workload, num: int) -> ReplayedLengths | None:
    """The lengths of the first `num` requests a workload replays from a trace (a trace has no
    more than its entries), a dataset (first turns) or a prompts file, built as the first
    level builds them (runners/levels.py: seed x 1000), before any shared prefix (the
    synthetic workload's `input_len` is the part after it too): there the study file's
    `input_len` and `output_len` are unused, or, for a prompts file's lines without an
    `output_len`, sampled. None for synthesised prompts, whose lengths are the study file's
    distributions. Raises as `build_requests` does (ValueError, OSError, UnicodeDecodeError)."""
    source: Literal["trace", "dataset", "prompts_file"]
    if workload.trace is not None:
        source = "trace"
    elif workload.dataset is not None:
        source = "dataset"
    elif workload.prompts_file is not None:
        source = "prompts_file"
    else:
        return None
    specs = build_requests(replace(workload, shared_prefix=None), num, seed=workload.seed * 1000)
    if not specs:
        return None
    return ReplayedLengths(source, len(specs), LengthRange.of([s.prompt_len for s in specs]),
                           LengthRange.of([s.output_len for s in specs]))


def sample_length(dist: LengthDistribution, rng: np.random.Generator) -> int:
    """One token length from `dist`, clipped to [low, high] and to at least 1.

    "uniform" draws integers in [low, high] (low defaults to 1, high to 2 * mean - low so that
    `mean` is the mean); "lognormal" takes `std` as sigma of the log and keeps `mean` the mean.
    """
    value: float
    if dist.kind == "fixed":
        value = float(dist.mean)
    elif dist.kind == "uniform":
        low = dist.low if dist.low is not None else 1
        high = dist.high if dist.high is not None else 2 * dist.mean - low
        value = float(rng.integers(low, max(low, high) + 1))
    elif dist.kind == "normal":
        value = float(rng.normal(dist.mean, dist.std))
    elif dist.kind == "lognormal":
        # E[X] = exp(mu + sigma^2 / 2): solve for mu so the configured mean is the mean.
        mu = math.log(dist.mean) - dist.std**2 / 2
        value = float(rng.lognormal(mu, dist.std))
    else:
        raise ValueError(
            f"length distribution kind must be fixed, uniform, normal or lognormal "
            f"but got {dist.kind!r}."
        )
    length = max(1, dist.low or 1, round(value))
    if dist.high is not None:
        length = min(length, dist.high)
    return max(1, length)


def _check_distribution(dist: LengthDistribution, name: str) -> None:
    if dist.mean < 1:
        raise ValueError(f"workload.{name}.mean must be >= 1 token but got {dist.mean}.")
    if dist.std < 0 or not math.isfinite(dist.std):
        raise ValueError(f"workload.{name}.std must be finite and >= 0 but got {dist.std}.")
    if dist.low is not None and dist.high is not None and dist.low > dist.high:
        raise ValueError(
            f"workload.{name}: low ({dist.low}) must be <= high ({dist.high}); swap them."
        )


def build_requests(workload: Workload, num: int, seed: int) -> list[RequestSpec]:
    """`num` requests from `workload.dataset` (first turns), `workload.prompts_file` (cycled)
    or synthesised prompts: text of exactly the sampled token length where the model has a
    tokenizer (`workload.tokenizer_dir`), token ids where it has none.

    Deterministic in `seed`, and request i does not depend on `num`: every trial of a study,
    whatever it runs, sees the same prompts.
    """
    if num < 0:
        raise ValueError(f"number of requests must be >= 0 but got {num}.")
    _check_distribution(workload.input_len, "input_len")
    _check_distribution(workload.output_len, "output_len")
    rng = np.random.default_rng(seed)
    tokenizer = load_tokenizer(workload.tokenizer_dir)
    if workload.dataset is not None:
        if tokenizer is None:
            _warn_once(f"{workload.dataset.path}: prompt and output lengths are "
                       f"estimates ({datasets.ESTIMATE}): the model has no "
                       "tokenizer here")
        conversations = datasets.iter_conversations(workload.dataset, tokenizer, seed)
        specs = [RequestSpec(c.turns[0].user, c.turns[0].user_len, c.turns[0].reply_len,
                             is_prompt_len_estimated=c.is_estimated)
                 for c in itertools.islice(conversations, num)]
        _warn_if_cycled(workload.dataset.path, specs)
        return specs
    if workload.prompts_file is not None:
        specs = _requests_from_file(workload.prompts_file, workload.output_len, num, rng,
                                    tokenizer)
        _warn_if_cycled(workload.prompts_file, specs)
        return _with_shared_prefix(specs, workload, tokenizer)
    if tokenizer is None and workload.vocab_size <= _FIRST_TOKEN_ID:
        raise ValueError(
            f"workload.vocab_size must be > {_FIRST_TOKEN_ID} but got {workload.vocab_size}."
        )
    if workload.trace is not None:
        specs = []
        for entry in workload.trace.entries[:num]:  # a trace is replayed once, never cycled
            specs.append(_trace_request(entry, workload, rng, tokenizer))
        return _with_shared_prefix(specs, workload, tokenizer)
    # Lengths and prompts drawn per request (not vectorised) so that request i is the same
    # whether 10 or 10_000 requests are built.
    specs = [synthesise_request(workload, rng, tokenizer) for _ in range(num)]
    return _with_shared_prefix(specs, workload, tokenizer)


def _trace_request(entry: arrivals.TraceEntry, workload: Workload, rng: np.random.Generator,
                   tokenizer: PromptTokenizer | None) -> RequestSpec:
    """A trace entry's request: its own prompt where it has one, else a synthesised prompt of
    its recorded length (text through the tokenizer, or token ids)."""
    # Ids drawn for every entry, used or not: entry i's prompt does not depend on its
    # neighbours carrying their own.
    ids: list[int] = rng.integers(_FIRST_TOKEN_ID, max(workload.vocab_size, _FIRST_TOKEN_ID + 1),
                                  size=entry.input_len).tolist()
    if entry.prompt is not None:
        prompt = entry.prompt if isinstance(entry.prompt, list) else \
            datasets.well_formed(entry.prompt)
        if isinstance(prompt, list):
            return RequestSpec(prompt, len(prompt), entry.output_len)
        if tokenizer is not None:
            return RequestSpec(prompt, tokenizer.count(prompt), entry.output_len)
        # The trace's recorded input_length, which nothing here can check: not a count.
        return RequestSpec(prompt, entry.input_len, entry.output_len,
                           is_prompt_len_estimated=True)
    if tokenizer is not None:
        text, prompt_len = tokenizer.synthesise(entry.input_len, rng)
        return RequestSpec(text, prompt_len, entry.output_len)
    return RequestSpec(ids, entry.input_len, entry.output_len)


def synthesise_request(workload: Workload, rng: np.random.Generator,
                       tokenizer: PromptTokenizer | None) -> RequestSpec:
    """One synthesised request, its lengths drawn from the workload's distributions: text the
    tokenizer counts as exactly the drawn length (vLLM's RandomDataset way, see
    `PromptTokenizer.synthesise`), or, without a tokenizer, that many random token ids."""
    input_len = sample_length(workload.input_len, rng)
    output_len = sample_length(workload.output_len, rng)
    if tokenizer is not None:
        text, prompt_len = tokenizer.synthesise(input_len, rng)
        return RequestSpec(prompt=text, prompt_len=prompt_len, output_len=output_len)
    ids = rng.integers(_FIRST_TOKEN_ID, workload.vocab_size, size=input_len).tolist()
    return RequestSpec(prompt=ids, prompt_len=input_len, output_len=output_len)


def token_id_maker(vocab_size: int) -> prefixes.MakeTokens[list[int]]:
    """"N tokens of prompt" as token ids drawn uniformly from the vocabulary (above the special
    ids): the prefix maker for servers started without a tokenizer (dummy weights)."""
    def make(num_tokens: int, rng: np.random.Generator) -> list[int]:
        ids: list[int] = rng.integers(_FIRST_TOKEN_ID, vocab_size, size=num_tokens).tolist()
        return ids
    return make


def text_maker(tokenizer: PromptTokenizer) -> prefixes.MakeTokens[str]:
    """"N tokens of prompt" as text the tokenizer counts as N tokens (BOS included), ending in
    a newline so that the prompt after it starts a new line."""
    def make(num_tokens: int, rng: np.random.Generator) -> str:
        return tokenizer.synthesise(num_tokens, rng)[0] + "\n"
    return make


def _with_shared_prefix(specs: list[RequestSpec], workload: Workload,
                        tokenizer: PromptTokenizer | None) -> list[RequestSpec]:
    """`specs` with `workload.shared_prefix` applied: the prompts so far are the parts after
    the prefix. Token-id prompts get token-id prefixes (lengths add exactly); text prompts get
    text prefixes and the joined prompt is counted again with the tokenizer (a BOS and the
    merge at the seam make the lengths not add)."""
    shared = workload.shared_prefix
    if shared is None or not specs:
        return specs
    prompts = [s.prompt for s in specs]
    # The prefixes depend on the study's seed only (not the level's): levels and trials share
    # the same system prompts.
    if all(isinstance(p, list) for p in prompts):
        ids = [p for p in prompts if isinstance(p, list)]
        joined_ids = prefixes.apply_shared_prefix(ids, shared, workload.seed,
                                                  token_id_maker(workload.vocab_size))
        return [replace(spec, prompt=prompt,
                        prompt_len=spec.prompt_len + (shared.num_tokens if index is not None
                                                      else 0))
                for spec, (prompt, index) in zip(specs, joined_ids, strict=True)]
    if tokenizer is None or not all(isinstance(p, str) for p in prompts):
        raise ValueError("workload.shared_prefix needs prompts all of one kind, token ids or "
                         "text counted with the model's tokenizer; leave shared_prefix out.")
    texts = [p for p in prompts if isinstance(p, str)]
    joined_texts = prefixes.apply_shared_prefix(texts, shared, workload.seed,
                                                text_maker(tokenizer))
    return [replace(spec, prompt=prompt,
                    prompt_len=tokenizer.count(prompt) if index is not None else spec.prompt_len)
            for spec, (prompt, index) in zip(specs, joined_texts, strict=True)]


def _requests_from_file(
    path: Path, output_dist: LengthDistribution, num: int, rng: np.random.Generator,
    tokenizer: PromptTokenizer | None = None,
) -> list[RequestSpec]:
    entries: list[PromptEntry] = []
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is no JSON
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                entries.append(parse_prompt_line(path, line_no, line, tokenizer))
    if not entries:
        raise ValueError(f"{path}: expected JSONL lines with a 'prompt' but the file is empty.")
    if tokenizer is None and any(entry[3] for entry in entries):
        _warn_once(f"{path}: text prompts' lengths are estimates ({datasets.ESTIMATE}): "
                   "the model has no tokenizer here")
    specs = []
    for i in range(num):
        prompt, prompt_len, output_len, is_estimated = entries[i % len(entries)]
        # Sampled for every request, used or not, so the stream of draws is the same per index.
        sampled = sample_length(output_dist, rng)
        specs.append(RequestSpec(prompt, prompt_len, output_len or sampled,
                                 is_prompt_len_estimated=is_estimated))
    return specs


def _warn_if_cycled(source: Path, specs: Sequence[RequestSpec]) -> None:
    """Say once where a file's prompts repeat within a level: vLLM oversamples a short dataset
    too, but a repeated prompt is served from the prefix cache and its TTFT flatters the
    engine (the level's prefix_cache.hit_rate shows how much)."""
    distinct = len({p if isinstance(p, str) else tuple(p) for p in (s.prompt for s in specs)})
    if distinct < len(specs):
        _warn_once(f"{source}: {len(specs)} requests from {distinct} distinct prompts, cycled; "
                   "a repeat is served from the prefix cache, which shortens its TTFT: add "
                   "prompts or send fewer requests")


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("%s", message)
