"""Evaluation during training: every ``eval.interval`` steps and at the last step, lm-evaluation-harness runs
``eval.tasks`` on the weights of that step, as ``python -m flame.eval`` runs them on a checkpoint.

The trainer calls it between steps, after the step's checkpoint is saved, so the weights evaluated are the ones a
checkpoint of that step holds. Every rank takes part in gathering the full (unsharded) weights to rank 0's memory;
rank 0 writes them as an HF export (flame.hf.export, float32) into ``<dump>/eval/step-<N>/hf``, runs
flame.evaluation.evaluate on it (results.json and results.md beside it), deletes the export, and sends the
scores to the other ranks, which wait for them (a broadcast over gloo with no practical time limit: an evaluation
can take longer than the training timeout of the collectives). Training stands still meanwhile; the time is
left out of the throughput.
"""

import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from flame.evaluation import EvalTarget, comma_list, evaluate
from flame.hf.export import plan_export, write_export
from flame.hf.export_options import DEFAULT_MAX_SHARD_SIZE
from flame.hf.safetensors_io import parse_size
from flame.models.common.args import ModelArgs

# How long the other ranks wait for rank 0's evaluation: its length is unknown in advance (tasks, limit, model
# size), and if rank 0 fails, torchrun stops the others anyway.
WAIT_FOR_EVALUATION = timedelta(days=1)


def eval_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results as ``eval/<task>/<metric>`` (``<metric>/<filter>`` for a filter other than none), the
    numbers only (lm-eval writes "N/A" for a standard error it cannot compute)."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


class Evaluator:
    def __init__(self, job_config, model_args: ModelArgs, tokenizer_path: str):
        evaluation = job_config.eval
        self.interval = evaluation.interval
        self.tasks = comma_list(evaluation.tasks)
        self.include_paths = comma_list(evaluation.include_path)
        self.limit = evaluation.limit or None
        self.batch_size = evaluation.batch_size
        self.folder = Path(job_config.job.dump_folder) / "eval"
        self.model_args = model_args
        self.tokenizer_path = tokenizer_path
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=WAIT_FOR_EVALUATION) if distributed else None

    def should_evaluate(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Every rank calls this at the same step; all return the same ``eval/<task>/<metric>`` values."""
        # A collective: FSDP's shards (and tensor-parallel pieces) are gathered, kept on rank 0's CPU only.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        metrics = [None]
        if self.rank == 0:
            results = self.folder / f"step-{step}"
            export = results / "hf"
            plan = plan_export(self.model_args, export, "auto", "float32", self.tokenizer_path)
            write_export(plan, state, parse_size(DEFAULT_MAX_SHARD_SIZE))
            del state
            # A full copy of the weights per evaluation is deleted after it (python -m flame.eval <dump> --step N
            # exports a checkpoint again).
            try:
                scores = evaluate(
                    EvalTarget(str(export), results),
                    self.tasks,
                    include_paths=self.include_paths,
                    batch_size=self.batch_size,
                    limit=self.limit,
                )
            finally:
                shutil.rmtree(export, ignore_errors=True)
            metrics = [eval_metrics(scores)]
        if self.group is not None:
            dist.broadcast_object_list(metrics, src=0, group=self.group)
        return metrics[0]
