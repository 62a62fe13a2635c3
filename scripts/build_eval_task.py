"""Build flame/assets/eval/corpus_last_word.jsonl, the data of the offline task shipped with flame
(flame/assets/eval/flame_corpus_last_word.yaml): LAMBADA's format on the sample corpus's validation split.

Each prose paragraph of 12 to 80 words (no code, no headers) becomes one example: the paragraph up to its last word
is the context, the last word (without trailing punctuation) the target the model should predict.

    python scripts/build_eval_task.py
"""

import gzip
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "flame/assets/corpus/validation.jsonl.gz"
OUTPUT = ROOT / "flame/assets/eval/corpus_last_word.jsonl"
MIN_WORDS, MAX_WORDS = 12, 80
LAST_WORD = re.compile(r"^(?P<context>.*\S)\s+(?P<target>[A-Za-z][A-Za-z-]*)[.,;:!?]*$", re.S)


def examples(text: str):
    for paragraph in text.split("\n\n"):
        paragraph = " ".join(paragraph.split())
        words = paragraph.split(" ")
        if not MIN_WORDS <= len(words) <= MAX_WORDS or paragraph.startswith(("#", ">>>", "$")):
            continue
        if any(c in paragraph for c in "{}[]=()`"):  # code or signatures, not prose
            continue
        match = LAST_WORD.match(paragraph)
        if match:
            yield {"context": match["context"], "target": match["target"]}


def main() -> None:
    with gzip.open(SOURCE, "rt") as f:
        rows = [example for line in f for example in examples(json.loads(line)["text"])]
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} examples -> {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
