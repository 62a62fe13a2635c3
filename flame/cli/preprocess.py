"""Upstream flame's pre-tokenization command, with its options: tokenize datasets once to disk.

    python -m flame.cli.preprocess [--dataset HuggingFaceFW/fineweb-edu] [--dataset_name sample-100BT]
        [--dataset_split train] [--data_dir ...] [--data_files ...] [--data_probs ...] [--path data]
        [--tokenizer fla-hub/transformer-1.3B-100B] [--batch_size 2048] [--streaming] [--num_workers N] [--seed N]

Each dataset of the comma-separated lists is tokenized by flame.data.prepare into flame's token shards, which
``--training.dataset <dir>`` trains from: one dataset into --path, several into --path/0, --path/1, ... (flame mixes
prepared datasets at training time); the command ends with the training flags that read what it wrote. Upstream
writes one Arrow dataset of input_ids instead. Hub names (datasets, tokenizer) come from the local HF cache,
fetched if missing. --streaming, --num_workers and --seed are accepted with a notice: they change nothing here.
"""

import argparse
import logging
import sys
from pathlib import Path

from flame.cli import run_cli
from flame.data.config import source_specs
from flame.hf.hub import resolve_tokenizer

# Upstream's default data: the 100B-token sample of FineWeb-Edu.
UPSTREAM_DATASET, UPSTREAM_DATASET_NAME = "HuggingFaceFW/fineweb-edu", "sample-100BT"
# Upstream options that change nothing in flame's preprocessing -> why (printed when given).
NO_EFFECT = {
    "streaming": "flame streams the source while tokenizing, always",
    "num_workers": "the fast tokenizer spreads each batch over its own threads",
    "seed": "prepared documents keep the source order; training shuffles them (--training.seed)",
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.cli.preprocess", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dataset", help=f"dataset(s), comma separated (default: {UPSTREAM_DATASET})")
    parser.add_argument(
        "--dataset_name",
        help=f"config name(s), comma separated (default with the default dataset: {UPSTREAM_DATASET_NAME})",
    )
    parser.add_argument("--dataset_split", default="train", help="split(s), comma separated")
    parser.add_argument("--data_dir", help="data_dir argument(s) of datasets.load_dataset, comma separated")
    parser.add_argument("--data_files", help="data files, comma separated per dataset (':' joins several)")
    parser.add_argument("--data_probs", help="sampling probabilities of the datasets, for the training flags")
    parser.add_argument("--path", default="data", help="directory to write the token shards into")
    parser.add_argument(
        "--tokenizer", default="fla-hub/transformer-1.3B-100B", help="tokenizer dir or hub name"
    )
    parser.add_argument("--batch_size", type=int, default=2048, help="rows tokenized together")
    parser.add_argument("--streaming", action="store_true", default=None, help=NO_EFFECT["streaming"])
    parser.add_argument("--num_workers", type=int, help=NO_EFFECT["num_workers"])
    parser.add_argument("--seed", type=int, help=NO_EFFECT["seed"])
    return parser.parse_args(argv)


def preprocess(argv: list[str]) -> int:
    from flame.data.prepare import prepare

    options = parse(argv)
    for name, reason in NO_EFFECT.items():
        if getattr(options, name) is not None:
            print(f"notice: --{name} has no effect in flame: {reason}", file=sys.stderr)
    if options.dataset is None:
        options.dataset = UPSTREAM_DATASET
        options.dataset_name = options.dataset_name or UPSTREAM_DATASET_NAME
    specs = source_specs(
        dataset=options.dataset,
        dataset_name=options.dataset_name,
        dataset_split=options.dataset_split,
        data_dir=options.data_dir,
        data_files=options.data_files,
        streaming=True,
    )
    tokenizer = resolve_tokenizer(options.tokenizer)
    outputs = (
        [Path(options.path)] if len(specs) == 1 else [Path(options.path) / str(i) for i in range(len(specs))]
    )
    for spec, output in zip(specs, outputs, strict=True):
        entry = prepare(
            argparse.Namespace(
                dataset=spec.path,
                dataset_name=spec.name,
                dataset_split=spec.split,
                data_dir=spec.data_dir,
                data_files=":".join(spec.data_files) if spec.data_files else None,
                text_column=spec.text_column,
                tokenizer=tokenizer,
                output=str(output),
                shard_tokens=1 << 28,
                batch_size=options.batch_size,
            )
        )
        print(
            f"{output}: {spec.path} split '{spec.split}', {entry['documents']:,} documents, {entry['tokens']:,} tokens"
        )
    splits = ",".join(spec.split for spec in specs)
    flags = f"--training.dataset {','.join(map(str, outputs))} --training.dataset_split {splits}"
    if len(specs) > 1 and options.data_probs:
        flags += f" --training.data_probs {options.data_probs}"
    print(f"train from it with: {flags} --model.tokenizer_path {options.tokenizer}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli(preprocess, argv)


if __name__ == "__main__":
    sys.exit(main())
