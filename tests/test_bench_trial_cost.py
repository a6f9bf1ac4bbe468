"""bench/trial_cost.py: the trials-per-hour replay drives the shipped policy, and its start-up
plan never compiles one key twice at once where the plain order does."""

from __future__ import annotations

from bench import trial_cost as bench


def test_the_plan_saves_the_duplicate_compiles_of_trials_run_side_by_side() -> None:
    knobs = bench.knob_configs(num=12)
    by_key = [knobs[0], *sorted(knobs[1:], key=lambda c: [str(c[k]) for k in bench.KEY_KNOBS])]
    before, after, isolated = (bench.replay_arm(by_key, arm, 2, 1) for arm in bench.ARMS[1:3]
                               + bench.ARMS[:1])
    keys = len({tuple(str(c[k]) for k in bench.KEY_KNOBS) for c in by_key})
    assert after["trials"] == before["trials"] == 12
    assert after["num_cold"] == keys, "one compile a key"
    assert before["num_cold"] > keys, "side by side, one key compiled twice"
    assert after["trials_per_hour"] > before["trials_per_hour"]
    assert isolated["num_cold"] == 12 and isolated["trials_per_hour"] < before["trials_per_hour"]
