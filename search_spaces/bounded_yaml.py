"""A bounded YAML loader for the files users hand nightshift (study files, search spaces): a
duplicate key, nesting beyond a few dozen levels, an alias bomb or a value containing itself is
an error with its line, never a silent last-wins value or a runaway in memory; and the one
wording of a YAML refusal (`yaml_message`) every such file's error shares."""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 20_000  # after alias expansion: a YAML alias bomb stops here


class YamlLimitError(yaml.YAMLError):
    """A file beyond what a study or space needs: too deep, too many nodes, a duplicate key,
    a value that contains itself. `problem` is one line, `problem_mark` where it is."""

    def __init__(self, message: str, mark: Any) -> None:
        super().__init__(message)
        self.problem = message
        self.problem_mark = mark


class BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader, less what lets a study or space file say something else than it
    seems or take unbounded memory: a duplicate key (YAML keeps the last silently), nesting
    beyond MAX_YAML_DEPTH, more than MAX_YAML_NODES nodes once aliases are expanded (an alias
    bomb is a few lines that expand to billions)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its size with aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        peek: Any = self.peek_event
        if self.check_event(yaml.AliasEvent):
            event = peek()
            anchored = self.anchors.get(event.anchor)
            if anchored is not None and id(anchored) not in self._sizes:
                raise YamlLimitError(f"alias *{event.anchor} is used inside the value it names (a "
                                 "value that contains itself); write it out", event.start_mark)
            if anchored is not None:
                self._count(self._sizes[id(anchored)], event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_YAML_DEPTH} levels; a study or "
                             "space file is a few levels deep", peek().start_mark)
        before = self._nodes
        node: Any = super().compose_node(parent, index)
        self._depth -= 1
        self._count(1, node.start_mark)
        self._sizes[id(node)] = self._nodes - before
        return node

    def _count(self, size: int, mark: Any) -> None:
        self._nodes += size
        if self._nodes > MAX_YAML_NODES:
            raise YamlLimitError(f"more than {MAX_YAML_NODES:,} values once aliases are expanded "
                             "(an alias bomb?); write the values out", mark)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise YamlLimitError(f"duplicate key {key!r:.60} (YAML would keep "
                                             "only the last); keep one", key_node.start_mark)
                    seen.add(key)
                except TypeError:
                    continue  # an unhashable key: the base class says so
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads `1e3` and `1.5e-3` as strings: its floats need a dot and a signed
# exponent. Read them as the numbers YAML 1.2 and every user mean.
BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str) -> Any:
    """A YAML document through `BoundedLoader`; raises yaml.YAMLError (YamlLimitError for
    what the loader bounds)."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_message(exc: yaml.YAMLError, source: str, text: str) -> str:
    """A YAML parser's refusal of `text`, the file `source`, as one line: where it is (line and
    column, counted from 1), what is wrong and the fix: a character YAML does not allow, a
    syntax error, or one of `load_yaml`'s limits, whose problem says its fix. The one wording
    of the study file's, a search space's and a benchmark library's YAML errors."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        return (f"{source}: not valid YAML at line {line}, column {column}: character "
                f"#x{exc.character:04x} is not allowed in YAML text; remove it.")
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if isinstance(exc, YamlLimitError):
        return f"{source}{where}: {problem[:200]}."
    return f"{source}: not valid YAML{where}: {problem[:200]}; fix the syntax."
