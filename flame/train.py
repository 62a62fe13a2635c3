"""flame's trainer: ``torchrun ... -m flame.train [--section.field value ...]`` (train.sh does this).

One step, top to bottom: draw ``accumulation`` micro-batches, count the labelled tokens over all data-parallel
ranks, forward + backward each micro-batch with the loss summed and divided by that global count, clip the
gradient norm, step the optimizer and the schedule (or skip a non-finite step), log, checkpoint.
"""

import contextlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
import torchtitan  # noqa: F401  (the real package, before flame.config parses: see compat.torchtitan_job_config)
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as tt_utils
from torchtitan.tools.logging import init_logger, logger

from flame import compat
from flame.config import parse_args
from flame.data import build_dataloader, build_tokenizer
from flame.errors import FlameError
from flame.metrics import MetricsLogger
from flame.models import build_model, load_model_args
from flame.models.common.args import ModelArgs
from flame.parallelize import parallelize_model

IGNORE_INDEX = -100


def fit_vocab_to_tokenizer(model_args: ModelArgs, tokenizer, resize: bool) -> None:
    """The model's vocabulary must cover the tokenizer's ids; grow it when asked to."""
    needed = len(tokenizer)
    if needed <= model_args.vocab_size:
        return
    if not resize:
        raise FlameError(
            f"the tokenizer has {needed} tokens but the model's vocab_size is {model_args.vocab_size}; "
            "use a matching tokenizer, raise vocab_size in the model config, or pass --model.resize_vocab"
        )
    logger.warning(f"Resizing vocab_size from {model_args.vocab_size} to {needed} to fit the tokenizer")
    model_args.vocab_size = needed


