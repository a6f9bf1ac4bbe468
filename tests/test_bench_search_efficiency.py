"""bench/search_efficiency.py: three seeds a policy over the cached grids end in one line a
grid, and its statistics say "no edge" for two identical samples and an edge for a clear one."""

from __future__ import annotations

import re

import pytest

from bench import search_efficiency as bench

LINE = re.compile(r"^(?P<grid>[\w-]+): shipped/random median GPU-s to within 3% = "
                  r"(?P<r>[\d.]+) \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\] \(bootstrap 95%\), "
                  r"Mann-Whitney p = (?P<p>[\d.e+-]+)$")


def test_three_seeds_end_in_one_line_a_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--seeds", "3", "--grid", "h200-measured", "--grid",
                       "shared-prefix"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [LINE.match(line)["grid"] for line in lines] == [  # type: ignore[index]
        "h200-measured", "shared-prefix"]


def test_identical_samples_show_no_edge_and_a_clear_one_does() -> None:
    same = bench.compare([100.0, 200.0, 300.0] * 10, [100.0, 200.0, 300.0] * 10)
    assert same["ratio"] == 1.0 and same["lo"] <= 1.0 <= same["hi"] and same["p"] > 0.5
    clear = bench.compare([100.0, 110.0, 120.0] * 10, [300.0, 330.0, 360.0] * 10)
    assert clear["hi"] < 1.0 and clear["p"] < 0.001


def test_fewer_than_two_seeds_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--seeds", "1"])
    assert exc.value.code == 2
