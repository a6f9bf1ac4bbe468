"""A tiny real tokenizer for tests, built at test time with the `tokenizers` library (no
network): a byte-level BPE of 400 tokens trained on runners/quality_corpus.txt that adds a BOS
token to every prompt (as Llama's do), saved as tokenizer.json beside a bundled config.json."""

from __future__ import annotations

import shutil
from pathlib import Path

from runners.model_info import MODEL_CONFIGS_DIR

CORPUS = Path(__file__).resolve().parents[2] / "runners" / "quality_corpus.txt"
SHAPE = "qwen2.5-0.5b"  # the simulated engine models this shape's speed


def make_tiny_model(directory: Path, *, vocab_size: int = 400, bos: bool = True) -> Path:
    """`directory` holding tokenizer.json and config.json; returned for chaining. `bos=False`:
    no post-processor (GPT-2 style: no special token added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS.read_text(encoding="utf-8").splitlines(), trainer)
    if bos:
        bos_id = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)])
    tokenizer.save(str(directory / "tokenizer.json"))
    shutil.copy(MODEL_CONFIGS_DIR / SHAPE / "config.json", directory / "config.json")
    return directory
