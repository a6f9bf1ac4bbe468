"""OpenAI-compatible load generator: builds a workload's requests, drives one load level over
streaming `/v1/completions`, and computes the figures `vllm bench serve` reports, the same way.

Definitions follow vLLM's `vllm/benchmarks/serve.py` (`get_request`, `calculate_metrics`) and
`vllm/benchmarks/lib/endpoint_request_func.py` (`async_request_openai_completions`), so a number
measured here means what the same number means in a `vllm bench serve` result file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
import numpy as np

from runners import arrivals, datasets, prefixes
from runners.base import BenchmarkMetrics
from runners.credentials import auth_headers
from runners.tokenizer import PromptTokenizer, load_tokenizer
from runners.workload import SLO, LengthDistribution, LoadLevel, Workload

logger = logging.getLogger(__name__)

STALLED_ERROR: Final = "stalled"
STOPPED_ERROR: Final = "stopped"

_FIRST_TOKEN_ID = 10  # ids below are special tokens (bos, eos, pad) in most vocabularies
_CONNECT_TIMEOUT_S = 10.0
_ERROR_EXCERPT_CHARS = 300
_WATCH_INTERVAL_S = 0.05  # how often the watchdog looks at stop_event and the stall clock
_MS_PER_S = 1000.0
# A simulated engine answers with this header set to "modelled" and puts its modelled clock's
# times in every chunk: the request's arrival and the token's time, in seconds. Only then are
# a request's figures read from those times (a real vLLM server never sends the header, so its
# figures are always the client's own clock); the level's result says which it was.
MODELLED_CLOCK_HEADER: Final = "x-simulated-clock"
MODELLED_ARRIVAL_FIELD: Final = "simulated_arrival_s"
MODELLED_TIME_FIELD: Final = "simulated_time_s"
# On an error answer of such a server: the modelled time it refused the request at, seconds.
MODELLED_TIME_HEADER: Final = "x-simulated-time"
# Sent only to a server that declared a modelled clock before: "this request's client sends the
# next one as soon as it ends" (a closed loop with requests left), so the server can stamp that
# next arrival at this one's modelled end instead of after the host's scheduling delay.
MODELLED_REFILL_HEADER: Final = "x-simulated-refill"
# With it, how many requests the level still sends after this one: a refill is awaited only
# while some remain (a failed request frees its slot early, so a promise can outlive its level).
MODELLED_REMAINING_HEADER: Final = "x-simulated-remaining"
# Likewise "this request is one of N the client sends at once" (a closed-loop level's first N).
MODELLED_BURST_HEADER: Final = "x-simulated-burst"
_modelled_servers: set[str] = set()  # base URLs whose last answer declared a modelled clock


class StopFlag(Protocol):
    """`asyncio.Event` or `threading.Event`: anything that can say it was set."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the same list for every trial of a study (same seed)."""

    prompt: str | list[int]  # text, or token ids (servers started with --skip-tokenizer-init)
    # tokens, as the server counts them (special tokens included) where the model's tokenizer
    # counted it; a chars/4 estimate where `is_prompt_len_estimated`
    prompt_len: int
    output_len: int  # tokens; sent as max_tokens with ignore_eos
    is_prompt_len_estimated: bool = False  # text without a tokenizer to count it


@dataclass(frozen=True)
class RequestOutput:
    """What one request measured, as vLLM's `RequestFuncOutput` (times from the client's view)."""

    success: bool
    error: str = ""  # one line on why it failed; empty on success
    ttft_s: float = 0.0  # seconds, send to first chunk carrying choices
    itl_s: tuple[float, ...] = ()  # seconds between consecutive chunks carrying choices
    latency_s: float = 0.0  # seconds, send to the last chunk carrying choices (e2el)
    prompt_len: int = 0  # tokens; the server's usage.prompt_tokens when it sent one
    client_prompt_len: int = 0  # tokens, the load generator's own count (or estimate)
    server_prompt_len: int | None = None  # tokens, usage.prompt_tokens; None: not sent
    generated_text: str = ""  # the reply's text, kept only where asked (multi-turn)
    # tokens; usage.completion_tokens, else max_tokens where the reply ended for its length,
    # else the number of chunks
    output_tokens: int = 0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    # Set only for a server that declared a modelled clock (MODELLED_CLOCK_HEADER): the
    # request's modelled arrival and last token, and then every time above is modelled too.
    modelled_span_s: tuple[float, float] | None = None


