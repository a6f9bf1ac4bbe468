"""Make `search_spaces/engine/flags_<minor>.json`, the tables `nightshift audit`, the study-file
check, the search spaces and `regress` read where vLLM is not installed (or is installed without
its GPU stack): every `vllm serve` flag (booleans apart, as argparse needs to know), its value
type, choices and bounds where the sources state them, its default where the sources state one, the
booleans whose False is spelled `--no-<flag>`, its short aliases, and the environment variables
that version reads. Read from a vLLM wheel's sources with `ast` (no import: vLLM needs torch and
a GPU stack). One wheel at a time (they are ~300 MB):

    python scripts/vllm_flag_table.py vllm-0.27.1-...whl search_spaces/engine/

A patch release whose table equals its minor's (flags, types, defaults, aliases, environment)
is added to that table's `releases`; one that differs gets its own
`flags_<version>.json`.

A flag's type comes from its `EngineArgs` / `FrontendArgs` annotation, as vLLM's own
`_compute_kwargs` derives the argparse type from it: `Literal` aliases are resolved across the
wheel's modules, bounds (`Field(gt=0, le=1)`) come from the config class its default names
(`CacheConfig.gpu_memory_utilization`). What cannot be read this way is typed "any" and checked
by name only. A default is the field's literal value, or the literal default of the config
field it names; None means vLLM decides at start-up (or the flag is unset). The CUDA-graph mode's
default is the one of `VllmConfig.optimization_level`'s level (`OPTIMIZATION_LEVEL_0N`).
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
# Where a release moved the frontend's arguments (0.29: launchers/cli_args.py, 0.33:
# common/cli_args.py), the module that defines `class FrontendArgs` stands in for it.
FRONTEND = "vllm/entrypoints/openai/cli_args.py"
CLASSES = {"EngineArgs", "AsyncEngineArgs", "FrontendArgs", "BaseFrontendArgs"}
# Flags vLLM parses with a human-readable int ("8k", "1G"); max_model_len also takes "auto".
HUMAN_READABLE = {"max_num_batched_tokens", "max_num_scheduled_tokens", "kv_cache_memory_bytes",
                  "safetensors_prefetch_block_size", "max_model_len"}
_BOUNDS = ("ge", "gt", "le", "lt")
# Defaults the sources leave None and settle at start-up, for a dense decoder-only generation
# model (what nightshift tunes): `_set_default_chunked_prefill_and_prefix_caching_args` turns
# both on where the model supports them and is not hybrid. Applied only where that function is
# in the release's arg_utils.py, so a release that moves the decision elsewhere is not assumed.
STARTUP_DEFAULTS = {"enable-chunked-prefill": True, "enable-prefix-caching": True}
_STARTUP_FUNCTION = "_set_default_chunked_prefill_and_prefix_caching_args"


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
        else:  # the release's own values (`QuantizationMethods`); a plugin may add others
            entry["known_values"] = choices
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


_NO_VALUE = object()


def _literal(node: ast.expr | None) -> Any:
    """A JSON-able literal (`1`, `"auto"`, `None`, `[1, 2]`), else `_NO_VALUE`."""
    if node is None:
        return _NO_VALUE
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return _NO_VALUE
    try:
        json.dumps(value)
    except TypeError:
        return _NO_VALUE
    return value


def _field_default(node: ast.expr | None) -> Any:
    """A config field's default: `x: int = 1`, `Field(default=1, ge=0)`, `field(default=1)`."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "Field", "pydantic.Field", "field", "dataclasses.field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return _literal(kw.value)
        return _literal(node.args[0]) if node.args else _NO_VALUE
    return _literal(node)


def _config_defaults(trees: dict[str, ast.Module]) -> dict[tuple[str, str], Any]:
    """(ConfigClass, field) -> its literal default, for every config class in vllm/config/."""
    out: dict[tuple[str, str], Any] = {}
    for path, tree in trees.items():
        if not path.startswith("vllm/config/"):
            continue
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    value = _field_default(item.value)
                    if value is not _NO_VALUE:
                        out[(cls.name, item.target.id)] = value
    return out


def _cudagraph_default(trees: dict[str, ast.Module]) -> str | None:
    """`compilation_config.cudagraph_mode` with no flag: the mode of the optimization level
    `VllmConfig.optimization_level` defaults to (`OPTIMIZATION_LEVEL_02[...]["cudagraph_mode"]`
    in vllm/config/vllm.py); None where the sources do not say it this way."""
    tree = trees.get("vllm/config/vllm.py")
    if tree is None:
        return None
    level = None
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmConfig"):
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                    item.target.id == "optimization_level" and \
                    isinstance(item.value, ast.Attribute):
                level = item.value.attr  # O2
    if level is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id == f"OPTIMIZATION_LEVEL_{level[1:].zfill(2)}" and \
                isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "compilation_config" and \
                        isinstance(value, ast.Dict):
                    for k, v in zip(value.keys, value.values, strict=True):
                        if isinstance(k, ast.Constant) and k.value == "cudagraph_mode" and \
                                isinstance(v, ast.Attribute):
                            return v.attr
    return None


