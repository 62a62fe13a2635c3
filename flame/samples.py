"""Text samples during training: every ``inference.interval`` steps, continue each prompt and log the text.

Prompts (``--inference.prompt``, several separated by '|') are tokenized like the training documents (BOS first)
and continued by :func:`flame.generation.sample` for up to ``inference.max_new_tokens`` tokens, stopping at
EOS: greedy with ``inference.temperature`` 0, else sampled at that temperature among the ``inference.top_k`` most
likely tokens (0: all), seeded by (debug.seed, step). The training model runs in eval mode under no_grad,
recomputing the whole prefix for every token (no KV cache: models sampled during training are small, and every
family's forward stays as it is); the prefix is cut to the last training.seq_len tokens.

Every rank runs the same forwards (a sharded model needs all of them) and samples from rank 0's logits with the
same seed, so all ranks pick the same tokens and stop together; only rank 0 logs.
"""

import torch

from flame.generation import sample


class SampleGenerator:
    def __init__(self, job_config, tokenizer):
        inference = job_config.inference
        self.interval = inference.interval
        self.prompts = [p.strip() for p in inference.prompt.split("|") if p.strip()]
        self.max_new_tokens = inference.max_new_tokens
        self.temperature = inference.temperature
        self.top_k = inference.top_k
        self.context = job_config.training.seq_len
        self.seed = job_config.debug.seed or 0
        self.tokenizer = tokenizer
        self.prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]

    def should_sample(self, step: int) -> bool:
        return step % self.interval == 0

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, device: torch.device, amp, step: int) -> list[tuple[str, str]]:
        """[(prompt, completion)] for every prompt."""
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1

        def last_logits(tokens: torch.Tensor) -> torch.Tensor:
            with amp:
                logits = model(tokens[:, -self.context :])[:, -1:].float().contiguous()
            if distributed:
                torch.distributed.broadcast(logits, src=0)
            return logits

        model.eval()
        samples = []
        for prompt in self.prompts:
            ids = self.prefix + self.tokenizer.encode(prompt, add_special_tokens=False)
            tokens = torch.tensor([ids], device=device)
            out = sample(
                last_logits,
                tokens,
                self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
                eos_token_id=self.tokenizer.eos_token_id,
                generator=torch.Generator().manual_seed(self.seed + step),
                vocab_limit=len(self.tokenizer),
            )
            samples.append((prompt, self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)))
        model.train()
        return samples
