"""Tokenize a dataset once into binary token shards, for corpora too large to tokenize online.

    python -m flame.data.prepare --dataset DATASET [--dataset_name ... --dataset_split ... --data_dir ...
        --data_files ... --text_column ...] --tokenizer TOKENIZER --output DIR [--shard_tokens N]

The source flags mean what the ``--training.*`` flags of the same name mean (one dataset, not a mixture). The
dataset is streamed in order; documents are ``[BOS] + tokens + [EOS]`` as in online training, and empty ones
are skipped and counted. The output format is described in :mod:`flame.data.shards`; preparing another
split into the same DIR adds it to the index. Train from it with ``--training.dataset DIR`` (with the same
tokenizer): shuffling, sharding, packing and resume work as for any map-style dataset.
"""

import argparse
import logging
import sys
import time

from transformers import AutoTokenizer

from flame.data.config import DataConfigError, source_specs
from flame.data.shards import ShardWriter
from flame.data.sources import open_source
from flame.data.tokenize import DocumentEncoder

logger = logging.getLogger(__name__)

READ_BATCH = 1024
"""Rows tokenized together by default (the fast tokenizer spreads a batch over its threads)"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.data.prepare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dataset", required=True, help="hub name, local directory or file, or builder name")
    parser.add_argument("--dataset_name", help="dataset config name")
    parser.add_argument("--dataset_split", default="train", help="split to prepare (default: train)")
    parser.add_argument("--data_dir", help="data_dir argument of datasets.load_dataset")
    parser.add_argument("--data_files", help="data files, ':' separated (globs allowed)")
    parser.add_argument("--text_column", help="column holding the text (default: text, then content)")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    parser.add_argument("--output", required=True, help="directory to write the shards and index into")
    parser.add_argument("--shard_tokens", type=int, default=1 << 28, help="tokens per shard (default: 2^28)")
    parser.add_argument(
        "--batch_size", type=int, default=READ_BATCH, help=f"rows tokenized together (default: {READ_BATCH})"
    )
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> dict:
    """Write the split's shards and index entry; returns the entry."""
    specs = source_specs(
        dataset=args.dataset,
        dataset_name=args.dataset_name,
        dataset_split=args.dataset_split,
        data_dir=args.data_dir,
        data_files=args.data_files,
        text_column=args.text_column,
        streaming=True,
    )
    if len(specs) != 1:
        raise DataConfigError("prepare one dataset at a time; mix prepared directories at training time")
    if args.shard_tokens < 1:
        raise DataConfigError(f"--shard_tokens must be >= 1, got {args.shard_tokens}")
    if args.batch_size < 1:
        raise DataConfigError(f"--batch_size must be >= 1, got {args.batch_size}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as e:
        raise DataConfigError(f"cannot load the tokenizer '{args.tokenizer}': {e}") from e
    source = open_source(specs[0], tokenizer)
    encode = DocumentEncoder(tokenizer)
    writer = ShardWriter(args.output, specs[0].split, tokenizer, args.shard_tokens, source.description)
    counts: dict[str, int] = {}
    documents = tokens = 0
    started, next_report = time.monotonic(), 100 * args.batch_size
    for batch in source.dataset.iter(batch_size=args.batch_size):
        for encoded in encode(source.rows(batch)):
            if encoded.note:
                counts[encoded.note] = counts.get(encoded.note, 0) + 1
            if encoded.tokens is not None:
                writer.add(encoded.tokens)
                documents += 1
                tokens += len(encoded.tokens)
        if documents >= next_report:
            rate = tokens / (time.monotonic() - started)
            logger.info(f"{documents:,} documents, {tokens:,} tokens ({rate:,.0f} tokens/s)")
            next_report += 100 * args.batch_size
    if documents == 0:
        raise DataConfigError(f"{source.description} holds no non-empty document")
    return writer.finish(counts)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        entry = prepare(args)
    except DataConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"{args.output}: split '{args.dataset_split}', {entry['documents']:,} documents, {entry['tokens']:,} tokens "
        f"in {len(entry['shards'])} shards; counts {entry['counts'] or 'none'}"
    )


if __name__ == "__main__":
    main()
