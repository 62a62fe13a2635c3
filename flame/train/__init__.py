"""Training: the model parts of a run (model_parts.py), the one training step (step.py) and the Trainer's loop
(trainer.py). ``python -m flame.train`` runs the trainer (train.sh does this under torchrun)."""

__all__ = ["Trainer", "enable_debug_mode", "main"]


def __getattr__(name: str):
    # The Trainer's module (and through its data loader, transformers and datasets) loads at the first use of these
    # names, not with flame.train.step or model_parts, which the benches and the parallel tests' ranks import alone.
    if name in __all__:
        from flame.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'flame.train' has no attribute {name!r}")
