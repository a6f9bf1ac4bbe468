"""Shared-prefix workloads: which requests start with which of a few fixed prefixes (a system
prompt), and the prefixes themselves, made by a caller-given "N tokens of prompt" function so
that token-id prompts (dummy weights) and text prompts (a tokenizer) build them the same way."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from runners.workload import SharedPrefix

Prompt = TypeVar("Prompt", str, list[int])
# "N tokens of prompt": a prompt of exactly that many tokens, drawn from the generator given.
MakeTokens = Callable[[int, np.random.Generator], Prompt]
_PREFIX_STREAM = 0x5EED  # a seed stream of its own: the prompts' draws stay what they were


def prefix_plan(num: int, shared: SharedPrefix, seed: int) -> list[int | None]:
    """For each of `num` requests, the index of the prefix it starts with, or None (unique).

    Request i shares when floor((i + 1) f) > floor(i f): exactly floor(n f) of the first n
    requests share, spread evenly, and request i's answer does not depend on `num`. Which
    prefix: uniform among `num_prefixes`, drawn from a stream seeded by `seed` alone."""
    rng = np.random.default_rng([seed, _PREFIX_STREAM, 1])
    plan: list[int | None] = []
    for i in range(num):
        choice = int(rng.integers(shared.num_prefixes))  # drawn for every i: i-th is stable
        is_shared = math.floor((i + 1) * shared.fraction + 1e-9) > \
            math.floor(i * shared.fraction + 1e-9)
        plan.append(choice if is_shared else None)
    return plan


def make_prefixes(shared: SharedPrefix, seed: int, make_tokens: MakeTokens[Prompt]
                  ) -> list[Prompt]:
    """The `num_prefixes` prefixes of `shared.num_tokens` tokens each, deterministic in `seed`
    (the same for every level and trial of a study with that seed)."""
    rng = np.random.default_rng([seed, _PREFIX_STREAM, 2])
    return [make_tokens(shared.num_tokens, rng) for _ in range(shared.num_prefixes)]


def join(prefix: Prompt, rest: Prompt) -> Prompt:
    """The prompt that starts with `prefix`: token ids concatenated; text joined as is (the
    text maker decides its own separator by ending its prefix with one)."""
    if isinstance(prefix, list) and isinstance(rest, list):
        return [*prefix, *rest]
    if isinstance(prefix, str) and isinstance(rest, str):
        return prefix + rest
    raise ValueError("a shared prefix and the prompt it starts must both be token ids or both "
                     f"text but got {type(prefix).__name__} and {type(rest).__name__}.")


def apply_shared_prefix(prompts: Sequence[Prompt], shared: SharedPrefix, seed: int,
                        make_tokens: MakeTokens[Prompt]) -> list[tuple[Prompt, int | None]]:
    """Each prompt with its prefix prepended where the plan says so, and which prefix (None:
    left unique). `prompts` are the parts after the prefix (the workload's input_len)."""
    prefixes = make_prefixes(shared, seed, make_tokens)
    plan = prefix_plan(len(prompts), shared, seed)
    return [(prompt if index is None else join(prefixes[index], prompt), index)
            for prompt, index in zip(prompts, plan, strict=True)]
