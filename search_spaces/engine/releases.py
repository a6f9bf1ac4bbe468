"""What changed between vLLM releases, from the bundled flag tables and the releases' sources: a
flag a release removed, renamed or added (`flag_change`, for `nightshift audit`, the study-file
check and `regress`), and what moves a capacity figure with no flag changed (`capacity_changes`):
the defaults of capacity flags as the tables state them, and the behaviour changes read in the
releases' sources (verified, with where; docs/vllm-versions.md). `nightshift regress` prints the
latter beside a case re-measured on a newer release than its reference, so a moved baseline is
read with its cause in view."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from search_spaces.engine.tables import VllmFlags, bundled_tables, flag_name, version_key


@dataclass(frozen=True)
class FlagChange:
    """What the bundled tables say about a flag `version` does not take."""

    flag: str  # kebab-case, no dashes
    change: Literal["removed", "renamed", "added later"]
    release: str  # the first release without it (removed, renamed) or with it (added later)
    last_release: str | None = None  # the last release that took it (removed, renamed)
    new_name: str | None = None  # renamed: the flag naming the same config field

    @property
    def sentence(self) -> str:
        if self.change == "renamed":
            return (f"--{self.flag} was renamed --{self.new_name} in vLLM {self.release} "
                    f"(the last release with --{self.flag}: {self.last_release})")
        if self.change == "removed":
            return (f"--{self.flag} was removed in vLLM {self.release} (the last release with "
                    f"it: {self.last_release})")
        return f"--{self.flag} is first a flag of vLLM {self.release}"


def flag_change(name: str, version: str,
                tables: Sequence[VllmFlags] | None = None) -> FlagChange | None:
    """Why vLLM `version` does not take the flag `name` (kebab- or snake_case), from the bundled
    tables: the latest release up to `version` that removed it (renamed where a flag added in
    that same release names the config field it named), or the first later release that has
    it. None where `version` takes it or no bundled table ever had it. `tables`: others than
    the bundled ones, oldest first."""
    flag = flag_name(name).partition(".")[0]
    held, dropped, later = _history(lambda t: flag in t.types, version, tables)
    if held:
        return None
    if dropped is not None:
        before, after = dropped
        field_name = before.config_fields.get(flag)
        new = [f for f in after.types if f not in before.types and field_name is not None
               and after.config_fields.get(f) == field_name]
        return FlagChange(flag, "renamed" if len(new) == 1 else "removed",
                          release=after.releases[0], last_release=before.releases[-1],
                          new_name=new[0] if len(new) == 1 else None)
    if later is not None:
        return FlagChange(flag, "added later", release=later.releases[0])
    return None


def _history(has: Callable[[VllmFlags], bool], version: str,
             tables: Sequence[VllmFlags] | None) -> tuple[
                 bool, tuple[VllmFlags, VllmFlags] | None, VllmFlags | None]:
    """Where a flag or variable (`has` of a table) stands for vLLM `version`, from `tables`
    (the bundled ones when None), oldest first: whether `version`'s table has it; else the
    latest pair of tables up to `version` across which it was dropped (before, after); else
    the first later table that has it."""
    key = version_key(version)
    tables = bundled_tables() if tables is None else tables
    here = [t for t in tables if version_key(t.version) <= key]
    if here and has(here[-1]):
        return True, None, None
    for before, after in reversed(list(itertools.pairwise(here))):
        if has(before) and not has(after):
            return False, (before, after), None
    return False, None, next((t for t in tables if version_key(t.version) > key and has(t)),
                             None)


def env_change(name: str, version: str,
               tables: Sequence[VllmFlags] | None = None) -> str | None:
    """Why vLLM `version` does not read the environment variable `name`, from the bundled
    tables, as a clause: the release that stopped reading it (with the flag of the same name
    where that release has one: VLLM_MM_HASHER_ALGORITHM -> --mm-hasher-algorithm, by name
    only), or the first later release that reads it. None where `version` reads it or no
    bundled table ever did."""
    held, dropped, later = _history(lambda t: name in t.env_vars, version, tables)
    if held:
        return None
    if dropped is not None:
        before, after = dropped
        flag = name.removeprefix("VLLM_").lower().replace("_", "-")
        instead = f"; vLLM {after.releases[0]} has --{flag}" if flag in after.types else ""
        return (f"vLLM {after.releases[0]} stopped reading it (the last release that "
                f"did: {before.releases[-1]}){instead}")
    if later is not None:
        return f"vLLM {later.releases[0]} is the first release that reads it"
    return None


# Flags whose default sizes the KV cache, the batch or the graphs: a change of their default
# between two releases moves capacity with the same command line.
CAPACITY_FLAGS = (
    "gpu-memory-utilization", "kv-cache-memory-bytes", "block-size", "kv-cache-dtype",
    "max-num-seqs", "max-num-batched-tokens", "enable-prefix-caching", "enable-chunked-prefill",
    "async-scheduling", "compilation-config.cudagraph_mode", "max-cudagraph-capture-size",
    "long-prefill-token-threshold", "stream-interval", "optimization-level",
)

# Behaviour changes no flag default shows, each read in the release's own sources (the file
# named) against the release before it.
SOURCE_CHANGES: dict[str, tuple[str, ...]] = {
    "0.28.0": (
        "on a GPU of >= 160 GiB (B200, B300) `vllm serve` defaults to max_num_batched_tokens "
        "16384 (was 8192; max_num_seqs stays 1024) (engine/arg_utils.py get_batch_defaults); "
        "smaller GPUs keep 0.27's defaults",
        "the KV budget's non-KV memory is now what cudaMemGetInfo says the start consumed plus "
        "the transient torch peak (utils/mem_utils.py total_consumed + "
        "transient_peak_headroom), where 0.27 added the non-torch increase, the torch peak "
        "and the weights: the KV cache size moves at the same --gpu-memory-utilization",
    ),
    "0.29.0": (
        "Model Runner V2 is the default for every model on CUDA (config/vllm.py "
        "use_v2_model_runner); 0.26-0.28 used it by default only for dense, non-hybrid "
        "generation models, so a MoE, hybrid or pooling model changes runner (and CUDA-graph "
        "memory, so KV size) while a dense model such as Qwen2.5 or SmolLM2 does not",
    ),
    "0.33.0": (
        "a GB10 (DGX Spark, compute capability 12.1) keeps the small scheduler defaults, "
        "max_num_seqs 256 and max_num_batched_tokens 2048 (was 1024 / 8192) "
        "(engine/arg_utils.py get_batch_defaults)",
    ),
    "0.34.0": (
        "the extensible KV cache (new --enable-extensible-kv-cache) is on for a plain CUDA "
        "launch and sizes the KV cache from measured memory; with it an unset "
        "--gpu-memory-utilization means 1.0, not 0.92 (config/cache.py "
        "resolved_gpu_memory_utilization, config/vllm.py): a launch that leaves it unset gets "
        "a larger KV cache",
        "Model Runner V1 is removed (v1/worker/gpu_model_runner.py is gone and "
        "VLLM_USE_V2_MODEL_RUNNER=0 is refused, platforms/interface.py validate_environ): a "
        "config that 0.29-0.33 ran on V1 because V2 lacked one of its features now runs V2 "
        "or fails",
    ),
}


# Variables a release refuses at start with a given value, read in its sources (the table's
# `removed_env_vars` holds only those its own list names): name -> (first release, value, why).
REFUSED_ENV_VALUES: dict[str, tuple[str, str, str]] = {
    "VLLM_USE_V2_MODEL_RUNNER": (
        "0.34.0", "0", "Model Runner V1 is removed (v1/worker/gpu_model_runner.py is gone); "
        "platforms/interface.py validate_environ refuses the V1 switch: unset it"),
}


def refused_env_value(name: str, value: str, version: str) -> str | None:
    """Why vLLM `version` refuses to start with `name=value` (`REFUSED_ENV_VALUES`), or None."""
    entry = REFUSED_ENV_VALUES.get(name)
    if entry is None or value.strip() != entry[1] or \
            version_key(version) < version_key(entry[0]):
        return None
    return f"vLLM {entry[0]} and later refuse {name}={value.strip()}: {entry[2]}"


@dataclass(frozen=True)
class ReleaseChange:
    """One capacity-moving change, in the release that made it."""

    release: str
    text: str


def capacity_changes(earlier: str, later: str) -> list[ReleaseChange]:
    """The capacity-moving changes of the releases after `earlier` up to `later`: default
    changes of `CAPACITY_FLAGS` between consecutive bundled tables, and `SOURCE_CHANGES`."""
    low, high = version_key(earlier), version_key(later)
    out: list[ReleaseChange] = []
    tables = bundled_tables()
    for before, after in itertools.pairwise(tables):
        if not low < version_key(after.version) <= high:
            continue
        for flag in CAPACITY_FLAGS:
            head = flag.partition(".")[0]
            if head not in before.types or head not in after.types:
                continue
            old, new = before.defaults.get(flag, "unstated"), after.defaults.get(flag, "unstated")
            if old != new:
                out.append(ReleaseChange(after.releases[0],
                                         f"--{flag} default {_show(old)} -> {_show(new)}"))
    for release, texts in SOURCE_CHANGES.items():
        if low < version_key(release) <= high:
            out += [ReleaseChange(release, text) for text in texts]
    return sorted(out, key=lambda c: version_key(c.release))


def _show(value: object) -> str:
    return "decided at start-up" if value is None else repr(value)