@dataclass(frozen=True)
class LevelResult:
    """One load level: its figures and every request's output, in issue order."""

    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    stalled: bool = False  # no chunk from any in-flight request for stall_timeout_s: a hang
    stopped: bool = False  # stop_event ended the level early; not a measurement
    # The server declared a modelled clock (the simulated engine) and the figures, duration
    # included, are on it: a model's times, never a measurement.
    is_modelled_clock: bool = False


# ---------------------------------------------------------------------------------------------
# Requests


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
                       f"estimates (chars / {datasets.CHARS_PER_TOKEN}): the model has no "
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
        entries = arrivals.read_trace(workload.trace.path, workload.trace.timestamp_unit_s,
                                      workload.trace.max_gap_s)
        specs = []
        for entry in entries[:num]:  # a trace is replayed once, never cycled
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


_PromptEntry = tuple[str | list[int], int, int | None, bool]


def _requests_from_file(
    path: Path, output_dist: LengthDistribution, num: int, rng: np.random.Generator,
    tokenizer: PromptTokenizer | None = None,
) -> list[RequestSpec]:
    entries: list[_PromptEntry] = []
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is no JSON
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                entries.append(_parse_prompt_line(path, line_no, line, tokenizer))
    if not entries:
        raise ValueError(f"{path}: expected JSONL lines with a 'prompt' but the file is empty.")
    if tokenizer is None and any(entry[3] for entry in entries):
        _warn_once(f"{path}: text prompts' lengths are estimates (chars / "
                   f"{datasets.CHARS_PER_TOKEN}): the model has no tokenizer here")
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
                prompt, prompt_len, output_len, _ = _parse_prompt_line(path, line_no, line,
                                                                       tokenizer)
                problem = vocabulary_problem(prompt, vocab_size)
                if problem is not None:
                    raise ValueError(f"{path}:{line_no}: {problem}.")
                longest = max(longest, prompt_len)
                longest_output = max(longest_output, output_len or default_output_len)
    if longest == 0:
        raise ValueError(f"{path}: expected JSONL lines with a 'prompt' but the file is empty.")
    return longest, longest_output


def _parse_prompt_line(path: Path, line_no: int, line: str,
                       tokenizer: PromptTokenizer | None = None) -> _PromptEntry:
    """(prompt, its length in tokens, output_len or None, whether the length is an estimate).
    A text prompt is counted with the tokenizer; without one a `prompt_len` the line gives
    is taken, else chars / 4 is estimated."""
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


def prompt_len_gap(outputs: Sequence[RequestOutput]) -> dict[str, float]:
    """How far the load generator's prompt lengths are from the server's usage.prompt_tokens,
    over the successful requests where the server sent one: the mean of (server - client) and
    the largest gap, in tokens. Counted with the model's tokenizer they agree (special tokens
    included); a chars/4 estimate shows its error here. Empty where the server sent none."""
    gaps = [o.server_prompt_len - o.client_prompt_len for o in outputs
            if o.success and o.server_prompt_len is not None]
    if not gaps:
        return {}
    return {"prompt_tokens_server_minus_client_mean": float(np.mean(gaps)),
            "prompt_tokens_server_minus_client_max_abs": float(max(abs(g) for g in gaps))}


# Arrivals live in runners/arrivals.py (gamma gaps as `vllm bench serve --burstiness`, trace
# replay); the names stay importable from here.
arrival_offsets_s = arrivals.arrival_offsets_s
_open_ended_offsets_s = arrivals.open_ended_offsets_s


