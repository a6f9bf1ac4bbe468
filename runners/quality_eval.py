"""Output quality of a running engine against a reference: the built-in evaluation corpus, the
client that samples logprobs from an OpenAI-compatible server (`measure`), and `compare`, the
pure comparison that gives the perplexity change, top-k KL divergence, top-1 agreement and
greedy match length.

One request per prompt on /v1/completions (vLLM 0.26 extensions): `prompt_logprobs: k`
(teacher-forced log-likelihood of the prompt, with the top-k at each position), `logprobs: k`,
`temperature: 0`, `max_tokens: n` (the greedy continuation with its top-k), and
`return_token_ids` / `return_tokens_as_token_ids` so that every token is named by its id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import httpx

from runners.atomic import write_atomic
from runners.credentials import auth_headers
from runners.workload import QualityEval

logger = logging.getLogger(__name__)

SAMPLE_VERSION = 1
CORPUS_FILE = "quality_corpus.txt"
# The flags that change what the model computes (weights, KV cache, activations' dtype). A config
# equal to the defaults on all of them is numerically the reference: batching and scheduling
# flags move logprobs only as much as the noise floor measures.
NUMERICS_FLAGS = ("quantization", "kv_cache_dtype", "dtype", "calculate_kv_scales")
_LOGPROB_DIGITS = 5  # stored precision: 1e-5 nats is far below any floor measured
_MIN_PROB = 1e-12  # the lumped rest's probability is clamped here (rounding can make it <= 0)
Mode = Literal["one_at_a_time", "all_at_once"]


def corpus() -> tuple[str, ...]:
    """The built-in prompts, in their fixed order."""
    text = resources.files("runners").joinpath(CORPUS_FILE).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.startswith("#"))


def eval_prompts(spec: QualityEval) -> tuple[str, ...]:
    """The first `spec.num_prompts` prompts of the corpus (the same for every trial)."""
    prompts = corpus()
    if not 1 <= spec.num_prompts <= len(prompts):
        raise ValueError(f"quality num_prompts must be in [1, {len(prompts)}] but got "
                         f"{spec.num_prompts}; lower it.")
    return prompts[:spec.num_prompts]


def changes_numerics(flags: Mapping[str, object], defaults: Mapping[str, object]) -> list[str]:
    """The `NUMERICS_FLAGS` whose value in `flags` differs from `defaults` (absent = default)."""
    return [name for name in NUMERICS_FLAGS
            if _norm(flags.get(name, defaults.get(name))) != _norm(defaults.get(name))]


def _norm(value: object) -> object:
    if value is None or (isinstance(value, str) and value.lower() in {"", "none", "auto"}):
        return None
    return value


# --- samples -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSample:
    """One prompt's answer. Position i of `prompt_logprobs` / `prompt_top` is token i + 1 of the
    prompt given tokens 0..i (the first token has no logprob)."""

    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: tuple[float, ...]  # nats, of each actual prompt token after the first
    prompt_top: tuple[Mapping[int, float], ...]  # per position: token id -> logprob (top-k
    # and the actual token)
    greedy_token_ids: tuple[int, ...]
    greedy_text: str
    greedy_top: tuple[Mapping[int, float], ...]  # per generated token: token id -> logprob

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt_token_ids),
                "prompt_logprobs": [round(x, _LOGPROB_DIGITS) for x in self.prompt_logprobs],
                "prompt_top": [_top_out(t) for t in self.prompt_top],
                "greedy_token_ids": list(self.greedy_token_ids),
                "greedy_text": self.greedy_text,
                "greedy_top": [_top_out(t) for t in self.greedy_top]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptSample:
        """The inverse of `to_dict` (samples are rounded to 1e-5 nats when parsed)."""
        return cls(prompt_token_ids=tuple(int(t) for t in data["prompt_token_ids"]),
                   prompt_logprobs=tuple(float(x) for x in data["prompt_logprobs"]),
                   prompt_top=tuple(_top_in(t) for t in data["prompt_top"]),
                   greedy_token_ids=tuple(int(t) for t in data["greedy_token_ids"]),
                   greedy_text=str(data["greedy_text"]),
                   greedy_top=tuple(_top_in(t) for t in data["greedy_top"]))


def _top_out(top: Mapping[int, float]) -> dict[str, float]:
    return {str(k): round(v, _LOGPROB_DIGITS) for k, v in top.items()}


def _top_in(top: Mapping[str, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in top.items()}


@dataclass(frozen=True)
class QualitySample:
    """The answers of one server to the evaluation set, sent `mode` (one prompt at a time, or
    all at once: batching alone moves logprobs). JSON-able (`to_dict`): about 3 KB a prompt
    at the default 16 tokens and top-5, ~100 KB for 32 prompts."""

    mode: Mode
    top_k: int
    max_tokens: int
    prompts: tuple[PromptSample, ...]
    version: int = SAMPLE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "mode": self.mode, "top_k": self.top_k,
                "max_tokens": self.max_tokens, "prompts": [p.to_dict() for p in self.prompts]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualitySample:
        return cls(mode=data["mode"], top_k=int(data["top_k"]),
                   max_tokens=int(data["max_tokens"]),
                   prompts=tuple(PromptSample.from_dict(p) for p in data["prompts"]),
                   version=int(data.get("version", SAMPLE_VERSION)))


@dataclass(frozen=True)
class QualityRun:
    """What a run's quality evaluation produced: its sample(s), or why there is none. A failed
    evaluation is data (`error`), never a failed run."""

    all_at_once: QualitySample | None = None  # every trial's sample
    one_at_a_time: QualitySample | None = None  # with `measure_floor` (the reference)
    error: str = ""  # one line: why a sample is missing
    wall_s: float = 0.0  # the evaluation's duration

    def to_dict(self) -> dict[str, Any]:
        return {"all_at_once": self.all_at_once.to_dict() if self.all_at_once else None,
                "one_at_a_time": self.one_at_a_time.to_dict() if self.one_at_a_time else None,
                "error": self.error, "wall_s": self.wall_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualityRun:
        def sample(key: str) -> QualitySample | None:
            value = data.get(key)
            return QualitySample.from_dict(value) if value else None
        return cls(all_at_once=sample("all_at_once"), one_at_a_time=sample("one_at_a_time"),
                   error=str(data.get("error") or ""), wall_s=float(data.get("wall_s") or 0.0))


# --- comparison ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class QualityScores:
    """A sample against a reference sample of the same evaluation set.

    - `ppl_increase`: corpus perplexity ratio - 1 (teacher-forced over every prompt token after
      the first); 0.01 = 1% higher perplexity.
    - `mean_kl`: mean KL(reference || sample) in nats over the positions whose context is the
      same in both: every prompt position, and the greedy positions up to and including the
      first divergence. Each side returns only its top-k (plus the actual token); both
      distributions are coarse-grained to the tokens both sides report plus one bucket that
      lumps the rest of the mass. Coarse-graining never increases KL (data-processing
      inequality): the figure is a lower bound on the true KL at those positions.
    - `top1_agreement`: the share of those positions whose most likely token is the same.
    - `greedy_match_tokens`: mean, over prompts, of the greedy tokens equal before the first
      divergence (`max_tokens` when none diverged).
    """

    ppl_increase: float
    mean_kl: float  # nats
    top1_agreement: float  # fraction of positions
    greedy_match_tokens: float  # tokens
    num_positions: int  # positions behind mean_kl and top1_agreement
    num_prompts: int

    def as_metrics(self, prefix: str = "quality.") -> dict[str, float]:
        return {f"{prefix}ppl_increase": self.ppl_increase, f"{prefix}mean_kl": self.mean_kl,
                f"{prefix}top1_agreement": self.top1_agreement,
                f"{prefix}greedy_match_tokens": self.greedy_match_tokens}

    def to_dict(self) -> dict[str, float | int]:
        return {"ppl_increase": self.ppl_increase, "mean_kl": self.mean_kl,
                "top1_agreement": self.top1_agreement,
                "greedy_match_tokens": self.greedy_match_tokens,
                "num_positions": self.num_positions, "num_prompts": self.num_prompts}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualityScores:
        return cls(ppl_increase=float(data["ppl_increase"]), mean_kl=float(data["mean_kl"]),
                   top1_agreement=float(data["top1_agreement"]),
                   greedy_match_tokens=float(data["greedy_match_tokens"]),
                   num_positions=int(data["num_positions"]),
                   num_prompts=int(data["num_prompts"]))


def compare(sample: QualitySample, reference: QualitySample) -> QualityScores:
    """`sample` against `reference` (pure). Raises ValueError when they are not answers to the
    same evaluation set (other prompts, other tokenization)."""
    if len(sample.prompts) != len(reference.prompts) or not reference.prompts:
        raise ValueError(f"quality samples differ in prompts: {len(sample.prompts)} vs "
                         f"{len(reference.prompts)}; measure both with the same quality "
                         "settings.")
    nll_sample = nll_reference = 0.0
    num_tokens = 0
    kls: list[float] = []
    agree = 0
    matches: list[int] = []
    for index, (ours, ref) in enumerate(zip(sample.prompts, reference.prompts, strict=True)):
        if ours.prompt_token_ids != ref.prompt_token_ids or \
                len(ours.prompt_logprobs) != len(ref.prompt_logprobs):
            raise ValueError(f"quality prompt {index} was tokenized differently in the two "
                             "samples; compare samples of the same model and tokenizer.")
        nll_sample -= sum(ours.prompt_logprobs)
        nll_reference -= sum(ref.prompt_logprobs)
        num_tokens += len(ref.prompt_logprobs)
        positions = list(zip(ours.prompt_top, ref.prompt_top, strict=True))
        match = 0
        for ours_id, ref_id in zip(ours.greedy_token_ids, ref.greedy_token_ids, strict=False):
            if ours_id != ref_id:
                break
            match += 1
        matches.append(match)
        # Contexts are equal up to the first divergence; that position is compared too.
        same_context = min(match + 1, len(ours.greedy_top), len(ref.greedy_top))
        positions += list(zip(ours.greedy_top[:same_context], ref.greedy_top[:same_context],
                              strict=True))
        for ours_top, ref_top in positions:
            if not ours_top or not ref_top:
                continue
            kls.append(lumped_kl(ref_top, ours_top))
            agree += _argmax(ours_top) == _argmax(ref_top)
    if num_tokens == 0:
        raise ValueError("quality samples hold no prompt logprobs; the server did not return "
                         "prompt_logprobs.")
    ppl_increase = math.exp((nll_sample - nll_reference) / num_tokens) - 1.0
    return QualityScores(
        ppl_increase=ppl_increase,
        mean_kl=sum(kls) / len(kls) if kls else 0.0,
        top1_agreement=agree / len(kls) if kls else 1.0,
        greedy_match_tokens=sum(matches) / len(matches),
        num_positions=len(kls), num_prompts=len(matches))


def lumped_kl(p_top: Mapping[int, float], q_top: Mapping[int, float]) -> float:
    """KL(P || Q) in nats between two top-k logprob sets, over the tokens both report plus
    one bucket holding the rest of each side's mass (see `QualityScores`): a lower bound."""
    shared = p_top.keys() & q_top.keys()
    kl = 0.0
    p_rest = q_rest = 1.0
    for token in shared:
        p, q = math.exp(p_top[token]), math.exp(q_top[token])
        kl += p * (p_top[token] - q_top[token])
        p_rest -= p
        q_rest -= q
    p_rest, q_rest = max(p_rest, _MIN_PROB), max(q_rest, _MIN_PROB)
    kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def _argmax(top: Mapping[int, float]) -> int:
    return max(top.items(), key=lambda kv: (kv[1], -kv[0]))[0]


