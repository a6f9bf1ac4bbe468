"""The simulated engine's logprobs: a per-config perturbation model (a model, never a
measurement; docs/simulated-engine.md). Each context has a deterministic next-token
distribution; a config that changes numerics adds seeded noise to its logits, and batching adds
a tiny jitter, so the quality gate's whole path runs without a GPU.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Logit noise (standard deviation, nats) each numerics change adds; independent sources add in
# quadrature. Chosen so that fp8 weights land near a 1% perplexity increase on the corpus and
# fp8 KV below it: the ordering real measurements show, not their values.
WEIGHT_NOISE = {"fp8": 0.12, "fp8_per_tensor": 0.12, "fp8_per_channel": 0.1,
                "fp8_per_block": 0.08, "fbgemm_fp8": 0.12, "awq": 0.25, "gptq": 0.25,
                "awq_marlin": 0.25, "gptq_marlin": 0.25, "bitsandbytes": 0.3}
OTHER_WEIGHT_NOISE = 0.2  # any other quantization method
KV_NOISE = {"fp8": 0.07, "fp8_e4m3": 0.07, "fp8_e5m2": 0.1}
FLOAT16_NOISE = 0.01  # --dtype float16 against a bf16 checkpoint
BATCH_JITTER = 0.004  # batch composition moves logits a little (the noise floor)
NUM_CANDIDATES = 12  # tokens with a distinct logit per context; the rest share a tail logit
# The actual next token's logit drops by this x sigma^2 (nats): perplexity rises with the
# noise on average, as it does for a quantized model, rather than by the noise's luck alone.
TRUE_TOKEN_PENALTY = 2.0
_TAIL_LOGIT = -8.0
_TRUE_TOKEN_LOGIT = 3.0  # the prompt's actual next token: the model knows the text


def noise_sigma(flags: Mapping[str, object]) -> float:
    """The logit noise a config's flags add, in nats (0 for the reference numerics)."""
    quant = str(flags.get("quantization") or "none").lower()
    kv = str(flags.get("kv_cache_dtype") or "auto").lower()
    dtype = str(flags.get("dtype") or "auto").lower()
    parts = []
    if quant not in {"none", ""}:
        parts.append(WEIGHT_NOISE.get(quant, OTHER_WEIGHT_NOISE))
    if kv not in {"auto", ""}:
        parts.append(KV_NOISE.get(kv, KV_NOISE["fp8"]))
    if dtype in {"float16", "half"}:
        parts.append(FLOAT16_NOISE)
    return math.sqrt(sum(p * p for p in parts))


def numerics_seed(flags: Mapping[str, object]) -> int:
    """Seeds a config's noise: the same numerics give the same noise in every run."""
    key = "|".join(str(flags.get(k)) for k in ("quantization", "kv_cache_dtype", "dtype"))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class LogitModel:
    """The next-token distribution of one simulated engine."""

    vocab_size: int
    sigma: float  # the config's logit noise, nats
    seed: int  # `numerics_seed` of the config

    def distribution(self, context: Sequence[int], next_token: int | None,
                     batch_key: int) -> tuple[dict[int, float], float]:
        """(candidate token id -> logprob, the logprob of every other token) after `context`.

        `next_token`: the text's actual next token when known (prompt positions): the model
        predicts it well. `batch_key`: the batch the request ran in (1 = alone); any other
        value adds the batching jitter."""
        digest = hashlib.blake2b(struct.pack(f"<{len(context)}q", *context),
                                 digest_size=8).digest()
        h = int.from_bytes(digest, "big")
        base = random.Random(h)
        ids = [base.randrange(self.vocab_size) for _ in range(NUM_CANDIDATES)]
        logits = [base.gauss(0.0, 1.5) for _ in ids]
        if next_token is not None:
            ids[0], logits[0] = next_token, _TRUE_TOKEN_LOGIT + base.gauss(0.0, 1.0)
        tail = _TAIL_LOGIT
        if self.sigma > 0:
            noise = random.Random(h ^ self.seed)
            logits = [x + noise.gauss(0.0, self.sigma) for x in logits]
            tail += noise.gauss(0.0, self.sigma)
            if next_token is not None:  # a lossy model knows the text a little less well
                logits[0] -= TRUE_TOKEN_PENALTY * self.sigma ** 2
        if batch_key != 1:
            jitter = random.Random(h ^ (batch_key * 0x9E3779B97F4A7C15))
            logits = [x + jitter.gauss(0.0, BATCH_JITTER) for x in logits]
        table: dict[int, float] = {}
        for token, logit in zip(ids, logits, strict=True):
            table[token] = max(logit, table.get(token, -math.inf))
        num_tail = self.vocab_size - len(table)
        top = max(max(table.values()), tail)
        log_z = top + math.log(sum(math.exp(x - top) for x in table.values())
                               + num_tail * math.exp(tail - top))
        return {t: x - log_z for t, x in table.items()}, tail - log_z


