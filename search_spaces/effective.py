"""What a config runs with, as far as it is known before launch: vLLM's defaults for the params
it leaves unset and the CUDA-graph capture size vLLM ends with (`effective_params`), and which
params two configs set differently in effect (`changed_params`)."""

from __future__ import annotations

from collections.abc import Mapping

from search_spaces.params import Value


def effective_params(params: Mapping[str, Value],
                     defaults: Mapping[str, Value]) -> dict[str, Value]:
    """The values a config runs with, as far as they are known here: an unset param (None)
    takes vLLM's default from `defaults` (a resolved space's `vllm_defaults`, host-dependent
    ones included), and the largest CUDA-graph capture size is the one vLLM 0.26 ends with
    (config/vllm.py:1780-1880): 0 without CUDA graphs (`enforce_eager`, `cudagraph_mode`
    NONE); unset, min(max_num_seqs x (1 + draft tokens) x 2, 512); at most
    max_num_batched_tokens; then cut down to the last size of vLLM's own capture list. Not
    modelled: `performance_mode: interactivity` and sequence parallelism with TP > 1 (neither
    is searched). What stays None is decided by vLLM at start-up (async_scheduling) or
    unknown (a suffix method without a draft count)."""
    out = {k: (defaults.get(k) if v is None else v) for k, v in params.items()}
    if "max_cudagraph_capture_size" in out:
        out["max_cudagraph_capture_size"] = _capture_size(out, defaults)
    return out


def changed_params(params: Mapping[str, Value], reference: Mapping[str, Value],
                   defaults: Mapping[str, Value]) -> list[str]:
    """The params `params` sets differently from `reference` where setting one back to the
    reference's value would change what vLLM runs with (`effective_params`): an explicit
    value equal to vLLM's default is no change, and neither is a capture size that CUDA
    graphs off make moot. A param one side lacks is vLLM's default there. Sorted by name."""
    keys = sorted(set(params) | set(reference))
    mine = {k: params.get(k) for k in keys}
    theirs = {k: reference.get(k) for k in keys}
    runs = effective_params(mine, defaults)
    return [k for k in keys if repr(mine[k]) != repr(theirs[k])
            and repr(runs[k]) != repr(effective_params({**mine, k: theirs[k]}, defaults)[k])]


def _capture_size(values: Mapping[str, Value], defaults: Mapping[str, Value]) -> int | None:
    def known(name: str) -> int | None:
        value = values.get(name, defaults.get(name))
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) \
            else None

    if values.get("enforce_eager", defaults.get("enforce_eager")) is True or \
            values.get("cudagraph_mode", defaults.get("cudagraph_mode")) == "NONE":
        return 0
    size, seqs, budget = known("max_cudagraph_capture_size"), known("max_num_seqs"), \
        known("max_num_batched_tokens")
    if size is None:
        method = values.get("spec_method", defaults.get("spec_method"))
        drafts = 0 if method in (None, "none") else known("spec_tokens")
        if seqs is None or drafts is None:
            return None
        size = min(seqs * (1 + drafts) * 2, 512)
    if budget is not None:
        size = min(size, budget)
    # vLLM's capture list (config/vllm.py:1820-1843) and the cut to its last size (:1857-1880).
    sizes = [i for i in (1, 2, 4) if i <= size]
    sizes += list(range(8, min(size + 1, 256), 8))
    if size >= 256:
        sizes += list(range(256, size + 1, 16))
    if budget is not None and budget <= size:
        sizes.append(budget)
    return max(sizes) if sizes else 0
