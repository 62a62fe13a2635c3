"""Attention-sink, sparsity, massive-activation and passkey diagnostics of a checkpoint.

    python -m flame.diagnostics --checkpoint <dump folder | checkpoint folder | HF export> [--step N]
        [--config model.json] [--tokenizer DIR] [--out DIR] [--seq_len 512] [--num_sequences 4] [--text_file F]
        [--passkey_lengths 256,512,1024,2048] [--passkey_trials 10] [--sink_threshold 0.3] [--near_zero 1e-3]
        [--seed 0] [--device cpu|cuda] [--dtype float32|bfloat16]

Runs flame's own model (PyTorch attention path; see flame.hf.load for the checkpoint forms) on
``--num_sequences`` sequences of ``--seq_len`` tokens (flame's embedded corpus, or ``--text_file``), one at a time,
collecting the attention statistics of every attention layer and the activation statistics of every layer; then
passkey retrieval at each ``--passkey_lengths`` ("" skips it). Prints the per-layer table, the sink rate and the
passkey table, and writes diagnostics.json, diagnostics.md and diagnostics.png into ``--out`` (default:
``<checkpoint>/diagnostics``). A mistake in the input is one line ``error: <message>`` and exit code 2.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from flame.cli import run_cli
from flame.errors import FlameError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flame.diagnostics", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint", required=True, help="dump folder, its checkpoint folder, or an HF export folder"
    )
    parser.add_argument("--step", type=int, help="DCP checkpoint step (default: the latest complete one)")
    parser.add_argument("--config", help="model config JSON (DCP; default: the one the checkpoint records)")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, help="output folder (default: <checkpoint>/diagnostics)")
    parser.add_argument("--seq_len", type=int, default=512, help="tokens per sequence for the statistics")
    parser.add_argument("--num_sequences", type=int, default=4)
    parser.add_argument("--text_file", type=Path, help="UTF-8 text to measure on (default: flame's corpus)")
    parser.add_argument(
        "--passkey_lengths",
        default="256,512,1024,2048",
        help="comma-separated prompt lengths in tokens; '' skips passkey retrieval",
    )
    parser.add_argument("--passkey_trials", type=int, default=10, help="prompts per length")
    parser.add_argument(
        "--sink_threshold",
        type=float,
        default=0.3,
        help="a head is a sink head above this mean first-token attention",
    )
    parser.add_argument("--near_zero", type=float, default=1e-3, help="the near-zero sparsity threshold")
    parser.add_argument("--seed", type=int, default=0, help="passkey keys and depths")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return parser.parse_args(argv)


def passkey_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise FlameError(f"--passkey_lengths must be comma-separated integers, got {text!r}") from e
    if any(length <= 0 for length in lengths):
        raise FlameError(f"--passkey_lengths must be positive, got {text!r}")
    return lengths


def check(options: argparse.Namespace) -> list[int]:
    """The passkey lengths; FlameError for any bad option, before anything is loaded."""
    if options.seq_len < 2:
        raise FlameError(f"--seq_len must be at least 2 (query 0 is not counted), got {options.seq_len}")
    if options.num_sequences < 1:
        raise FlameError(f"--num_sequences must be at least 1, got {options.num_sequences}")
    if options.passkey_trials < 1:
        raise FlameError(f"--passkey_trials must be at least 1, got {options.passkey_trials}")
    if not 0 <= options.sink_threshold <= 1:
        raise FlameError(f"--sink_threshold must be in [0, 1], got {options.sink_threshold}")
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise FlameError("--device cuda: no GPU is visible; use --device cpu")
    return passkey_lengths(options.passkey_lengths)


def run(argv: list[str]) -> int:
    options = parse(argv)
    lengths = check(options)
    from flame.diagnostics import inputs, report
    from flame.diagnostics.activations import ActivationStats
    from flame.diagnostics.attention import AttentionStats
    from flame.diagnostics.passkey import check_lengths, passkey_accuracy
    from flame.hf.load import load

    report.require_matplotlib()
    loaded = load(
        options.checkpoint,
        options.step,
        options.config,
        options.tokenizer,
        options.device,
        DTYPES[options.dtype],
    )
    model, tokenizer = loaded.model, loaded.tokenizer
    check_lengths(tokenizer, lengths)
    documents = (
        inputs.text_file_documents(options.text_file) if options.text_file else inputs.corpus_documents()
    )
    sequences = inputs.token_sequences(documents, tokenizer, options.seq_len, options.num_sequences)

    attention, activations = AttentionStats(options.near_zero), ActivationStats()
    with torch.no_grad(), attention.attached(model), activations.attached(model):
        for sequence in sequences:
            model(sequence[None].to(options.device))
    passkey = [passkey_accuracy(model, tokenizer, n, options.passkey_trials, options.seed) for n in lengths]

    settings = {
        "seq_len": options.seq_len,
        "num_sequences": options.num_sequences,
        "text": str(options.text_file)
        if options.text_file
        else "flame's embedded corpus (flame/assets/corpus)",
        "sink_threshold": options.sink_threshold,
        "near_zero": options.near_zero,
        "passkey_trials": options.passkey_trials,
        "seed": options.seed,
        "device": options.device,
        "dtype": options.dtype,
    }
    result = report.summarize(model, attention, activations, passkey, loaded.source, settings)
    out = options.out or Path(options.checkpoint) / "diagnostics"
    out.mkdir(parents=True, exist_ok=True)
    text = report.markdown(result)
    (out / "diagnostics.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "diagnostics.md").write_text(text)
    report.plot(result, out / "diagnostics.png")
    print(text + f"\nWrote {out / 'diagnostics.json'}, diagnostics.md and diagnostics.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
