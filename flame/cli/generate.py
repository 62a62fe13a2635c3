"""Sample text from a trained model: an HF export, or a dump folder's DCP checkpoint.

    python -m flame.cli.generate --model <hf dir | dump folder> [--step N] --prompt "Once upon a time"
        [--max_new_tokens 64] [--temperature 0.8] [--top_k 0] [--top_p 1.0] [--seed 0]
        [--backend flame|transformers] [--device cpu]

``--backend flame`` (default) builds flame's own model from any checkpoint flame reads (flame.hf.load.load: DCP, or
an export in FLA's, flame's or llama's format), which runs on CPU and GPU alike; ``--backend transformers`` loads an
export with ``AutoModelForCausalLM.from_pretrained`` (after ``import flame``, and ``import fla`` for FLA's model
types; FLA's attention layers are flame's where flash-attn does not import, as in training). Sampling recomputes the whole sequence at each new token (no cache): meant for short samples.
"""

import argparse
import sys

import torch

from flame.cli import run_cli
from flame.errors import FlameError
from flame.generation import generate_text


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m flame.cli.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", required=True, help="HF export, or a dump folder or checkpoint folder (DCP)"
    )
    parser.add_argument(
        "--step", type=int, help="checkpoint step of a dump folder (default: the latest complete)"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", help="tokenizer dir or hub name (default: the checkpoint's)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("flame", "transformers"), default="flame")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options = parser.parse_args(argv)
    from flame.hf.load import load, load_transformers_model

    if options.backend == "flame":
        loaded = load(options.model, options.step, tokenizer=options.tokenizer, device=options.device)
        model, tokenizer = loaded.model, loaded.tokenizer
    else:
        if options.step is not None:
            raise FlameError(
                "--step reads a DCP checkpoint, which --backend transformers cannot; use --backend flame"
            )
        from flame.hf.export import load_tokenizer

        model = load_transformers_model(options.model, options.device)
        tokenizer = load_tokenizer(options.tokenizer or options.model)
    print(options.prompt + generate_text(model, tokenizer, options.prompt, options.max_new_tokens,
                                         options.temperature, options.top_k, options.top_p, options.seed))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
