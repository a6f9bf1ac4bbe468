"""The output-quality evaluation: `compare` on hand-made samples (pure), and the client against
the simulated engine as a real process (its logprobs are a model: the test checks the path and
the ordering, floor < fp8 KV < fp8 weights, not values)."""

from __future__ import annotations

import json
import math

import pytest

from runners.quality_eval import (
    PromptSample,
    QualityRun,
    QualitySample,
    changes_numerics,
    compare,
    corpus,
    lumped_kl,
    measure,
    run_eval,
)
from runners.workload import QualityEval
from tests.runners.test_simulated_server import _wait_healthy, launch  # noqa: F401


def _prompt(prompt_lps: list[float], tops: list[dict[int, float]], greedy: list[int],
            greedy_tops: list[dict[int, float]] | None = None) -> PromptSample:
    ids = tuple(range(100, 101 + len(prompt_lps)))
    return PromptSample(prompt_token_ids=ids, prompt_logprobs=tuple(prompt_lps),
                        prompt_top=tuple(tops), greedy_token_ids=tuple(greedy),
                        greedy_text="", greedy_top=tuple(greedy_tops or [{} for _ in greedy]))


def _sample(*prompts: PromptSample) -> QualitySample:
    return QualitySample(mode="all_at_once", top_k=2, max_tokens=3, prompts=prompts)


def test_identical_samples_score_zero_change_full_agreement():
    top = {1: math.log(0.6), 2: math.log(0.3)}
    sample = _sample(_prompt([-0.5, -1.2], [top, top], [1, 2, 3], [top, top, top]))
    scores = compare(sample, sample)
    assert scores.ppl_increase == 0.0 and scores.mean_kl == 0.0, scores
    assert scores.top1_agreement == 1.0 and scores.greedy_match_tokens == 3.0, scores
    assert scores.num_positions == 5, "2 prompt positions + 3 greedy positions (no divergence)"


def test_lumped_kl_is_the_kl_of_shared_tokens_plus_the_rest_bucket():
    p = {1: math.log(0.5), 2: math.log(0.3), 7: math.log(0.1)}  # 7 only on P's side: lumped
    q = {1: math.log(0.4), 2: math.log(0.4), 9: math.log(0.1)}
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.2)
    assert lumped_kl(p, q) == pytest.approx(expected, abs=1e-12)
    assert lumped_kl(p, p) == pytest.approx(0.0, abs=1e-15)


def test_compare_gives_known_perplexity_change_agreement_and_match_length():
    ref_top = {1: math.log(0.6), 2: math.log(0.3)}
    flipped = {1: math.log(0.3), 2: math.log(0.6)}
    reference = _sample(_prompt([-1.0, -1.0], [ref_top, ref_top], [5, 6, 7],
                                [ref_top, ref_top, ref_top]))
    # Perplexity up by exp(0.1); second prompt position flips its top-1; greedy diverges at 1.
    sample = _sample(_prompt([-1.1, -1.1], [ref_top, flipped], [5, 8, 7],
                             [ref_top, ref_top, ref_top]))
    scores = compare(sample, reference)
    assert scores.ppl_increase == pytest.approx(math.exp(0.1) - 1.0)
    assert scores.greedy_match_tokens == 1.0
    # positions: 2 prompt + greedy up to and including the first divergence (2) = 4
    assert scores.num_positions == 4
    assert scores.top1_agreement == pytest.approx(3 / 4)
    assert scores.mean_kl == pytest.approx(lumped_kl(ref_top, flipped) / 4)


def test_compare_refuses_samples_of_other_prompts():
    a = _sample(_prompt([-1.0], [{1: -0.1}], [1]))
    b = _sample(_prompt([-1.0], [{1: -0.1}], [1]), _prompt([-1.0], [{1: -0.1}], [1]))
    with pytest.raises(ValueError, match="differ in prompts"):
        compare(a, b)


def test_numerics_change_only_for_weights_kv_and_dtype_flags():
    defaults = {"quantization": "none", "kv_cache_dtype": "auto", "max_num_seqs": 256}
    assert changes_numerics({"max_num_seqs": 64}, defaults) == []
    assert changes_numerics({"quantization": "fp8", "kv_cache_dtype": "fp8"}, defaults) == \
        ["quantization", "kv_cache_dtype"]


def test_corpus_is_a_few_dozen_distinct_prompts():
    prompts = corpus()
    assert 32 <= len(prompts) <= 64 and len(set(prompts)) == len(prompts)


def test_simulated_engine_answers_logprobs_and_orders_floor_below_fp8(launch, tmp_path):  # noqa: F811
    spec = QualityEval(num_prompts=6, max_tokens=6, top_k=4, measure_floor=True)
    reference_engine = launch()
    kv_engine = launch({"kv_cache_dtype": "fp8"})
    weights_engine = launch({"quantization": "fp8"})
    for engine in (reference_engine, kv_engine, weights_engine):
        _wait_healthy(engine)
    run = run_eval(reference_engine.url, "sim", spec, tmp_path)
    assert run.error == "" and run.one_at_a_time and run.all_at_once, run.error
    written = QualityRun.from_dict(json.loads((tmp_path / "quality.json").read_text()))
    assert written.one_at_a_time == run.one_at_a_time, "quality.json round-trips the sample"
    first = run.one_at_a_time.prompts[0]
    assert len(first.greedy_token_ids) == 6 and len(first.greedy_top[0]) == 4
    assert len(first.prompt_logprobs) == len(first.prompt_token_ids) - 1
    floor = compare(run.all_at_once, run.one_at_a_time)
    kv = compare(measure(kv_engine.url, "sim", spec, "all_at_once"), run.one_at_a_time)
    weights = compare(measure(weights_engine.url, "sim", spec, "all_at_once"),
                      run.one_at_a_time)
    assert 0.0 < floor.mean_kl < kv.mean_kl < weights.mean_kl, (floor, kv, weights)
    assert weights.ppl_increase > abs(floor.ppl_increase), (floor, weights)
    again = compare(measure(reference_engine.url, "sim", spec, "one_at_a_time"),
                    run.one_at_a_time)
    assert again.mean_kl == 0.0, "one at a time, the reference engine repeats itself exactly"
