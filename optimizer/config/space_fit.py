"""Whether any config of the resolved search space can fit the host's GPUs (`space_fit_problem`),
checked by `nightshift start` before anything is written: the per-trial check before launch
(`bottleneck.memory_problem`, a trial "rejected before launch (infeasible)") run over the
space's most favourable configs, so a model no config can hold is refused at once instead of
failing every trial of a study that then exits 0."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Final

from optimizer.bottleneck.memory_fit import memory_need, memory_problem
from optimizer.storage.study import engine_config
from search_spaces.engine.facts import EngineFlags

if TYPE_CHECKING:
    from optimizer.config.loading import StudyConfig
    from runners.base import EngineConfig
    from runners.hardware import HardwareProfile
    from runners.model_info import ModelInfo
    from search_spaces.params import ParamSpec, Value
    from search_spaces.resolved import ResolvedSpace

# The only params `memory_problem` reads: every other one is left at its default.
_MEMORY_PARAMS: Final = ("tensor_parallel_size", "pipeline_parallel_size", "quantization",
                         "kv_cache_dtype", "gpu_memory_utilization", "max_model_len")
_MAX_INT_VALUES: Final = 64  # an int range up to this many values is tried value by value


def space_fit_problem(cfg: StudyConfig, space: ResolvedSpace, hardware: HardwareProfile | None,
                      model: ModelInfo | None, *, engine: str) -> str | None:
    """Why no config of `space` can fit one of the host's GPUs, or None when one may (or when
    it is unknown: no hardware or model size known, so `memory_problem` judges nothing).

    Every combination of the memory params' values is judged (each domain's values and those
    a conditional rule may set; the rules themselves are ignored, so this may judge configs
    the space never samples: it only ever errs towards starting), with tensor_parallel_size x
    pipeline_parallel_size at most the host's GPUs; the rest at their defaults, with the
    study's fixed flags, as a trial would run."""
    if hardware is None or model is None or hardware.gpu_memory_gib <= 0:
        return None
    defaults = space.defaults()
    choices = [_candidates(space, name) if name in defaults else [None]
               for name in _MEMORY_PARAMS]
    best: tuple[float, str, EngineConfig] | None = None
    for values in itertools.product(*choices):
        params = dict(defaults)
        params.update({k: v for k, v in zip(_MEMORY_PARAMS, values, strict=True)
                       if k in defaults})
        config = engine_config(cfg, space.to_flags(params))
        if config.tensor_parallel_size * config.pipeline_parallel_size > hardware.num_gpus:
            continue  # no host GPUs to place it on
        problem = memory_problem(config, hardware, model)
        if problem is None:
            return None
        shortfall = memory_need(config, hardware, model).shortfall_gib
        if best is None or shortfall < best[0]:
            best = (shortfall, problem, config)
    if best is None:  # nothing placeable: the GPU checks say so, not this one
        return None
    _, problem, config = best
    flags = config.flags
    form = (f"quantization {EngineFlags(flags).weight_method(model.quant_method) or 'none'}, "
            f"tensor_parallel_size {config.tensor_parallel_size}"
            + (f" x pipeline_parallel_size {config.pipeline_parallel_size}"
               if config.pipeline_parallel_size > 1 else ""))
    more = "add GPUs (simulated.num_gpus) or choose a smaller model" if engine == "simulated" \
        else "run it on a host with more or larger GPUs, or choose a smaller model"
    return (f"model.path: no config of search space {space.name} fits "
            f"{hardware.num_gpus} x {hardware.gpu_memory_gib:.0f} GiB ({hardware.gpu_name}): "
            f"even its most favourable ({form}) is refused before launch, as {problem}; {more}")


def _candidates(space: ResolvedSpace, name: str) -> list[Value]:
    spec: ParamSpec = next(p for p in space.params if p.name == name)
    if spec.type == "categorical":
        values: list[Value] = list(spec.choices)
    elif spec.type == "int" and spec.low is not None and spec.high is not None and \
            (spec.count() or _MAX_INT_VALUES + 1) <= _MAX_INT_VALUES:
        # every value: tensor_parallel_size 1..8 on 4 GPUs fits at 4, its ends do not
        values = list(range(int(spec.low), int(spec.high) + 1, int(spec.step or 1)))
    else:  # what memory_problem reads of a range is monotone in it: its ends
        values = [spec.low, spec.high]
    values += [v for rule in space.conditional_rules for target, v in rule.targets
               if target == name and v not in values]
    if name in space.study_fixed:
        values = [space.study_fixed[name]]
    return values