def _env_vars(tree: ast.Module) -> tuple[list[str], dict[str, str]]:
    """The `VLLM_*` variables envs.py reads (its `environment_variables` mapping; every mapping
    where it has none), and those it names as removed (`removed_environment_variables`, 0.34:
    name -> the hint vLLM raises with)."""
    tables: dict[str, ast.Dict] = {}
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            tables[target.id] = value
    read = [tables["environment_variables"]] if "environment_variables" in tables else \
        [n for n in ast.walk(tree) if isinstance(n, ast.Dict)]
    env = sorted({k.value for d in read for k in d.keys if isinstance(k, ast.Constant)
                  and isinstance(k.value, str) and k.value.startswith("VLLM_")})
    removed: dict[str, str] = {}
    if "removed_environment_variables" in tables:
        for key, value in zip(tables["removed_environment_variables"].keys,
                              tables["removed_environment_variables"].values, strict=True):
            hint = _literal(value)
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                removed[key.value] = hint if isinstance(hint, str) else ""
    return env, dict(sorted(removed.items()))


def _read_sources(source: Path) -> tuple[dict[str, str], str]:
    """The wheel's (or an unpacked wheel directory's) `vllm/**.py` texts and its METADATA."""
    texts: dict[str, str] = {}
    metadata = ""
    if source.is_dir():
        for path in sorted(source.rglob("*")):
            name = path.relative_to(source).as_posix()
            if name.startswith("vllm/") and name.endswith(".py"):
                texts[name] = path.read_text(encoding="utf-8", errors="replace")
            elif name.endswith(".dist-info/METADATA"):
                metadata = path.read_text(encoding="utf-8")
        return texts, metadata
    with zipfile.ZipFile(source) as zf:
        for info in zf.infolist():
            if info.filename.startswith("vllm/") and info.filename.endswith(".py"):
                texts[info.filename] = zf.read(info.filename).decode(errors="replace")
            elif info.filename.endswith(".dist-info/METADATA"):
                metadata = zf.read(info.filename).decode()
    return texts, metadata


