"""Writes bench/h200/spec_prompts.jsonl: the prompts of the speculative-decoding study on real
weights (bench/h200/spec.yaml). Half are copy tasks (the reply repeats text of the prompt, what
prompt-lookup speculation is built for: edits, quotes, retrieval answers), half are open
continuations of the quality corpus (nothing to look up). In SmolLM2's chat format, sent as raw
text to /v1/completions. The text is this project's own (examples/conversations.json and
runners/quality_corpus.txt). Run from the repo root: python3 bench/h200/make_spec_prompts.py"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "spec_prompts.jsonl"


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def main() -> None:
    conversations = json.loads((ROOT / "examples" / "conversations.json").read_text())
    replies = [m["value"] for c in conversations for m in c["conversations"]
               if m["from"] == "gpt" and len(m["value"].split()) >= 12]
    corpus = [line.strip() for line in (ROOT / "runners" / "quality_corpus.txt").read_text()
              .splitlines() if line.strip() and not line.startswith("#")]
    lines = []
    for i in range(len(replies)):
        text = f"{replies[i]} {replies[(i + 5) % len(replies)]}"
        copy = f"Copy the following text exactly, word for word.\n\n{text}"
        lines.append({"prompt": chat(copy)})
        lines.append({"prompt": chat(f"Continue this text: {corpus[i]}")})
    OUT.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{OUT.name}: {len(lines)} prompts")


if __name__ == "__main__":
    main()