def top_k(table: Mapping[int, float], k: int) -> dict[int, float]:
    return dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))[:k])


def prompt_logprobs(model: LogitModel, prompt: Sequence[int], k: int,
                    batch_key: int) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's `prompt_logprobs` answer: None for the first token, then per position the top-k
    and the actual token, keyed by token id, with their logprob and rank."""
    out: list[dict[str, dict[str, object]] | None] = [None]
    for position in range(1, len(prompt)):
        table, tail = model.distribution(prompt[:position], prompt[position], batch_key)
        ranked = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))
        entry = {str(t): {"logprob": lp, "rank": rank, "decoded_token": word(t)}
                 for rank, (t, lp) in enumerate(ranked[:k], start=1)}
        actual = prompt[position]
        if str(actual) not in entry:
            lp = table.get(actual, tail)
            rank = 1 + sum(1 for _, x in ranked if x > lp)
            entry[str(actual)] = {"logprob": lp, "rank": rank, "decoded_token": word(actual)}
        out.append(entry)
    return out


def greedy(model: LogitModel, prompt: Sequence[int], max_tokens: int, k: int,
           batch_key: int) -> tuple[list[int], list[dict[int, float]]]:
    """The greedy continuation and the top-k logprobs at each of its positions."""
    context = list(prompt)
    ids: list[int] = []
    tops: list[dict[int, float]] = []
    for _ in range(max_tokens):
        table, _tail = model.distribution(context, None, batch_key)
        top = top_k(table, max(k, 1))
        token = next(iter(top))
        ids.append(token)
        tops.append(top_k(table, k) if k > 0 else {})
        context.append(token)
    return ids, tops


_WORDS = ("the", "a", "river", "light", "stone", "house", "morning", "and", "of", "slowly",
          "green", "bread", "north", "water", "small", "old")


def word(token: int) -> str:
    """The simulated tokenizer's text for a token id (the ids come from whitespace words)."""
    return " " + _WORDS[token % len(_WORDS)]


def wants_logprobs(body: Mapping[str, object]) -> bool:
    return body.get("logprobs") is not None or body.get("prompt_logprobs") is not None


def completion_choice(model: LogitModel, prompt: Sequence[int], body: Mapping[str, object],
                      max_tokens: int, batch_key: int) -> dict[str, object]:
    """A /v1/completions choice with vLLM 0.26's logprob fields, for a greedy request (the
    simulated engine answers every logprob request greedily, whatever its temperature)."""
    k = _int_field(body, "logprobs")
    num_prompt = body.get("prompt_logprobs")
    ids, tops = greedy(model, prompt, max_tokens, k or 0, batch_key)
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def name(token: int) -> str:
        return f"token_id:{token}" if as_ids else word(token)

    logprobs = None
    if k is not None:
        offsets, position = [], 0
        for token in ids:
            offsets.append(position)
            position += len(word(token))
        logprobs = {"text_offset": offsets, "tokens": [name(t) for t in ids],
                    "token_logprobs": [top.get(t, min(top.values(), default=0.0))
                                       for t, top in zip(ids, tops, strict=True)],
                    "top_logprobs": [{name(t): lp for t, lp in top.items()} for top in tops]}
    choice: dict[str, object] = {
        "index": 0, "text": "".join(word(t) for t in ids), "logprobs": logprobs,
        "finish_reason": "length", "stop_reason": None,
        "prompt_logprobs": prompt_logprobs(model, prompt, _int_field(body, "prompt_logprobs")
                                           or 0, batch_key)
        if num_prompt is not None else None}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = list(prompt)
        choice["token_ids"] = ids
    return choice


def _int_field(body: Mapping[str, object], name: str) -> int | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return None
    return max(0, int(value)) if isinstance(value, int | float) else None
