"""Training: the model parts of a run (model_parts.py), the one training step (step.py) and the Trainer's loop
(trainer.py). ``python -m flame.train`` runs the trainer (train.sh does this under torchrun)."""

from flame.train.trainer import Trainer, enable_debug_mode, main

__all__ = ["Trainer", "enable_debug_mode", "main"]
