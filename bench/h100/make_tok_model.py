"""ON the device, before bench/h100/steady-tok.yaml: a model directory of the bundled Qwen3-8B
shape holding the word-level tokenizer that vLLM's own client is served with
(bench/gpu/bench_serve_check.py's `write_tokenizer`), so the trial's server detokenizes exactly as
the claim check's server does and nightshift sends text prompts through that tokenizer.

    python3 bench/h100/make_tok_model.py /root/qwen3-8b-tok
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench/gpu"))

from bench_serve_check import write_tokenizer  # noqa: E402

from runners.model_info import MODEL_CONFIGS_DIR  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    source = MODEL_CONFIGS_DIR / "qwen3-8b" / "config.json"
    shutil.copyfile(source, out / "config.json")
    config = json.loads(source.read_text(encoding="utf-8"))
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    write_tokenizer(out, int(config["vocab_size"]), eos if isinstance(eos, int) else None,
                    int(config.get("max_position_embeddings") or 32768))
    print(f"{out}: config.json of qwen3-8b, word-level tokenizer of {config['vocab_size']} ids")
    return 0


if __name__ == "__main__":
    sys.exit(main())
