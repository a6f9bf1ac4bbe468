"""The YAML loader for user files (study files, search spaces): what YAML would take silently or
without bound is an error with its line; every such file's YAML refusal is worded alike."""

from __future__ import annotations

import pytest
import yaml

from search_spaces.bounded_yaml import MAX_YAML_DEPTH, YamlLimitError, load_yaml, yaml_message


def test_plain_yaml_and_merge_keys_load_as_yaml_loads_them() -> None:
    text = "a: &x {k: 1, j: [1, 2]}\nb: {<<: *x, j: 3}\nc: *x\n"
    assert load_yaml(text) == yaml.safe_load(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("a: 1e3", 1000.0), ("a: -2.5E-3", -0.0025), ("a: 1e400", float("inf")),
    ("a: '1e3'", "1e3"), ("a: x1e3", "x1e3"), ("a: 1.0e+3", 1000.0), ("a: 12", 12),
])
def test_a_number_with_an_exponent_is_a_number_as_yaml_1_2_reads_it(
        text: str, expected: object) -> None:
    # YAML 1.1 read `1e3` as the string '1e3': `trials: 1e3` was "not a valid integer but got
    # '1e3'", a rate of 1e-3 "not a valid number".
    assert load_yaml(text) == {"a": expected}


@pytest.mark.parametrize(("text", "expected"), [
    ("a: 1\nb: 2\na: 3\n", "duplicate key 'a'"),
    ("a: {x: 1, x: 1}\n", "duplicate key 'x'"),
    ("a: " + "[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1) + "\n", "nested deeper"),
    ("a: &a [*a]\n", "used inside the value it names"),
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"b{i}: &b{i} [" + ", ".join([f"*{'a' if i == 0 else f'b{i - 1}'}"] * 10) + "]\n"
        for i in range(4)), "once aliases are expanded"),
])
def test_what_yaml_takes_silently_or_without_bound_is_refused_with_its_line(
        text: str, expected: str) -> None:
    with pytest.raises(YamlLimitError) as info:
        load_yaml(text)
    assert expected in str(info.value.problem)
    assert info.value.problem_mark is not None, "the error says where"


def test_a_search_space_with_a_duplicate_param_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    from search_spaces import SpaceError, load_space

    path = Path(str(tmp_path)) / "space.yaml"
    path.write_text("parameters:\n  max_num_seqs: {type: categorical, choices: [64]}\n"
                    "  max_num_seqs: {type: categorical, choices: [8]}\n")
    with pytest.raises(SpaceError, match="line 3, column 3: duplicate key 'max_num_seqs'"):
        load_space(path)


@pytest.mark.parametrize(("text", "message"), [
    ("a: [1, 2\n", "s.yaml: not valid YAML at line 2, column 1: expected ',' or ']', but got "
     "'<stream end>'; fix the syntax."),
    ("a: 1\nb: \x07\n", "s.yaml: not valid YAML at line 2, column 4: character #x0007 is not "
     "allowed in YAML text; remove it."),
    ("a: 1\na: 2\n", "s.yaml at line 2, column 1: duplicate key 'a' (YAML would keep only the "
     "last); keep one."),
], ids=["syntax", "a character YAML refuses", "a limit of load_yaml"])
def test_a_yaml_refusal_reads_as_one_line_with_its_line_column_and_fix(
        text: str, message: str) -> None:
    with pytest.raises(yaml.YAMLError) as info:
        load_yaml(text)
    assert yaml_message(info.value, "s.yaml", text) == message


@pytest.mark.parametrize("text", ["parameters: [unclosed\n", "name: x\nname: y\n",
                                  "name: \x07\n"], ids=["syntax", "a limit", "a character"])
def test_a_search_spaces_yaml_error_reads_as_the_study_files_does(
        tmp_path: object, text: str) -> None:
    """search_spaces/loading.py worded its YAML errors its own way ("(problem)" in brackets, cut
    at 80 characters, no line for a refused character): one wording for both files now."""
    from pathlib import Path

    from optimizer.config import load_study
    from optimizer.errors import ConfigError
    from search_spaces import SpaceError, load_space

    folder = Path(str(tmp_path))
    (folder / "space.yaml").write_text(text, encoding="utf-8")
    (folder / "study.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(SpaceError) as space:
        load_space(folder / "space.yaml")
    with pytest.raises(ConfigError) as study:
        load_study(folder / "study.yaml")
    assert str(space.value) == str(study.value).replace("study.yaml", str(folder / "space.yaml"))
    assert "line 1, column" in str(space.value) or "line 2, column" in str(space.value)
    assert isinstance(space.value.__cause__, yaml.YAMLError), "the parser's error is chained"
