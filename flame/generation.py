"""Sampling from any model that returns logits: an export, the training model (in-loop samples), a diagnostic."""

from collections.abc import Callable

import torch


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