def table(source: Path) -> dict[str, Any]:
    """The flag table of the vLLM wheel (or unpacked wheel) `source`."""
    texts, metadata = _read_sources(source)
    frontend = next((name for name in sorted(texts) if name.startswith("vllm/entrypoints/")
                     and "\nclass FrontendArgs" in texts[name]), FRONTEND)
    sources = tuple(frontend if name == FRONTEND else name for name in SOURCES)
    trees = {}
    for name, text in texts.items():
        try:
            trees[name] = ast.parse(text)
        except SyntaxError:
            continue
    found = re.search(r"^Version: (\S+)$", metadata, re.MULTILINE) or \
        re.search(r"vllm-([\d.]+)", source.name)
    version = found.group(1) if found else "?"
    label = f"the vllm {version} wheel, unpacked" if source.is_dir() else source.name
    aliases_by_name = _literal_aliases(trees)
    bounds_by_field = _config_bounds(trees)
    defaults_by_field = _config_defaults(trees)
    flags: dict[str, str] = {}
    types: dict[str, dict[str, Any]] = {}
    defaults: dict[str, Any] = {}
    negatable: set[str] = set()
    config_fields: dict[str, str] = {}  # flag -> the config field its default names
    for name in sources:
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.ClassDef) and node.name in CLASSES:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and not item.target.id.startswith("_"):
                        annotation = ast.unparse(item.annotation)
                        kind = "bool" if re.fullmatch(r"bool( \| None)?", annotation) else "value"
                        field = item.target.id
                        kebab = field.replace("_", "-")
                        flags[kebab] = kind
                        choices: list[Any] = []
                        entry = _flag_type(_kinds(item.annotation, aliases_by_name, choices),
                                           choices, field)
                        source_field = _default_source(item.value, field)
                        default = _literal(item.value)
                        if default is _NO_VALUE and source_field is not None:
                            default = defaults_by_field.get(source_field, _NO_VALUE)
                        if default is not _NO_VALUE:
                            defaults[kebab] = default
                        if source_field is not None:
                            config_fields[kebab] = ".".join(source_field)
                        # vLLM gives every dataclass boolean a `--no-` form; it differs from
                        # leaving the flag out where the default is on or decided at start-up.
                        if kind == "bool" and default in (True, None):
                            negatable.add(kebab)
                        if source_field is None:  # `max_num_seqs: int | None = None`: by name
                            owners = [k for k in bounds_by_field if k[1] == field]
                            source_field = owners[0] if len(owners) == 1 else None
                        if source_field is not None and source_field in bounds_by_field:
                            entry.update(bounds_by_field[source_field])
                        types[kebab] = entry
    joined = "\n".join(texts[name] for name in sources)
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)"', joined):
        flags.setdefault(flag, "value")
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)",[^)]*?action="store_true"', joined,
                           re.DOTALL):
        flags[flag] = "bool"
        types[flag] = {"type": "bool", "nullable": False}
        defaults[flag] = False
        negatable.discard(flag)  # store_true: no `--no-` form
    aliases = dict((short, long) for long, short in re.findall(
        r'"--([a-z0-9-]+)",\s*"(-[a-zA-Z]+)"', joined))
    env, removed_env = _env_vars(trees["vllm/envs.py"])
    if f"def {_STARTUP_FUNCTION}(" in texts["vllm/engine/arg_utils.py"]:
        defaults.update({k: v for k, v in STARTUP_DEFAULTS.items()
                         if k in flags and defaults.get(k) is None})
    # 0.34: `--gpu-memory-utilization` unset is decided at start-up: 1.0 with the extensible
    # KV cache, which is on for a plain CUDA launch (config/cache.py
    # resolved_gpu_memory_utilization, config/vllm.py), else 0.92.
    extensible = re.search(r"if self\.enable_extensible_kv_cache:\s*return ([\d.]+)",
                           texts.get("vllm/config/cache.py", ""))
    if extensible and defaults.get("gpu-memory-utilization", 0) is None:
        defaults["gpu-memory-utilization"] = float(extensible.group(1))
    cudagraph = _cudagraph_default(trees)
    if cudagraph is not None and "compilation-config" in flags:
        defaults["compilation-config.cudagraph_mode"] = cudagraph
    requires = {m.group(1).lower(): m.group(2).strip() for m in re.finditer(
        r"^Requires-Dist: (torch|torchaudio|torchvision|triton|ray|transformers)\b([^;\n]*)",
        metadata, re.MULTILINE) if "extra ==" not in m.group(0)}
    return {
        "vllm_version": version, "releases": [version],
        "source": f"{label}: {', '.join(sources)}, vllm/config/, vllm/envs.py "
                  "(scripts/vllm_flag_table.py)",
        "requires": {version: dict(sorted(requires.items()))},  # per release, from METADATA
        "flags": dict(sorted(flags.items())), "aliases": dict(sorted(aliases.items())),
        "env_vars": env,
        **({"removed_env_vars": removed_env} if removed_env else {}),
        "types": {k: types.get(k, {"type": "any", "nullable": True}) for k in sorted(flags)},
        "negatable": sorted(negatable),
        # A flag removed in one release and a flag added in it that names the same config
        # field is a rename (search_spaces.engine.releases.flag_change reads it).
        "config_fields": dict(sorted(config_fields.items())),
        "defaults": {k: defaults[k] for k in sorted(defaults)},
        "defaults_source": "the sources' literal defaults (EngineArgs / FrontendArgs fields, or "
                           "the vllm/config/ field they name); null: decided by vLLM at start-up "
                           "or unset. enable-chunked-prefill / enable-prefix-caching: "
                           f"on for a dense generation model ({_STARTUP_FUNCTION}). "
                           + ("gpu-memory-utilization, which the sources leave unset: the "
                              "value with the extensible KV cache, on for a plain CUDA launch "
                              "(config/cache.py resolved_gpu_memory_utilization). "
                              if extensible else "") +
                           "compilation-config.cudagraph_mode: the mode of "
                           "VllmConfig.optimization_level's default level (vllm/config/vllm.py)",
    }


_SAME = ("flags", "aliases", "env_vars", "types", "negatable", "defaults", "config_fields",
         "removed_env_vars")


def main(source: Path, out_dir: Path) -> int:
    new = table(source)
    version = new["vllm_version"]
    minor = ".".join(version.split(".")[:2])
    out = out_dir / f"flags_{minor}.json"
    if out.is_file():
        old = json.loads(out.read_text())
        if version not in old.get("releases", [old["vllm_version"]]):
            if all(old.get(k) == new.get(k) for k in _SAME):
                old["releases"] = sorted({*old["releases"], version},
                                         key=lambda v: [int(x) for x in v.split(".")])
                old["requires"] = {**old.get("requires", {}), **new["requires"]}
                new = old
            else:  # the patch release changed a flag: its own table
                out = out_dir / f"flags_{version}.json"
    out.write_text(json.dumps(new, indent=1) + "\n")
    print(f"{out}: vLLM {version}, {len(new['flags'])} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