# --- the client ----------------------------------------------------------------------------------
class QualityError(Exception):
    """The server's answers cannot make a sample (an error answer, a missing field)."""


def measure(base_url: str, model: str, spec: QualityEval, mode: Mode,
            api_key: str | None = None) -> QualitySample:
    """Send the evaluation set to a running server and read its answers. Raises QualityError
    (one line) when it cannot; the caller keeps that as data."""
    return asyncio.run(_measure(base_url, model, spec, mode, api_key))


async def _measure(base_url: str, model: str, spec: QualityEval, mode: Mode,
                   api_key: str | None) -> QualitySample:
    prompts = eval_prompts(spec)
    timeout = httpx.Timeout(spec.timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False,
                                 headers=auth_headers(api_key)) as client:
        if mode == "one_at_a_time":
            answers = [await _ask(client, model, prompt, spec) for prompt in prompts]
        else:
            answers = list(await asyncio.gather(
                *(_ask(client, model, prompt, spec) for prompt in prompts)))
    return QualitySample(mode=mode, top_k=spec.top_k, max_tokens=spec.max_tokens,
                         prompts=tuple(answers))


def request_body(model: str, prompt: str, spec: QualityEval) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "logprobs": spec.top_k, "prompt_logprobs": spec.top_k,
            "return_token_ids": True, "return_tokens_as_token_ids": True,
            "ignore_eos": True}


