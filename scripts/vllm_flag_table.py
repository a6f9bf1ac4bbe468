"""Make `runners/vllm/flags_<version>.json`, the table `nightshift audit` and the study-file check
read where vLLM is not installed: every `vllm serve` flag (booleans apart, as argparse needs to
know), its value type, choices and bounds where the sources state them, its short aliases, and the
environment variables that version reads. Read from a vLLM wheel's sources with `ast` (no import:
vLLM needs torch and a GPU stack).

    python scripts/vllm_flag_table.py vllm-0.26.0-...whl runners/vllm/flags_0.26.json

A flag's type comes from its `EngineArgs` / `FrontendArgs` annotation, as vLLM's own
`_compute_kwargs` derives the argparse type from it: `Literal` aliases are resolved across the
wheel's modules, bounds (`Field(gt=0, le=1)`) come from the config class its default names
(`CacheConfig.gpu_memory_utilization`). What cannot be read this way is typed "any" and checked
by name only.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

SOURCES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py",
           "vllm/entrypoints/cli/serve.py")
CLASSES = {"EngineArgs", "AsyncEngineArgs", "FrontendArgs", "BaseFrontendArgs"}
# Flags vLLM parses with a human-readable int ("8k", "1G"); max_model_len also takes "auto".
HUMAN_READABLE = {"max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
                  "safetensors_prefetch_block_size", "max_model_len"}
_BOUNDS = ("ge", "gt", "le", "lt")


def _literal_aliases(trees: dict[str, ast.Module]) -> dict[str, list[Any]]:
    """`CacheDType = Literal["auto", ...]` anywhere in the wheel: name -> values (first wins)."""
    out: dict[str, list[Any]] = {}
    for tree in trees.values():
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                target, value = node.target.id, node.value
            if target is None or value is None:
                continue
            values = _literal_values(value)
            if values is not None:
                out.setdefault(target, values)
    return out


def _literal_values(node: ast.expr) -> list[Any] | None:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and \
            node.value.id == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        values = [e.value for e in elts if isinstance(e, ast.Constant)]
        return values if len(values) == len(elts) else None
    return None


def _kinds(node: ast.expr, aliases: dict[str, list[Any]], choices: list[Any]) -> set[str]:
    """The base kinds a type annotation allows: int, float, bool, str, none, choice, list,
    json, any."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _kinds(node.left, aliases, choices) | _kinds(node.right, aliases, choices)
    if isinstance(node, ast.Constant) and node.value is None:
        return {"none"}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        return _kinds(ast.parse(node.value, mode="eval").body, aliases, choices)
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value)
        values = _literal_values(node)
        if values is not None:
            choices.extend(values)
            return {"choice"}
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head in ("Optional", "typing.Optional"):
            return _kinds(args[0], aliases, choices) | {"none"}
        if head in ("Union", "typing.Union"):
            return set().union(*(_kinds(a, aliases, choices) for a in args))
        if head in ("Annotated", "typing.Annotated"):
            return _kinds(args[0], aliases, choices)
        if head in ("list", "tuple", "set", "List", "Tuple", "Set"):
            return {"list"}
        if head in ("dict", "Dict", "Mapping"):
            return {"json"}
        return {"any"}
    if isinstance(node, ast.Name):
        name = node.id
        if name in ("int", "float", "bool", "str"):
            return {name}
        if name in aliases:
            choices.extend(aliases[name])
            return {"choice"}
        if name in ("dict",):
            return {"json"}
        if name.endswith("Config") or name.endswith("Args"):
            return {"json"}
        return {"any"}
    return {"any"}


def _flag_type(kinds: set[str], choices: list[Any], name: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"nullable": "none" in kinds}
    kinds = kinds - {"none"}
    if kinds == {"bool", "str"}:
        entry["type"] = "str"  # bare flag = True, or a value
    elif "bool" in kinds:
        entry["type"] = "bool"
    elif "choice" in kinds:
        # A free string beside the literals (`str | LoadFormats`) makes the choices advisory.
        entry["type"] = "str" if "str" in kinds or "any" in kinds else "choice"
        if entry["type"] == "choice":
            entry["choices"] = choices
    elif "list" in kinds:
        entry["type"] = "list"
    elif "int" in kinds and kinds <= {"int", "float"} | ({"str"} if name in HUMAN_READABLE
                                                          else set()):
        entry["type"] = "int"
    elif "int" in kinds:
        entry["type"] = "any"
    elif kinds == {"float"}:
        entry["type"] = "float"
    elif "json" in kinds:
        entry["type"] = "json"
    elif kinds == {"str"}:
        entry["type"] = "str"
    else:
        entry["type"] = "any"
    if name in HUMAN_READABLE:
        entry["human_readable"] = True
    return entry


