"""Sample text from an exported model (or, through :func:`sample`, from any model that returns logits, such as the
training model for in-loop samples).

    python -m flame.utils.generate --model <hf dir> --prompt "Once upon a time" [--max_new_tokens 64]
        [--temperature 0.8] [--top_k 0] [--top_p 1.0] [--seed 0] [--backend flame|transformers] [--device cpu]

``--backend flame`` (default) builds flame's own model from the folder (any format flame reads: FLA's, flame's,
llama), which runs on CPU and GPU alike; ``--backend transformers`` loads it with
``AutoModelForCausalLM.from_pretrained`` (after ``import flame``, and ``import fla`` for FLA's model types).
Sampling recomputes the whole sequence at each new token (no cache): meant for short samples.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from flame.errors import FlameError
from flame.utils import run_cli


def load_flame_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """flame's model (DecoderLM) with the weights of an HF folder, in eval mode."""
    from flame.hf.formats import import_adapter
    from flame.hf.safetensors_io import load_safetensors
    from flame.models import build_model
    from flame.utils.convert_hf_to_dcp import read_hf_config

    adapter = import_adapter(read_hf_config(Path(path)))
    with torch.device("meta"):
        model = build_model(adapter.args)
    state = adapter.from_hf(load_safetensors(path))
    model.load_state_dict(state, assign=True, strict=True)
    if adapter.args.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    return model.to(device=device, dtype=dtype).eval()


def load_transformers_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    import flame  # noqa: F401  (flame's model types)
    from flame.utils.convert_hf_to_dcp import read_hf_config

    if read_hf_config(Path(path)).get("model_type") in ("transformer", "gated_deltanet", "delta_net"):
        import fla  # noqa: F401  (FLA's model types)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def logits_of(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """input_ids [B, T] -> logits [B, T, V] for flame's models and transformers' alike."""

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    return forward


@torch.no_grad()
def sample(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Continue input_ids [B, T] by up to max_new_tokens tokens; temperature 0 is greedy. Rows that produced
    eos_token_id keep producing it. Ids from vocab_limit on (a vocabulary padded past the tokenizer's) are never
    picked. Returns [B, T + new]."""
    tokens = input_ids
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for _ in range(max_new_tokens):
        logits = logits_fn(tokens)[:, -1, :vocab_limit].float()
        if temperature <= 0:
            next_token = logits.argmax(-1)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if top_p < 1.0:
                sorted_logits, order = logits.sort(dim=-1, descending=True)
                cumulative = sorted_logits.softmax(-1).cumsum(-1)
                drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
                logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
            probs = logits.softmax(-1)
            next_token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(tokens.device)
        if eos_token_id is not None:
            next_token = torch.where(done, torch.full_like(next_token, eos_token_id), next_token)
            done |= next_token == eos_token_id
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        if eos_token_id is not None and bool(done.all()):
            break
    return tokens


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> str:  # fmt: skip
    """The prompt's continuation (without the prompt) sampled from model."""
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if tokenizer.bos_token_id is not None and (ids.shape[1] == 0 or ids[0, 0] != tokenizer.bos_token_id):
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)  # flame trains with BOS first
    generator = torch.Generator().manual_seed(seed)
    out = sample(logits_of(model), ids.to(device), max_new_tokens, temperature, top_k, top_p,
                 tokenizer.eos_token_id, generator, len(tokenizer))  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flame.utils.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", required=True, help="HF model folder (an export of flame)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tokenizer", help="tokenizer dir or hub name (default: --model)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("flame", "transformers"), default="flame")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options = parser.parse_args(argv)
    if not Path(options.model).is_dir():
        raise FlameError(f"the model folder {options.model} does not exist")
    from flame.hf.export import load_tokenizer

    tokenizer = load_tokenizer(options.tokenizer or options.model)
    load = load_flame_model if options.backend == "flame" else load_transformers_model
    model = load(options.model, options.device)
    print(options.prompt + generate_text(model, tokenizer, options.prompt, options.max_new_tokens,
                                         options.temperature, options.top_k, options.top_p, options.seed))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
