"""`installed_flags` reads the installed vLLM's own parser, and answers None (the bundled table
serves) wherever that vLLM cannot build it on this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runners.vllm.flags import installed_flags


def _fake_vllm(root: Path, make_arg_parser_body: str) -> None:
    """A vLLM package on disk with just the modules `installed_flags` imports."""
    files = {
        "vllm/__init__.py": '__version__ = "0.32.0"\n',
        "vllm/envs.py": "environment_variables = {'VLLM_USE_V1': None}\n",
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py":
            "import argparse\nclass FlexibleArgumentParser(argparse.ArgumentParser):\n    pass\n",
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/openai/__init__.py": "",
        "vllm/entrypoints/openai/cli_args.py":
            f"def make_arg_parser(parser):\n{make_arg_parser_body}",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def vllm_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_vllm_that_cannot_infer_its_device_leaves_the_bundled_table_to_serve(
        vllm_on_path: Path) -> None:
    # vLLM 0.32 imports on a CPU machine, then building its parser raises.
    _fake_vllm(vllm_on_path, "    raise RuntimeError('Failed to infer device type')\n")
    assert installed_flags() is None


def test_a_vllm_whose_parser_builds_gives_its_own_table(vllm_on_path: Path) -> None:
    _fake_vllm(vllm_on_path, "    parser.add_argument('--max-num-seqs', type=int, default=256)\n"
                             "    return parser\n")
    table = installed_flags()
    assert table is not None and table.version == "0.32.0"
    assert "max-num-seqs" in table.types