def _config_bounds(trees: dict[str, ast.Module]) -> dict[tuple[str, str], dict[str, float]]:
    """(ConfigClass, field) -> {ge: 1, ...} from `Field(default=..., ge=1)` in vllm/config/."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for path, tree in trees.items():
        if not path.startswith("vllm/config/"):
            continue
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and isinstance(item.value, ast.Call)
                        and ast.unparse(item.value.func) in ("Field", "pydantic.Field")):
                    continue
                bounds = {}
                for kw in item.value.keywords:
                    if kw.arg in _BOUNDS:
                        try:
                            value = ast.literal_eval(kw.value)
                        except ValueError:
                            continue
                        if isinstance(value, int | float) and not isinstance(value, bool):
                            bounds[kw.arg] = value
                if bounds:
                    out[(cls.name, item.target.id)] = bounds
    return out


def _default_source(value: ast.expr | None, name: str) -> tuple[str, str] | None:
    """`CacheConfig.gpu_memory_utilization` or `get_field(CacheConfig, "x")` -> the pair."""
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
        return value.value.id, value.attr
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "get_field" and \
            len(value.args) == 2 and isinstance(value.args[0], ast.Name) and \
            isinstance(value.args[1], ast.Constant):
        return value.args[0].id, str(value.args[1].value)
    return None


def main(wheel: Path, out: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        trees = {}
        for info in zf.infolist():
            if info.filename.startswith("vllm/") and info.filename.endswith(".py"):
                try:
                    trees[info.filename] = ast.parse(zf.read(info.filename).decode())
                except (SyntaxError, UnicodeDecodeError):
                    continue
        texts = {name: zf.read(name).decode() for name in (*SOURCES, "vllm/envs.py")}
    version = re.search(r"vllm-([\d.]+)", wheel.name)
    aliases_by_name = _literal_aliases(trees)
    bounds_by_field = _config_bounds(trees)
    flags: dict[str, str] = {}
    types: dict[str, dict[str, Any]] = {}
    for name in SOURCES:
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.ClassDef) and node.name in CLASSES:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and not item.target.id.startswith("_"):
                        annotation = ast.unparse(item.annotation)
                        kind = "bool" if re.fullmatch(r"bool( \| None)?", annotation) else "value"
                        field = item.target.id
                        flags[field.replace("_", "-")] = kind
                        choices: list[Any] = []
                        entry = _flag_type(_kinds(item.annotation, aliases_by_name, choices),
                                           choices, field)
                        source = _default_source(item.value, field)
                        if source is None:  # `max_num_seqs: int | None = None`: by name
                            owners = [k for k in bounds_by_field if k[1] == field]
                            source = owners[0] if len(owners) == 1 else None
                        if source is not None and source in bounds_by_field:
                            entry.update(bounds_by_field[source])
                        types[field.replace("_", "-")] = entry
    joined = "\n".join(texts[name] for name in SOURCES)
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)"', joined):
        flags.setdefault(flag, "value")
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)",[^)]*?action="store_true"', joined,
                           re.DOTALL):
        flags[flag] = "bool"
        types[flag] = {"type": "bool", "nullable": False}
    aliases = dict((short, long) for long, short in re.findall(
        r'"--([a-z0-9-]+)",\s*"(-[a-zA-Z]+)"', joined))
    env = sorted({k.value for node in ast.walk(ast.parse(texts["vllm/envs.py"]))
                  if isinstance(node, ast.Dict) for k in node.keys
                  if isinstance(k, ast.Constant) and isinstance(k.value, str)
                  and k.value.startswith("VLLM_")})
    # The defaults and negatable booleans are kept by hand (the wheel's dataclass defaults are
    # often None, resolved at start-up): carried over from the table being replaced.
    kept = json.loads(out.read_text()) if out.is_file() else {}
    out.write_text(json.dumps({
        "vllm_version": version.group(1) if version else "?",
        "source": f"{wheel.name}: {', '.join(SOURCES)}, vllm/envs.py (scripts/vllm_flag_table.py)",
        "flags": dict(sorted(flags.items())), "aliases": dict(sorted(aliases.items())),
        "env_vars": env,
        "types": {k: types.get(k, {"type": "any", "nullable": True}) for k in sorted(flags)},
        **{k: kept[k] for k in ("negatable", "defaults", "defaults_source") if k in kept}},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