async def _ask(client: httpx.AsyncClient, model: str, prompt: str,
               spec: QualityEval) -> PromptSample:
    try:
        response = await client.post("/v1/completions", json=request_body(model, prompt, spec))
    except httpx.HTTPError as exc:
        raise QualityError(f"quality request failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise QualityError(f"quality request answered HTTP {response.status_code}: "
                           f"{response.text[:200]}")
    try:
        return parse_choice(response.json()["choices"][0])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise QualityError(f"quality answer lacks a field ({type(exc).__name__}: {exc}); the "
                           "server must support prompt_logprobs and return_token_ids "
                           "(vLLM >= 0.10.2).") from exc


def parse_choice(choice: Mapping[str, Any]) -> PromptSample:
    """One /v1/completions choice (vLLM's shape) as a `PromptSample`."""
    prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
    raw_prompt = choice["prompt_logprobs"]
    logprobs: list[float] = []
    prompt_top: list[dict[int, float]] = []
    for position, entry in enumerate(raw_prompt[1:], start=1):
        top = {int(k): round(float(v["logprob"]), _LOGPROB_DIGITS) for k, v in entry.items()}
        logprobs.append(top[prompt_ids[position]])
        prompt_top.append(top)
    lp = choice["logprobs"]
    tokens = lp["tokens"]
    greedy_ids = [int(t) for t in choice.get("token_ids") or [_token_id(t) for t in tokens]]
    greedy_top = [{_token_id(k): round(float(v), _LOGPROB_DIGITS) for k, v in (top or {}).items()}
                  for top in lp["top_logprobs"]]
    return PromptSample(prompt_token_ids=tuple(prompt_ids), prompt_logprobs=tuple(logprobs),
                        prompt_top=tuple(prompt_top), greedy_token_ids=tuple(greedy_ids),
                        greedy_text=str(choice.get("text") or ""), greedy_top=tuple(greedy_top))