# ---------------------------------------------------------------------------------------------
# One request


def _failed(spec: RequestSpec, start: float, error: str) -> RequestOutput:
    return RequestOutput(success=False, error=error, prompt_len=spec.prompt_len,
                         client_prompt_len=spec.prompt_len, start_time=start)


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    spec: RequestSpec,
    timeout_s: float,
    *,
    on_chunk: Callable[[], None] | None = None,
    is_refilled: bool = False,
    burst_size: int = 0,
    num_remaining: int | None = None,
    keep_text: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestOutput:
    """POST one streaming completion and time it; never raises (failures come back as
    `success=False`, as vLLM's request functions do).

    `on_chunk`, a no-argument callable, is called on every SSE data line: the level's stall
    watchdog uses it as a heartbeat. `keep_text` keeps the reply's text (a conversation's next
    turn carries it). `clock` (seconds) is read once as the request is sent and once as each
    SSE data line arrives; tests pass a scripted one.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    headers: dict[str, str] | None = None
    if base_url in _modelled_servers:  # never sent to a server that did not declare its clock
        headers = {MODELLED_REFILL_HEADER: "1"} if is_refilled else {}
        if num_remaining is not None:
            headers[MODELLED_REMAINING_HEADER] = str(num_remaining)
        if burst_size > 1:
            headers[MODELLED_BURST_HEADER] = str(burst_size)
    payload: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    start = clock()
    ttft: float | None = None
    most_recent = start
    itls: list[float] = []
    num_chunks = 0
    finish_reason: str | None = None  # the last choice's: set on a reply's final chunk
    is_done = False  # the stream's `data: [DONE]`
    usage_output_tokens = 0
    server_prompt_len: int | None = None
    texts: list[str] = []
    modelled: list[float] = []  # arrival, then each token's time, on a modelled clock
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=payload,
                                                         headers=headers) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                excerpt = body[:_ERROR_EXCERPT_CHARS].decode("utf-8", "replace")
                excerpt = " ".join(excerpt.split())
                failed = _failed(spec, start, f"HTTP {resp.status_code}: {excerpt}")
                stamp = resp.headers.get(MODELLED_TIME_HEADER)
                if resp.headers.get(MODELLED_CLOCK_HEADER) == "modelled" and stamp:
                    failed = replace(failed, modelled_span_s=(float(stamp), float(stamp)))
                return failed
            is_modelled = resp.headers.get(MODELLED_CLOCK_HEADER) == "modelled"
            if is_modelled:
                _modelled_servers.add(base_url)
            else:
                _modelled_servers.discard(base_url)
            async for line in resp.aiter_lines():
                # Comments (":" pings) and event/id fields carry no tokens.
                if not line.startswith("data:"):
                    continue
                data_str = line[len("data:"):].strip()
                if data_str == "[DONE]":
                    is_done = True
                    break
                timestamp = clock()
                if on_chunk is not None:
                    on_chunk()
                data = json.loads(data_str)
                if not isinstance(data, dict):
                    return _failed(spec, start, f"SSE data is not a JSON object: {data_str:.80}")
                if "error" in data or data.get("object") == "error":
                    # vLLM reports an engine failure mid-stream as a data line, status 200.
                    detail = data.get("error", data.get("message", data))
                    return _failed(spec, start, f"error in stream: {detail!s:.200}")
                # Any chunk with choices counts as a token (its text may be empty for special
                # tokens), as in vLLM; the usage chunk at the end has choices [].
                if data.get("choices"):
                    if is_modelled:
                        if not modelled:
                            modelled.append(float(data[MODELLED_ARRIVAL_FIELD]))
                        modelled.append(float(data[MODELLED_TIME_FIELD]))
                    if ttft is None:
                        ttft = timestamp - start
                    else:
                        itls.append(timestamp - most_recent)
                    most_recent = timestamp
                    num_chunks += 1
                    finish_reason = data["choices"][0].get("finish_reason") or finish_reason
                    if keep_text:
                        texts.append(str(data["choices"][0].get("text") or ""))
                usage = data.get("usage")
                if isinstance(usage, dict):
                    usage_output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        server_prompt_len = int(usage["prompt_tokens"])
    except TimeoutError:
        return _failed(spec, start, f"no complete response within {timeout_s:g} s")
    except Exception as exc:  # the contract is to never raise: any failure is this request's
        return _failed(spec, start, f"{type(exc).__name__}: {exc}")
    if ttft is None:
        return _failed(spec, start, "stream ended without a chunk carrying a token")
    if not is_done and finish_reason is None:
        # vLLM counts such a reply a success; it is a reply cut off (a proxy or server that
        # dropped the stream), and its short latency would flatter every figure.
        return _failed(spec, start, f"stream ended after {num_chunks} chunk(s) without a "
                                    "finish_reason or [DONE]: the reply was cut off")
    # A chunk may carry several tokens: usage.completion_tokens counts them; without it a
    # reply that ended for its length (ignore_eos) has exactly max_tokens; else one a chunk.
    output_tokens = usage_output_tokens or (
        spec.output_len if finish_reason == "length" else num_chunks)
    # The server's count stands in the figures (as in vLLM's); the client's is kept beside it
    # so that the two can be compared (`prompt_len_gap`), neither trusted silently.
    prompt_len = server_prompt_len if server_prompt_len is not None else spec.prompt_len
    text = "".join(texts)
    if modelled:
        # The server's modelled clock: the same definitions, on times a busy host can't stretch.
        arrival, first, last = modelled[0], modelled[1], modelled[-1]
        return RequestOutput(
            success=True, ttft_s=first - arrival,
            itl_s=tuple(b - a for a, b in itertools.pairwise(modelled[1:])),
            latency_s=last - arrival, prompt_len=prompt_len, output_tokens=output_tokens,
            start_time=start, modelled_span_s=(arrival, last),
            client_prompt_len=spec.prompt_len, server_prompt_len=server_prompt_len,
            generated_text=text)
    return RequestOutput(
        success=True,
        ttft_s=ttft,
        itl_s=tuple(itls),
        latency_s=most_recent - start,
        prompt_len=prompt_len,
        output_tokens=output_tokens,
        start_time=start,
        client_prompt_len=spec.prompt_len,
        server_prompt_len=server_prompt_len,
        generated_text=text,
    )


# ---------------------------------------------------------------------------------------------
# One load level


class _LevelDriver:
    """State of one running level: the issuer, the request tasks and the watchdog share it."""

    def __init__(
        self,
        base_url: str,
        model: str,
        requests: Sequence[RequestSpec],
        level: LoadLevel,
        *,
        timeout_s: float,
        seed: int,
        duration_s: float | None,
        stop_event: StopFlag | None,
        stall_timeout_s: float | None,
        max_duration_s: float | None = None,
        burstiness: float = 1.0,
        send_offsets_s: Sequence[float] | None = None,
    ) -> None:
        self.base_url = base_url
        self.burstiness = burstiness
        self.send_offsets_s = send_offsets_s
        self.model = model
        self.requests = requests
        self.level = level
        self.timeout_s = timeout_s
        self.seed = seed
        self.duration_s = duration_s
        self.max_duration_s = max_duration_s
        self.stop_event = stop_event
        self.stall_timeout_s = stall_timeout_s
        cap = level.max_concurrency
        self.semaphore = asyncio.Semaphore(cap) if cap is not None else None
        self.tasks: list[tuple[asyncio.Task[RequestOutput], RequestSpec, float]] = []
        self.issuer: asyncio.Task[None] | None = None
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.last_progress = time.perf_counter()
        self.abort_reason: str | None = None
        self.slowest_latency_s: float | None = None  # wall, of the requests ended so far
        self.first_offset_s = 0.0  # s from the level's start to the first send, as scheduled

    def _heartbeat(self) -> None:
        self.last_progress = time.perf_counter()

    async def run(self, client: httpx.AsyncClient) -> tuple[list[RequestOutput], float]:
        start = time.perf_counter()
        self.issuer = asyncio.create_task(self._issue(client, start))
        watchdog = asyncio.create_task(self._watch())
        try:
            await asyncio.gather(self.issuer, return_exceptions=True)
            if not self.issuer.cancelled() and self.issuer.exception() is not None:
                self._abort(STOPPED_ERROR)  # a bug of ours: leave nothing running, then raise
                await asyncio.gather(*(t for t, _, _ in self.tasks), return_exceptions=True)
                self.issuer.result()
            # The issuer is done, so the list is final (cancelled tasks count as done).
            await asyncio.gather(*(task for task, _, _ in self.tasks), return_exceptions=True)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        duration = time.perf_counter() - start
        return [self._output_of(task, spec, t) for task, spec, t in self.tasks], duration

    def _output_of(self, task: asyncio.Task[RequestOutput], spec: RequestSpec,
                   issued_at: float) -> RequestOutput:
        if task.cancelled():
            return _failed(spec, issued_at, self.abort_reason or STOPPED_ERROR)
        exc = task.exception()
        if exc is not None:  # send_request never raises; this is a bug of ours, kept visible
            logger.error("request task raised %r", exc)
            return _failed(spec, issued_at, f"{type(exc).__name__}: {exc}")
        return task.result()

    def _is_past_duration(self, start: float) -> bool:
        limit = self.duration_s if self.duration_s is not None else self.max_duration_s
        return limit is not None and time.perf_counter() - start >= limit

    async def _issue(self, client: httpx.AsyncClient, start: float) -> None:
        rate = self.level.request_rate_rps
        specs: Iterator[RequestSpec]
        offsets: Iterator[float]
        if self.send_offsets_s is not None:  # a trace replay: its times, its requests once
            specs = iter(self.requests)
            offsets = iter(self.send_offsets_s)
        elif self.duration_s is None:
            specs = iter(self.requests)
            offsets = iter(arrival_offsets_s(len(self.requests), rate, self.seed,
                                             self.burstiness))
        else:
            specs = itertools.cycle(self.requests)
            offsets = _open_ended_offsets_s(rate, self.seed, self.burstiness)
        for spec, offset in zip(specs, offsets, strict=False):
            limit = self.duration_s if self.duration_s is not None else self.max_duration_s
            if limit is not None and offset >= limit:
                return
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Acquire here, not in the task, so a concurrency-bound level never piles up
            # waiting tasks; order and timing match vLLM's FIFO semaphore inside the task.
            if self.semaphore is not None:
                await self.semaphore.acquire()
            if self._is_past_duration(start) or self._is_stop_requested():
                if self.semaphore is not None:
                    self.semaphore.release()
                return
            is_refilled = self._is_refilled(start)
            burst = 0
            if rate is None and self.level.max_concurrency is not None \
                    and len(self.tasks) < self.level.max_concurrency:
                burst = min(self.level.max_concurrency, len(self.requests))
            closed = rate is None and self.level.max_concurrency is not None \
                and self.duration_s is None
            task = asyncio.create_task(self._one(
                client, spec, is_refilled, burst,
                len(self.requests) - len(self.tasks) - 1 if closed else None))
            if not self.tasks:
                self.first_offset_s = offset
            self.tasks.append((task, spec, time.perf_counter()))

    def _is_refilled(self, start: float) -> bool:
        """Whether the request about to be sent will be followed at once, in its slot, by
        another: a closed loop over a fixed list with a slot's worth of requests left, and, on a
        time-bound level, ending (by the slowest latency seen so far, x1.5) before the limit."""
        cap = self.level.max_concurrency
        if self.level.request_rate_rps is not None or cap is None or self.duration_s is not None:
            return False
        if len(self.tasks) + cap >= len(self.requests):
            return False
        if self.max_duration_s is None:
            return True
        if self.slowest_latency_s is None:
            return False
        ends_s = time.perf_counter() - start + 1.5 * self.slowest_latency_s
        return ends_s < self.max_duration_s

    async def _one(self, client: httpx.AsyncClient, spec: RequestSpec,
                   is_refilled: bool = False, burst_size: int = 0,
                   num_remaining: int | None = None) -> RequestOutput:
        if self.num_in_flight == 0:
            self._heartbeat()  # the stall clock runs only while something is in flight
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        sent = time.perf_counter()
        try:
            return await send_request(client, self.base_url, self.model, spec, self.timeout_s,
                                      on_chunk=self._heartbeat, is_refilled=is_refilled,
                                      burst_size=burst_size, num_remaining=num_remaining)
        finally:
            self.slowest_latency_s = max(self.slowest_latency_s or 0.0,
                                         time.perf_counter() - sent)
            self.num_in_flight -= 1
            self._heartbeat()
            if self.semaphore is not None:
                self.semaphore.release()

    def _is_stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._is_stop_requested():
                self._abort(STOPPED_ERROR)
                return
            if (self.stall_timeout_s is not None and self.num_in_flight > 0
                    and time.perf_counter() - self.last_progress > self.stall_timeout_s):
                logger.warning(
                    "no chunk from any of %d in-flight requests for %.1f s at %s: "
                    "cancelling them as stalled",
                    self.num_in_flight, self.stall_timeout_s, self.level.label,
                )
                self._abort(STALLED_ERROR)
                return

    def _abort(self, reason: str) -> None:
        self.abort_reason = reason
        if self.issuer is not None:
            self.issuer.cancel()
        for task, _, _ in self.tasks:
            task.cancel()


def _check_level_args(requests: Sequence[RequestSpec], level: LoadLevel, timeout_s: float,
                      duration_s: float | None, stall_timeout_s: float | None) -> None:
    if not requests:
        raise ValueError("run_level needs at least one request but got none.")
    rate = level.request_rate_rps
    if rate is not None and not rate > 0:
        raise ValueError(f"request_rate_rps must be > 0 (None = all at once) but got {rate}.")
    if level.max_concurrency is not None and level.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 but got {level.max_concurrency}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 but got {timeout_s}.")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 but got {stall_timeout_s}.")
    if duration_s is not None:
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0 but got {duration_s}.")
        if (rate is None or math.isinf(rate)) and level.max_concurrency is None:
            raise ValueError(
                "a duration-bound level needs a request rate or a max concurrency, "
                "but got neither; set one of them."
            )


async def run_level(
    base_url: str,
    model: str,
    requests: Sequence[RequestSpec],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    seed: int,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_duration_s: float | None = None,
    burstiness: float | None = None,
    send_offsets_s: Sequence[float] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """Drive one load level against an OpenAI-compatible server and measure it.

    Requests arrive at `level.request_rate_rps` (all at once when None), with gamma gaps of
    shape `burstiness` (default: the level's, else 1 = Poisson; runners/arrivals.py), at most
    `level.max_concurrency` in flight. `send_offsets_s` (a trace replay) gives each request's
    send time instead, in seconds from the level's start, one per request, non-decreasing.
    Without `duration_s` each request is sent once; with it, requests cycle and no new one is
    sent after `duration_s` (those in flight finish).
    `max_duration_s` bounds a request-bound level by time too: each request is sent at most
    once, and none after `max_duration_s` (a light capacity probe must not take minutes).
    `stop_event` (checked every 50 ms) or a stall (no chunk from any in-flight request for
    `stall_timeout_s`) cancels the requests in flight; they come back failed, with the error
    "stopped" or "stalled", and the result says which. `api_key` is the engine's (sent as a
    bearer token). Raises only ValueError, for bad arguments.
    """
    _check_level_args(requests, level, timeout_s, duration_s, stall_timeout_s)
    if max_duration_s is not None and not max_duration_s > 0:
        raise ValueError(f"max_duration_s must be > 0 but got {max_duration_s}.")
    if burstiness is None:
        burstiness = level.burstiness if level.burstiness is not None else 1.0
    arrivals.check_burstiness(burstiness)
    if send_offsets_s is not None:
        if duration_s is not None:
            raise ValueError("a trace replay sends each request once; bound it with "
                             "max_duration_s, not duration_s.")
        if len(send_offsets_s) != len(requests) or any(
                not math.isfinite(t) or t < 0 for t in send_offsets_s) or any(
                b < a for a, b in itertools.pairwise(send_offsets_s)):
            raise ValueError(f"send_offsets_s must hold {len(requests)} finite, non-negative, "
                             "non-decreasing times, one per request.")
    cap = level.max_concurrency
    # httpx defaults (100 connections, 5 s timeouts) would queue requests in the client and
    # cut long streams: size the pool to the load and leave reads unbounded; the per-request
    # timeout and the stall watchdog bound them instead.
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
    driver = _LevelDriver(base_url, model, requests, level, timeout_s=timeout_s, seed=seed,
                          duration_s=duration_s, stop_event=stop_event,
                          stall_timeout_s=stall_timeout_s, max_duration_s=max_duration_s,
                          burstiness=burstiness, send_offsets_s=send_offsets_s)
    # trust_env=False: an http_proxy from the environment must not capture 127.0.0.1.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                 headers=auth_headers(api_key)) as client:
        outputs, duration = await driver.run(client)
    modelled_s = modelled_duration_s(outputs)
    is_modelled = modelled_s is not None
    if modelled_s is not None:
        # vLLM's duration starts before the first arrival's gap, as the wall clock's does here:
        # a rate level of n requests lasts at least n / rate on either clock.
        duration = driver.first_offset_s + modelled_s
    metrics = compute_metrics(outputs, duration, slo, max_concurrency_seen=driver.max_in_flight)
    logger.info(
        "level %s: %d completed, %d failed in %.1f s%s, %.2f req/s, %.1f output tok/s%s",
        level.label, metrics.completed, metrics.failed, duration,
        " (the server's modelled clock)" if is_modelled else "", metrics.request_throughput,
        metrics.output_throughput,
        f" ({driver.abort_reason})" if driver.abort_reason else "",
    )
    return LevelResult(
        metrics=metrics,
        outputs=outputs,
        stalled=driver.abort_reason == STALLED_ERROR,
        stopped=driver.abort_reason == STOPPED_ERROR,
        is_modelled_clock=is_modelled,
    )


def modelled_duration_s(outputs: Sequence[RequestOutput]) -> float | None:
    """A level's duration on a server's modelled clock: its first request's arrival to its last
    token or refusal, over every request stamped on that clock (an error answer is, so a level
    whose first or last requests failed is not shorter than the load it offered); None unless
    every success came with the modelled times."""
    successes = [o.modelled_span_s for o in outputs if o.success]
    if not successes or any(span is None for span in successes):
        return None
    spans = [o.modelled_span_s for o in outputs if o.modelled_span_s is not None]
    first = min(start for start, _ in spans)
    last = max(end for _, end in spans)
    return max(last - first, 1e-9)


def run_level_sync(
    base_url: str,
    model: str,
    requests: Sequence[RequestSpec],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    seed: int,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_duration_s: float | None = None,
    burstiness: float | None = None,
    send_offsets_s: Sequence[float] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """`run_level` on a fresh event loop, for callers that are threads (runners, Ray actors).
    Pass a `threading.Event` as `stop_event` to stop it from another thread."""
    return asyncio.run(run_level(
        base_url, model, requests, level, slo, timeout_s=timeout_s, seed=seed,
        stop_event=stop_event, stall_timeout_s=stall_timeout_s, duration_s=duration_s,
        max_duration_s=max_duration_s, burstiness=burstiness, send_offsets_s=send_offsets_s,
        api_key=api_key,
    ))


# ---------------------------------------------------------------------------------------------
# Metrics


def _stats_ms(values_s: list[float]
              ) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """mean, median, std, p90, p99 in ms (numpy's linear percentiles, as vLLM's); all None for
    no sample, where vLLM's `values or 0` writes 0 ms: an undefined figure is not a fast one."""
    if not values_s:
        return None, None, None, None, None
    return (
        float(np.mean(values_s)) * _MS_PER_S,
        float(np.median(values_s)) * _MS_PER_S,
        float(np.std(values_s)) * _MS_PER_S,
        float(np.percentile(values_s, 90)) * _MS_PER_S,
        float(np.percentile(values_s, 99)) * _MS_PER_S,
    )


