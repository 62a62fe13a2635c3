"""flame's trainer: ``torchrun ... -m flame.train [--section.field value ...]`` (train.sh does this).

One step, top to bottom (``train_step``): draw ``accumulation`` micro-batches, count the labelled tokens over all
data-parallel ranks, forward + backward each micro-batch with the loss (cross-entropy, plus the z-loss if asked)
summed and divided by that global count, clip the gradient norm, step the optimizer and the schedule (or skip a
non-finite step), log. Then (``train``) checkpoint, validate and sample text when due, until training.steps or the
hard stop training.stop_at_step.
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
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as tt_utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

from flame import compat
from flame.checkpoint.lock import hold_for_trainer
from flame.checkpoint.manager import CheckpointManager
from flame.checkpoint.preemption import Preempted, Preemption
from flame.checkpoint.rng import RNGState
from flame.config import parse_args
from flame.config.checks import last_step, validate_job
from flame.data import build_dataloader, build_tokenizer
from flame.errors import FlameError
from flame.metrics import MetricsLogger
from flame.models import build_model, load_model_args
from flame.models.common.args import ModelArgs
from flame.ops.attention import set_attention_backend
from flame.ops.context_parallel import sequence_sharded
from flame.optim import build_lr_schedulers, build_optimizers
from flame.optim.nonfinite import NonFiniteSteps, clip_grad_norm_
from flame.parallelize import TokenNormalizedLoss, parallelize_model, pipeline_model, tie_embeddings
from flame.parallelize.compile import maybe_compile_loss
from flame.parallelize.context_parallel import ROW_CU_SEQLENS, shard_batch
from flame.samples import SampleGenerator
from flame.validate import Validator

IGNORE_INDEX = -100


def loss_sums(logits: torch.Tensor, labels: torch.Tensor, z_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the labelled tokens, and the z-loss term logsumexp(logits)^2 summed over the same
    tokens (zero unless ``z_loss``)."""
    # float32 at least (bf16 logits lose the small probabilities); float64 logits stay float64.
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    labels = labels.flatten()
    cross_entropy = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not z_loss:
        return cross_entropy, torch.zeros_like(cross_entropy)
    return cross_entropy, (logits.logsumexp(-1).square() * (labels != IGNORE_INDEX)).sum()


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
        validate_job(job_config)
        self.job_config = job_config
        training = job_config.training
        self.last_step = last_step(job_config)  # training.steps, or training.stop_at_step (hard stop)

        # Devices and process groups.
        if torch.cuda.is_available():
            self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        world_size = dist_utils.init_distributed(job_config.comm, base_folder=job_config.job.dump_folder)
        self.dump_lock = hold_for_trainer(job_config.job.dump_folder)  # None when train.sh holds it
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
        # Context parallelism: the ranks of a cp group read the same batch and each trains on a slice of every
        # sequence. The loss mesh (data parallel x cp) holds every labelled token of a step.
        self.cp_group = (
            self.parallel_dims.get_mesh("cp").get_group() if self.parallel_dims.cp_enabled else None
        )
        self.loss_mesh = self.parallel_dims.get_optional_mesh("loss")
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
        set_attention_backend(job_config.model.attention_backend)
        with torch.device("meta"):
            model = build_model(self.model_args)
        nparams, flops_per_token = self.model_args.get_nparams_and_flops(model, training.seq_len)
        logger.info(
            f"Model {self.model_args.model_type}: {nparams:,} parameters, {flops_per_token:,} FLOPs/token"
        )
        if self.parallel_dims.pp_enabled:
            # This rank's pipeline stages, each parallelized; the schedule runs forward + backward and the loss.
            self.pp_loss = TokenNormalizedLoss()
            self.pp_schedule, self.model_parts, self.pp_first, self.pp_last = pipeline_model(
                model, self.parallel_dims, job_config, self.device, self.pp_loss
            )
        else:
            self.model_parts = [parallelize_model(model, self.parallel_dims, job_config)]
        self.loss_fn = maybe_compile_loss(loss_sums, job_config.compile)
        for part in self.model_parts:
            part.to_empty(device="cpu" if training.enable_cpu_offload else self.device)
            tie_embeddings(part)  # to_empty unties a shared plain Parameter
            part.init_weights()
            part.train()

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
        self.optimizers = build_optimizers(self.model_parts, job_config)
        self.nonfinite_steps = NonFiniteSteps(training.skip_nan_inf_limit)
        self.lr_schedulers = build_lr_schedulers(self.optimizers, job_config)
        if (converter := getattr(self.model_parts[0], "float8_converter", None)) is not None:
            # Float8 all-gather with FSDP: precompute the next step's weight scales after each optimizer step.
            self.optimizers.register_step_post_hook(
                lambda *args, **kwargs: converter.post_optimizer_hook(self.model_parts)
            )
        # bf16 autocast is slower than float32 on CPUs: CPU runs train in float32 throughout.
        self.amp = (
            dist_utils.maybe_enable_amp(self.parallel_dims, training.mixed_precision_param, self.device.type)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )

        # State saved with every checkpoint (train_state is this object: step, tokens, skipped steps; rng: the
        # random generators of every rank). flame.json in each step directory records the model config.
        self.step = 0
        self.ntokens_seen = 0
        self.skipped_steps = 0
        tokenizer_path = job_config.model.tokenizer_path
        self.checkpointer = CheckpointManager(
            dataloader=self.dataloader,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self, "rng": RNGState()},
            checkpoint_config=job_config.checkpoint,
            sd_adapter=None,
            base_folder=job_config.job.dump_folder,
            model_config=self.model_args.to_dict(),
            tokenizer=os.path.abspath(tokenizer_path) if os.path.isdir(tokenizer_path) else tokenizer_path,
            verify_checksums=job_config.checkpoint.verify_checksums,
        )
        ckpt = job_config.checkpoint
        self.preemption = Preemption(
            ckpt.preempt_signals, ckpt.preempt_timeout, self.device, job_config.job.dump_folder
        )
        self.metrics = MetricsLogger(
            job_config, self.device, torch.distributed.get_rank(), flops_per_token, self.last_step
        )

        # Optional work between steps: validation loss and text samples.
        batch_mesh = self.parallel_dims.get_mesh("batch") if self.parallel_dims.dp_enabled else None
        self.validator = (
            Validator(job_config, self.tokenizer, self.dp_rank, self.dp_degree, batch_mesh)
            if job_config.validation.enable
            else None
        )
        self.sampler = SampleGenerator(job_config, self.tokenizer) if job_config.inference.interval else None
        if job_config.profiling.enable_memory_snapshot and self.device.type != "cuda":
            raise FlameError("profiling.enable_memory_snapshot records CUDA memory; it needs a GPU")
        stop = f", stopping at step {self.last_step}" if self.last_step < training.steps else ""
        logger.info(
            f"Training {training.steps} steps{stop} of {training.local_batch_size} x {training.seq_len} tokens per "
            f"device, {self.dp_degree} data-parallel ranks, {self.accumulation} accumulation step(s)"
        )

    def next_batches(self, data_iterator) -> list[tuple[dict, torch.Tensor]]:
        start = time.perf_counter()
        batches = [next(data_iterator) for _ in range(self.accumulation)]
        self.metrics.window_data_time += time.perf_counter() - start
        return batches

    def forward_backward(
        self, input_dict: dict, labels: torch.Tensor, global_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of one micro-batch; returns its shares of the step's cross-entropy and z-loss."""
        # A packed row's whole boundaries (context parallelism) stay on the host: the exchanges read them in
        # Python, and a device copy would cost a sync every micro-batch.
        row_cu_seqlens = input_dict.get(ROW_CU_SEQLENS)
        inputs = {k: v.to(self.device) for k, v in input_dict.items() if k != ROW_CU_SEQLENS}
        labels = labels.to(self.device)
        if self.parallel_dims.pp_enabled:
            return self._forward_backward_pipelined(inputs, labels, global_tokens, row_cu_seqlens)
        model = self.model_parts[0]
        z_loss = self.job_config.training.z_loss
        # The backward exchanges between cp ranks too.
        with sequence_sharded(self.cp_group, row_cu_seqlens):
            with self.amp:
                logits = model(
                    inputs["input"],
                    position_ids=inputs.get("position_ids"),
                    cu_seqlens=inputs.get("cu_seqlens"),
                )
                cross_entropy, z_term = self.loss_fn(logits, labels, z_loss=z_loss > 0)
            loss = (cross_entropy + z_loss * z_term) / global_tokens
            del logits  # free before backward
            loss.backward()
        return cross_entropy.detach() / global_tokens, z_loss * z_term.detach() / global_tokens

    def _forward_backward_pipelined(
        self,
        inputs: dict,
        labels: torch.Tensor,
        global_tokens: torch.Tensor,
        row_cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline schedule runs forward + backward of the micro-batch in pieces over the stages; its loss
        divides by ``global_tokens`` already. Only the last stage has the loss (zero elsewhere); no z-loss.

        With context parallelism the rows are already this rank's slices (every pipeline micro-batch is a set of
        rows, so each is sliced too); the position ids go to every stage, and the cp exchanges run inside the
        schedule, in the same order on all ranks of a cp group (they hold the same stages)."""
        self.pp_loss.global_tokens = global_tokens
        losses = [] if self.pp_last else None
        args = (inputs["input"],) if self.pp_first else ()
        kwargs = {k: inputs[k] for k in ("position_ids", "cu_seqlens") if k in inputs}
        with self.amp, sequence_sharded(self.cp_group, row_cu_seqlens):
            self.pp_schedule.step(*args, target=labels if self.pp_last else None, losses=losses, **kwargs)
        zero = torch.zeros((), device=self.device)
        loss = torch.stack(losses).sum().detach() if self.pp_last else zero
        return loss, zero

    def train_step(self, data_iterator) -> None:
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        batches = self.next_batches(data_iterator)
        self.ntokens_seen += sum(labels.numel() for _, labels in batches)
        if self.cp_group is not None:
            batches = [shard_batch(inputs, labels, self.cp_group) for inputs, labels in batches]

        # Normalise by the labelled tokens of the whole step on all ranks, so accumulation and sharding
        # give the same gradient as one big batch.
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches).to(self.device)
        global_tokens = (
            dist_utils.dist_sum(local_tokens, self.loss_mesh)
            if self.loss_mesh is not None
            else local_tokens.float()
        )
        losses = [self.forward_backward(inputs, labels, global_tokens) for inputs, labels in batches]
        loss = sum(cross_entropy for cross_entropy, _ in losses)
        z_loss = sum(z_term for _, z_term in losses)
        self.metrics.window_tokens += sum(labels.numel() for _, labels in batches)  # this device's tokens

        # The norm before clipping (what clip_grad_norm_ returns) is the one logged.
        grad_norm = clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"),
        )
        if self.job_config.training.skip_nan_inf and not torch.isfinite(grad_norm):
            self.skipped_steps += 1
            logger.warning(f"step {self.step}: gradient norm is {grad_norm.item()}; skipping the update")
            self.nonfinite_steps.skipped(self.step, self.model_parts)  # names them; stops at the limit
        else:
            self.nonfinite_steps.finite()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        self.lr_schedulers.step()

        if self.metrics.should_log(self.step):
            totals = torch.stack([loss, z_loss])
            if self.loss_mesh is not None:
                torch.distributed.all_reduce(totals, group=self.loss_mesh.get_group())
            if self.parallel_dims.pp_enabled:  # only the last stage has the loss
                torch.distributed.all_reduce(totals, group=self.parallel_dims.get_mesh("pp").get_group())
            metrics = {
                "loss/train": float(totals[0]),
                "grad_norm": float(grad_norm),
                "lr": lr,
                "skipped_steps": self.skipped_steps,
                "tokens_seen": self.ntokens_seen * self.dp_degree,
            }
            if self.job_config.training.z_loss > 0:
                metrics["loss/z_loss"] = float(totals[1])
            self.metrics.log(self.step, metrics)

    def validate(self) -> None:
        start = time.perf_counter()
        results = self.validator.validate(self.model_parts[0], self.device, self.amp)
        seconds = time.perf_counter() - start
        self.metrics.window_other_time += seconds
        self.metrics.log_validation(self.step, results, seconds)

    def sample(self) -> None:
        start = time.perf_counter()
        samples = self.sampler.generate(self.model_parts[0], self.device, self.amp, self.step)
        self.metrics.window_other_time += time.perf_counter() - start
        self.metrics.log_samples(self.step, samples)

    def train(self) -> None:
        job_config = self.job_config
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        logger.info(f"Training starts at step {self.step + 1}")
        self.metrics.reset_window(self.step)
        # Creating the iterator draws from torch's generator (the workers' base seed): kept out of the run's random
        # stream, so that a resumed run, which creates it at another step, draws what the uninterrupted run draws.
        with torch.random.fork_rng(devices=[]):
            data_iterator = iter(self.dataloader)
        # The profiler (--profiling.enable_profiling) and the CUDA memory recorder (--profiling.enable_memory_snapshot)
        # write under <dump_folder>/<their folders> every profiling.profile_freq steps; off, they are None.
        profiling, dump, step = job_config.profiling, job_config.job.dump_folder, self.step
        with (
            maybe_enable_profiling(profiling, global_step=step, base_folder=dump) as torch_profiler,
            maybe_enable_memory_snapshot(profiling, global_step=step, base_folder=dump) as memory_profiler,
        ):
            while self.step < self.last_step:
                self.step += 1
                self.gc_handler.run(self.step)
                self.train_step(data_iterator)
                self.checkpointer.save(self.step, last_step=self.step == self.last_step)
                if self.step < self.last_step and self.preemption.requested():
                    self.preemption.save_and_stop(self.checkpointer, self.step)  # raises Preempted
                if self.validator and self.validator.should_validate(self.step, self.last_step):
                    self.validate()
                if self.sampler and self.sampler.should_sample(self.step):
                    self.sample()
                if torch_profiler:
                    torch_profiler.step()
                if memory_profiler:
                    memory_profiler.step()
                if self.step == 1:
                    # Lazy init and compilation are done: tighten the timeout for faster failure.
                    dist_utils.set_pg_timeouts(
                        timedelta(seconds=job_config.comm.train_timeout_seconds), self.parallel_dims
                    )
        if self.last_step < job_config.training.steps:
            logger.info(f"Stopped at step {self.step} of {job_config.training.steps} (training.stop_at_step)")
        else:
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
        self.preemption.close()
        if self.dump_lock is not None:
            self.dump_lock.release()


def enable_debug_mode() -> None:
    """--debug.enable: synchronous CUDA kernels, so an error is raised at the kernel that failed (read when CUDA
    starts: set before any CUDA call here, and exported by train.sh), and autograd anomaly detection, which names
    the forward op whose backward produced a NaN. Both slow training down."""
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    torch.autograd.set_detect_anomaly(True)
    logger.info("Debug mode: CUDA_LAUNCH_BLOCKING=1, autograd anomaly detection on")


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        job_config = parse_args(sys.argv[1:] if argv is None else argv)
        if job_config.debug.enable:
            enable_debug_mode()
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
    except Preempted as e:
        return e.exit_status
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