def _token_id(token: str) -> int:
    """`token_id:123` (return_tokens_as_token_ids) -> 123."""
    if not token.startswith("token_id:"):
        raise ValueError(f"expected a token named 'token_id:N' but got {token!r}")
    return int(token.split(":", 1)[1])


def run_eval(base_url: str, model: str, spec: QualityEval,
             workdir: Path | None = None, api_key: str | None = None) -> QualityRun:
    """The evaluation a run adds after its levels: all at once, and with `measure_floor` one
    at a time first. Never raises for the server's answers; writes `quality.json` under
    `workdir` when given."""
    started = time.monotonic()
    one: QualitySample | None = None
    every: QualitySample | None = None
    error = ""
    try:
        if spec.measure_floor:
            one = measure(base_url, model, spec, "one_at_a_time", api_key)
        every = measure(base_url, model, spec, "all_at_once", api_key)
    except (QualityError, ValueError) as exc:
        error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        logger.warning("quality evaluation failed: %s", error)
    run = QualityRun(all_at_once=every, one_at_a_time=one, error=error,
                     wall_s=time.monotonic() - started)
    if workdir is not None:
        try:
            write_atomic(workdir / "quality.json", json.dumps(run.to_dict()))
        except OSError as exc:
            logger.warning("quality sample not written under %s: %s", workdir, exc)
    return run


__all__ = ["NUMERICS_FLAGS", "PromptSample", "QualityError", "QualityRun", "QualitySample",
           "QualityScores", "changes_numerics", "compare", "corpus", "eval_prompts",
           "lumped_kl", "measure", "parse_choice", "run_eval"]
