"""Issue 23's knobs: each renders to argv and `--config` YAML as vLLM 0.26's table parses it, and
each rule drops or keeps it for the workload and weights the study runs (docs/knobs.md)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from optimizer.run.space_context import space_context, workload_facts
from runners.capacity.search import CapacitySearch
from runners.hardware import load_preset
from runners.load_level import LoadLevel
from runners.model_info import load_model_info
from runners.workload import LengthDistribution, Workload
from search_spaces import load_space, to_flags
from search_spaces.engine.render import to_argv, to_config_dict
from search_spaces.engine.tables import bundled_flags, value_problem

NEW_KNOBS: dict[str, Any] = {
    "cudagraph_mode": "PIECEWISE",
    "max_cudagraph_capture_size": 64,
    "async_scheduling": False,
    "stream_interval": 4,
    "long_prefill_token_threshold": 2048,
    "enable_prefix_caching": False,
    "block_size": 32,
    "spec_method": "ngram",
    "spec_tokens": 4,
}
EXPECTED_ARGV = [
    "--compilation-config.cudagraph_mode", "PIECEWISE", "--max-cudagraph-capture-size", "64",
    "--no-async-scheduling", "--stream-interval", "4", "--long-prefill-token-threshold", "2048",
    "--no-enable-prefix-caching", "--block-size", "32", "--spec-method", "ngram",
    "--spec-tokens", "4",
]


def _resolve(space: str = "hopper", *, load_format: str = "auto",
             workload: Workload | None = None) -> Any:
    return load_space(space).resolve(space_context(
        load_preset("h200"), load_model_info("qwen2.5-7b"), workload or Workload(),
        load_format))


def _domain(resolved: Any, name: str) -> tuple[Any, ...]:
    return next(p.choices for p in resolved.params if p.name == name)


def test_each_new_knob_renders_to_argv_as_vllm_026_spells_and_types_it() -> None:
    argv = to_argv(to_flags(NEW_KNOBS), bundled_flags())
    assert argv == EXPECTED_ARGV, "one flag per knob, vLLM's spelling, negatable False as --no-"
    table = bundled_flags()
    for index, arg in enumerate(argv):
        if not arg.startswith("--") or arg.startswith("--no-"):
            continue
        name = arg[2:].partition(".")[0]
        assert table.resolve(name) == name, f"{arg} is a flag of vLLM 0.26's parser"
        flag = table.types[name]
        if flag.kind != "json":  # a dotted nested key: vLLM parses the value itself
            assert value_problem(flag, _typed(argv[index + 1])) is None, f"{arg} takes its value"


def _typed(text: str) -> object:
    return int(text) if text.isdigit() else text


def test_each_new_knob_renders_to_config_yaml_with_the_same_keys_as_the_argv() -> None:
    config = to_config_dict(to_flags(NEW_KNOBS), bundled_flags())
    text = yaml.safe_dump(config, sort_keys=False)
    read_back = yaml.safe_load(text)
    # vLLM's config-file loader turns each key into `--key value` (utils/argparse_utils.py).
    argv = [a for k, v in read_back.items() for a in ([f"--{k}"] if v is True else
                                                       [f"--{k}", str(v)])]
    assert argv == EXPECTED_ARGV, "the YAML reads back as the same command line"
    assert read_back["compilation-config.cudagraph_mode"] == "PIECEWISE"


def test_the_defaults_of_the_new_knobs_render_as_no_flag_at_all() -> None:
    resolved = _resolve()
    assert resolved.to_flags(resolved.defaults()) == {}, \
        "the defaults trial stays a plain `vllm serve MODEL`"


def test_spec_decoding_is_dropped_with_its_reason_on_dummy_weights() -> None:
    resolved = _resolve(load_format="dummy")
    assert _domain(resolved, "spec_method") == ("none",)
    applied = {r.name: r for r in resolved.applied_rules}
    assert "meaningless" in applied["spec-decoding-needs-real-weights"].reason
    assert resolved.defaults()["spec_tokens"] is None, "no --spec-tokens without a method"


def test_spec_decoding_is_searched_with_real_weights_and_its_tokens_follow_the_method() -> None:
    resolved = _resolve(load_format="auto")
    assert _domain(resolved, "spec_method") == ("none", "ngram", "ngram_gpu")
    assert resolved.check({**resolved.defaults(), "spec_tokens": 4}), \
        "spec_tokens without a method breaks spec-tokens-need-a-method"
    assert not resolved.check({**resolved.defaults(), "spec_method": "ngram", "spec_tokens": 4})


def test_prefix_caching_is_searched_only_when_the_workload_may_share_prefixes(
        tmp_path: Any) -> None:
    synthetic = _resolve()
    assert _domain(synthetic, "enable_prefix_caching") == (True,), "random prompts share none"
    assert "prefix-caching-needs-shared-prefixes" in {r.name for r in synthetic.applied_rules}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    from_file = _resolve(workload=Workload(prompts_file=prompts))
    assert _domain(from_file, "enable_prefix_caching") == (True, False), \
        "a prompts file may share a system prompt: the rule does not apply"


@pytest.mark.parametrize(("concurrency", "kept"), [(16, (None, 64)), (64, (None, 64)),
                                                    (100, (None, 64, 128)),
                                                    (2000, (None, 64, 128, 256, 512))])
def test_capture_sizes_above_the_workloads_concurrency_are_dropped(
        concurrency: int, kept: tuple[Any, ...]) -> None:
    workload = Workload(levels=(LoadLevel(max_concurrency=8), LoadLevel(
        max_concurrency=concurrency)))
    assert _domain(_resolve(workload=workload), "max_cudagraph_capture_size") == kept


def test_an_uncapped_rate_keeps_every_capture_size() -> None:
    workload = Workload(levels=(LoadLevel(request_rate_rps=4.0),))
    assert "max_concurrency" not in workload_facts(workload)
    assert _domain(_resolve(workload=workload), "max_cudagraph_capture_size") == (
        None, 64, 128, 256, 512)
    capacity = Workload(capacity=CapacitySearch(axis="concurrency", low=1, high=96))
    assert workload_facts(capacity)["max_concurrency"] == 96


def test_prefill_thresholds_at_or_above_the_longest_prompt_are_dropped() -> None:
    short = Workload(input_len=LengthDistribution(mean=512))
    assert _domain(_resolve(workload=short), "long_prefill_token_threshold") == (0,)
    long = Workload(input_len=LengthDistribution(kind="uniform", low=1000, high=6000))
    assert _domain(_resolve(workload=long), "long_prefill_token_threshold") == (0, 512, 2048)


def test_eager_fixes_cudagraph_mode_so_graphs_off_is_not_searched_twice() -> None:
    resolved = _resolve("default")
    assert "NONE" not in _domain(resolved, "cudagraph_mode"), "enforce_eager is the off switch"
    params = {**resolved.defaults(), "enforce_eager": True, "cudagraph_mode": "PIECEWISE"}
    assert any("eager-means-no-cudagraphs" in p for p in resolved.check(params))


@pytest.mark.parametrize("space", ["default", "ampere", "consumer_24gb", "hopper"])
def test_every_bundled_space_keeps_vllms_defaults_as_its_baseline(space: str) -> None:
    resolved = load_space(space).resolve({})
    assert resolved.to_flags(resolved.defaults()) == {}


def test_a_shared_prefix_or_multi_turn_workload_keeps_prefix_caching_searched() -> None:
    from runners.workload import MultiTurn, SharedPrefix

    plain = Workload()
    shared = Workload(shared_prefix=SharedPrefix(fraction=0.8, num_tokens=1024))
    turns = Workload(multi_turn=MultiTurn(num_turns=3))
    assert workload_facts(plain)["shares_prefix"] is False
    assert workload_facts(shared)["shares_prefix"] is True
    assert workload_facts(shared)["max_prompt_tokens"] == 512 + 1024  # the prefix counts
    assert workload_facts(turns)["shares_prefix"] is True
    assert _domain(_resolve(workload=plain), "enable_prefix_caching") == (True,)
    assert set(_domain(_resolve(workload=shared), "enable_prefix_caching")) == {True, False}
