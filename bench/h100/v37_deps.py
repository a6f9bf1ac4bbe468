"""Which requirements of an installed distribution (and of theirs, recursively) the Python path
lacks or holds at another version: the dependency closure pip's `--no-deps` installs skip.

    PYTHONPATH=/tmp/site37:/tmp/site python3 bench/h100/v37_deps.py vllm

Reads only metadata (nothing is imported). Prints one line per problem and a count; exits 0 (a
missing optional-at-run-time package, such as one only a model family imports, is not an error).
"""

from __future__ import annotations

import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # the image's pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]


def problems(root: str) -> list[str]:
    found: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str], str]] = [(root, frozenset(), "")]
    while todo:
        name, extras, parent = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found.append(f"missing  {name}  (needed by {parent})")
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                todo.append((req.name, frozenset(req.extras), f"{dist.metadata['Name']}"))
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                found.append(f"version  {req.name} {have} where {dist.metadata['Name']} "
                             f"{dist.version} asks {req.specifier}")
            todo.append((req.name, frozenset(req.extras), dist.metadata["Name"]))
    return found


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    lines = problems(root)
    for line in sorted(lines):
        print(line)
    print(f"{root} {metadata.version(root)}: {len(lines)} requirement problem(s) on this path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
