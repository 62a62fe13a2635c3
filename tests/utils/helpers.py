"""Tiny flame models saved as DCP checkpoints in this process, for the converter and export tests."""

from pathlib import Path

import torch

from flame.checkpoint.dcp_io import save_model_tensors
from flame.checkpoint.layout import write_sidecar
from flame.models import build_model, get_model_spec

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "flame/assets/tokenizer"  # 4096 tokens
SMALL = {"vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2}
SHAPES = {
    "transformer": {"num_heads": 4, "num_kv_heads": 2},
    "gated_deltanet": {"num_heads": 2, "head_dim": 16},
    "delta_net": {"num_heads": 2},
}


def tiny_model(model_type: str, seed: int = 0, **overrides):
    args, unknown = get_model_spec(model_type).args_cls.from_dict(
        {**SMALL, **SHAPES[model_type], **overrides}
    )
    assert unknown == []
    torch.manual_seed(seed)
    model = build_model(args)
    model.init_weights()
    return model.eval()


def save_checkpoint(dump: Path, model, step: int = 0, tokenizer: Path | None = TOKENIZER) -> Path:
    """<dump>/checkpoint/step-<step>: the model's tensors at the top level (as torchtitan saves a model-only
    checkpoint) and flame.json."""
    path = dump / "checkpoint" / f"step-{step}"
    path.mkdir(parents=True)
    write_sidecar(path, model.args.to_dict(), None if tokenizer is None else str(tokenizer))
    save_model_tensors(path, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return path


def tokens(batch: int = 2, length: int = 24, vocab: int = 4096, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def process_ends(pid: int, within_s: float = 30.0) -> bool:
    """Whether process ``pid`` is gone within ``within_s`` (a killed child is reaped by init shortly after)."""
    import os
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
