"""Build an offline corpus of Python source code, large enough for runs of thousands of steps.

flame's sample corpus (flame/assets/corpus, about 0.5M tokens) repeats within a few hundred steps of a 340M model;
the GPU machines have no network. This corpus is the Python files of the installed packages (1 kB to 200 kB each,
in sorted path order, one document per file) up to ``--chars`` characters, about 22M tokens of flame's sample
tokenizer at the default; 3% of the files, picked by a hash of their path, form the validation split.

    python scripts/build_code_corpus.py --out exp/code_corpus      # then --training.dataset exp/code_corpus

The same packages (the CPU constraints of 3rdparty/) give the same corpus.
"""

import argparse
import gzip
import hashlib
import json
import sysconfig
from pathlib import Path

VALIDATION_PERCENT = 3
MIN_BYTES, MAX_BYTES = 1_000, 200_000


def is_validation(relative_path: str) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 100 < VALIDATION_PERCENT


def build(site: Path, out: Path, chars: float) -> tuple[int, int]:
    """Writes out/train.jsonl.gz and out/validation.jsonl.gz; returns (files, characters) written."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in site.rglob("*.py") if MIN_BYTES < p.stat().st_size < MAX_BYTES)
    written = total = 0
    with (
        gzip.open(out / "train.jsonl.gz", "wt", compresslevel=9) as train,
        gzip.open(out / "validation.jsonl.gz", "wt", compresslevel=9) as validation,
    ):
        for path in files:
            text = path.read_text(errors="replace")
            split = validation if is_validation(str(path.relative_to(site))) else train
            split.write(json.dumps({"text": text}) + "\n")
            written, total = written + 1, total + len(text)
            if total > chars:
                break
    return written, total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("exp/code_corpus"))
    parser.add_argument("--site", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    parser.add_argument("--chars", type=float, default=68e6, help="stop after the file that passes this many")
    args = parser.parse_args()
    files, chars = build(args.site, args.out, args.chars)
    print(f"wrote {files} files, {chars:,} characters, to {args.out}")


if __name__ == "__main__":
    main()
