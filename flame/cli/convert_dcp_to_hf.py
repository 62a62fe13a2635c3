"""Convert a flame DCP checkpoint to an HF model folder.

    python -m flame.cli.convert_dcp_to_hf --path <dump_folder> --step <n> [--config <model json or hub name>]
        [--tokenizer <dir or hub name>] [--output <dir>] [--format auto|fla|flame|llama|olmo_hybrid|hf]
        [--dtype float32|bfloat16] [--max_shard_size 5GB]

``--step -1`` takes the latest complete checkpoint. ``--config`` and ``--tokenizer`` default to what the run
recorded in the checkpoint (``flame.json``); a given ``--config`` must describe the same model. The checkpoint
is read through DCP in this one process, so it may have been written by any number of ranks and nodes (into one
shared folder). The HF folder (default: the dump folder, as flame does) gets config.json, generation_config.json,
the tokenizer files and the weights (``model.safetensors``, or shards with an index above ``--max_shard_size``).
See flame.hf.formats for the formats.
"""

import argparse
import sys
from pathlib import Path

from flame.checkpoint.layout import NO_TRAINED_CHECKPOINT, has_trained_checkpoint
from flame.cli import run_cli
from flame.hf.export_options import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES, EXPORT_FORMATS


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.cli.convert_dcp_to_hf", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--path", required=True, help="dump folder of the run (or its checkpoint folder)")
    parser.add_argument("--step", type=int, default=-1, help="checkpoint step; -1: the latest complete one")
    parser.add_argument(
        "--config", help="model config JSON or hub name (default: the one recorded in the checkpoint)"
    )
    parser.add_argument("--tokenizer", help="tokenizer dir or hub name (default: the run's)")
    parser.add_argument("--output", help="HF folder to write (default: --path)")
    parser.add_argument("--format", default="auto", choices=EXPORT_FORMATS)
    parser.add_argument("--dtype", default="float32", choices=sorted(EXPORT_DTYPES))
    parser.add_argument(
        "--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, help="shard above this size (5GB)"
    )
    parser.add_argument(
        "--after_training", action="store_true",
        help="train.sh's end-of-run export: no checkpoint, or only step 0, is a note instead of an error",
    )  # fmt: skip
    return parser.parse_args(argv)


def convert(argv: list[str]) -> int:
    options = parse(argv)
    if options.after_training and not has_trained_checkpoint(options.path):
        print(NO_TRAINED_CHECKPOINT)
        return 0
    # torch, transformers and safetensors (seconds): imported once there is something to export.
    from flame.hf.export import export_checkpoint, export_report
    from flame.hf.hub import resolve_model_config, resolve_tokenizer
    from flame.hf.safetensors_io import parse_size

    max_shard_bytes = parse_size(options.max_shard_size)
    plan, step_path, files = export_checkpoint(
        options.path,
        options.step,
        Path(options.output or options.path),
        fmt=options.format,
        dtype=options.dtype,
        config=None if options.config is None else resolve_model_config(options.config),
        tokenizer=None if options.tokenizer is None else resolve_tokenizer(options.tokenizer),
        max_shard_bytes=max_shard_bytes,
    )
    for line in export_report(plan, step_path, files):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, argv)


if __name__ == "__main__":
    sys.exit(main())