def _has_slo(slo: SLO) -> bool:
    return any(v is not None for v in (slo.ttft_p99_ms, slo.tpot_p99_ms, slo.e2el_ms))


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    slo: SLO,
    *,
    max_concurrency_seen: int = 0,
) -> BenchmarkMetrics:
    """The figures of one level, as vLLM's `calculate_metrics` computes them.

    Only successful requests count. TPOT per request is (latency - ttft) / (output_tokens - 1)
    when output_tokens > 1; a request meets the SLO when each set bound holds for it (its TPOT
    taken as 0 with a single token, as vLLM does). Goodput is None without an SLO. Unlike
    vLLM, a statistic with no sample (TPOT when every request produced one token) is None,
    not 0.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 but got {duration_s}.")
    completed = 0
    total_input = 0
    total_output = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for out in outputs:
        if not out.success:
            continue
        # vLLM without a tokenizer counts a success that reported no tokens as one token.
        output_len = out.output_tokens or 1
        total_output += output_len
        total_input += out.prompt_len
        tpot = 0.0
        if output_len > 1:
            tpot = (out.latency_s - out.ttft_s) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(out.itl_s)
        ttfts.append(out.ttft_s)
        e2els.append(out.latency_s)
        completed += 1

    goodput: float | None = None
    if _has_slo(slo):
        bounds: list[tuple[list[float], float]] = [
            (values, bound_ms / _MS_PER_S)
            for values, bound_ms in ((ttfts, slo.ttft_p99_ms), (all_tpots, slo.tpot_p99_ms),
                                     (e2els, slo.e2el_ms))
            if bound_ms is not None
        ]
        num_good = sum(
            all(bound_s >= values[i] for values, bound_s in bounds) for i in range(completed)
        )
        goodput = num_good / duration_s

    if outputs and completed == 0:
        first_error = next((o.error for o in outputs if o.error), "")
        logger.warning("all %d requests failed; first error: %s", len(outputs), first_error)

    ttft = _stats_ms(ttfts)
    tpot_ms = _stats_ms(tpots)
    itl = _stats_ms(itls)
    e2el = _stats_ms(e2els)
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=completed / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], std_ttft_ms=ttft[2],
        p90_ttft_ms=ttft[3], p99_ttft_ms=ttft[4],
        mean_tpot_ms=tpot_ms[0], median_tpot_ms=tpot_ms[1], std_tpot_ms=tpot_ms[2],
        p90_tpot_ms=tpot_ms[3], p99_tpot_ms=tpot_ms[4],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], std_itl_ms=itl[2],
        p90_itl_ms=itl[3], p99_itl_ms=itl[4],
        mean_e2el_ms=e2el[0], median_e2el_ms=e2el[1], std_e2el_ms=e2el[2],
        p90_e2el_ms=e2el[3], p99_e2el_ms=e2el[4],
        max_concurrency_seen=max_concurrency_seen,
        num_tpot_samples=len(tpots),
        num_itl_samples=len(itls),
    )