class Trainer(Stateful):
    def __init__(self, job_config):
        self.job_config = job_config
        training = job_config.training

        # Devices and process groups.
        if torch.cuda.is_available():
            self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        world_size = dist_utils.init_distributed(job_config.comm, base_folder=job_config.job.dump_folder)
        p = job_config.parallelism
        self.parallel_dims = ParallelDims(
            dp_shard=p.data_parallel_shard_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=world_size,
        )
        if self.parallel_dims.dp_enabled:
            batch_mesh = self.parallel_dims.get_mesh("batch")
            self.dp_degree, self.dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
        else:
            self.dp_degree, self.dp_rank = 1, 0
        dist_utils.set_determinism(
            self.parallel_dims, self.device, job_config.debug, distinct_seed_mesh_dims=["pp"]
        )
        self.gc_handler = tt_utils.GarbageCollection(gc_freq=training.gc_freq, debug=training.gc_debug)

        # Tokenizer, model config and data.
        self.tokenizer = build_tokenizer(job_config)
        self.model_args, unknown_keys = load_model_args(job_config.model.config)
        if unknown_keys:
            logger.warning(f"Model config keys flame does not use: {', '.join(unknown_keys)}")
        fit_vocab_to_tokenizer(self.model_args, self.tokenizer, job_config.model.resize_vocab)
        self.dataloader = build_dataloader(
            job_config, self.tokenizer, dp_rank=self.dp_rank, dp_world_size=self.dp_degree
        )

        # Model: built on the meta device, parallelized, then materialized and initialized.
        with torch.device("meta"):
            model = build_model(self.model_args)
        nparams, flops_per_token = self.model_args.get_nparams_and_flops(model, training.seq_len)
        logger.info(
            f"Model {self.model_args.model_type}: {nparams:,} parameters, {flops_per_token:,} FLOPs/token"
        )
        model = parallelize_model(model, self.parallel_dims, job_config)
        model.to_empty(device="cpu" if training.enable_cpu_offload else self.device)
        model.init_weights()
        model.train()
        self.model_parts = [model]

        # Optimization.
        if training.gradient_accumulation_steps is not None:
            self.accumulation = training.gradient_accumulation_steps
        elif training.global_batch_size > 0:
            per_step = training.local_batch_size * self.dp_degree
            if training.global_batch_size % per_step:
                raise FlameError(
                    f"training.global_batch_size {training.global_batch_size} is not a multiple of "
                    f"local batch size x data-parallel degree = {per_step}"
                )
            self.accumulation = training.global_batch_size // per_step
        else:
            self.accumulation = 1
        self.optimizers = build_optimizers(self.model_parts, job_config.optimizer, self.parallel_dims)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, job_config.lr_scheduler, training.steps)
        # bf16 autocast is slower than float32 on CPUs: CPU runs train in float32 throughout.
        self.amp = (
            dist_utils.maybe_enable_amp(self.parallel_dims, training.mixed_precision_param, self.device.type)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )

        # State saved with every checkpoint (train_state is this object: step, tokens, skipped steps).
        self.step = 0
        self.ntokens_seen = 0
        self.skipped_steps = 0
        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=job_config.checkpoint,
            sd_adapter=None,
            base_folder=job_config.job.dump_folder,
        )
        self.metrics = MetricsLogger(job_config, self.device, torch.distributed.get_rank(), flops_per_token)
        logger.info(
            f"Training {training.steps} steps of {training.local_batch_size} x {training.seq_len} tokens per device, "
            f"{self.dp_degree} data-parallel ranks, {self.accumulation} accumulation step(s)"
        )

    def next_batches(self, data_iterator) -> list[tuple[dict, torch.Tensor]]:
        start = time.perf_counter()
        batches = [next(data_iterator) for _ in range(self.accumulation)]
        self.metrics.window_data_time += time.perf_counter() - start
        return batches

    def forward_backward(
        self, input_dict: dict, labels: torch.Tensor, global_tokens: torch.Tensor
    ) -> torch.Tensor:
        model = self.model_parts[0]
        inputs = {k: v.to(self.device) for k, v in input_dict.items()}
        labels = labels.to(self.device)
        with self.amp:
            logits = model(
                inputs["input"], position_ids=inputs.get("position_ids"), cu_seqlens=inputs.get("cu_seqlens")
            )
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        loss = loss_sum / global_tokens
        del logits  # free before backward
        loss.backward()
        return loss.detach()

    def train_step(self, data_iterator) -> None:
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        batches = self.next_batches(data_iterator)

        # Normalise by the labelled tokens of the whole step on all ranks, so accumulation and sharding
        # give the same gradient as one big batch.
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches).to(self.device)
        global_tokens = (
            dist_utils.dist_sum(local_tokens, self.parallel_dims.get_mesh("batch"))
            if self.parallel_dims.dp_enabled
            else local_tokens.float()
        )
        loss = sum(self.forward_backward(inputs, labels, global_tokens) for inputs, labels in batches)
        step_tokens = sum(labels.numel() for _, labels in batches)
        self.ntokens_seen += step_tokens
        self.metrics.window_tokens += step_tokens

        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
        )
        if self.job_config.training.skip_nan_inf and not torch.isfinite(grad_norm):
            self.skipped_steps += 1
            logger.warning(f"step {self.step}: gradient norm is {grad_norm.item()}; skipping the update")
        else:
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        self.lr_schedulers.step()

        if self.metrics.should_log(self.step):
            if self.parallel_dims.dp_enabled:
                loss = dist_utils.dist_sum(loss, self.parallel_dims.get_mesh("batch"))
            self.metrics.log(
                self.step,
                {
                    "loss/train": float(loss),
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "skipped_steps": self.skipped_steps,
                    "tokens_seen": self.ntokens_seen * self.dp_degree,
                },
            )

    def train(self) -> None:
        job_config = self.job_config
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        logger.info(f"Training starts at step {self.step + 1}")
        self.metrics.reset_window(self.step)
        data_iterator = iter(self.dataloader)
        while self.step < job_config.training.steps:
            self.step += 1
            self.gc_handler.run(self.step)
            self.train_step(data_iterator)
            self.checkpointer.save(self.step, last_step=self.step == job_config.training.steps)
            if self.step == 1:  # lazy init and compilation are done: tighten the timeout for faster failure
                dist_utils.set_pg_timeouts(
                    timedelta(seconds=job_config.comm.train_timeout_seconds), self.parallel_dims
                )
        logger.info("Training completed")

    def create_seed_checkpoint(self) -> None:
        """Save the initial weights as step 0 (model only): runs with any parallelism that load it start
        from identical weights, which random init on sharded parameters does not guarantee."""
        if torch.distributed.get_world_size() != 1:
            raise FlameError("create the seed checkpoint with one process (NGPU=1); other runs then load it")
        self.checkpointer.last_save_model_only = True
        self.checkpointer.save(curr_step=0, last_step=True)
        logger.info(f"Saved the seed checkpoint in {self.checkpointer.folder}/step-0")

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.skipped_steps = state_dict.get("skipped_steps", 0)

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        job_config = parse_args(sys.argv[1:] if argv is None else argv)
        compat.apply()
        trainer = Trainer(job_config)
    except FlameError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if job_config.checkpoint.create_seed_checkpoint:
            trainer.create_seed_checkpoint()
        else:
            trainer.train()
    except FlameError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
