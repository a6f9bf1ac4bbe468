"""Make `runners/vllm_flags_<version>.json`, the table `nightshift audit` reads where vLLM is not
installed: every `vllm serve` flag (booleans apart, as argparse needs to know), its short
aliases, and the environment variables that version reads. Read from a vLLM wheel's sources
with `ast` (no import: vLLM needs torch and a GPU stack).

    python scripts/vllm_flag_table.py vllm-0.26.0-...whl runners/vllm_flags_0.26.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

SOURCES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py",
           "vllm/entrypoints/cli/serve.py")
CLASSES = {"EngineArgs", "AsyncEngineArgs", "FrontendArgs", "BaseFrontendArgs"}


def main(wheel: Path, out: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        texts = {name: zf.read(name).decode() for name in (*SOURCES, "vllm/envs.py")}
    version = re.search(r"vllm-([\d.]+)", wheel.name)
    flags: dict[str, str] = {}
    for name in SOURCES:
        for node in ast.walk(ast.parse(texts[name])):
            if isinstance(node, ast.ClassDef) and node.name in CLASSES:
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and not item.target.id.startswith("_"):
                        annotation = ast.unparse(item.annotation)
                        kind = "bool" if re.fullmatch(r"bool( \| None)?", annotation) else "value"
                        flags[item.target.id.replace("_", "-")] = kind
    joined = "\n".join(texts[name] for name in SOURCES)
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)"', joined):
        flags.setdefault(flag, "value")
    for flag in re.findall(r'add_argument\(\s*"--([a-z0-9-]+)",[^)]*?action="store_true"', joined,
                           re.DOTALL):
        flags[flag] = "bool"
    aliases = dict((short, long) for long, short in re.findall(
        r'"--([a-z0-9-]+)",\s*"(-[a-zA-Z]+)"', joined))
    env = sorted({k.value for node in ast.walk(ast.parse(texts["vllm/envs.py"]))
                  if isinstance(node, ast.Dict) for k in node.keys
                  if isinstance(k, ast.Constant) and isinstance(k.value, str)
                  and k.value.startswith("VLLM_")})
    out.write_text(json.dumps({
        "vllm_version": version.group(1) if version else "?",
        "source": f"{wheel.name}: {', '.join(SOURCES)}, vllm/envs.py (scripts/vllm_flag_table.py)",
        "flags": dict(sorted(flags.items())), "aliases": dict(sorted(aliases.items())),
        "env_vars": env}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
