"""flame's trainer: ``torchrun ... -m flame.train [--section.field value ...]`` (train.sh does this through
``python -m flame.launch_local`` on one node).

``Trainer.train`` is the loop: a step (``TrainStep``, flame/train/step.py) on ``accumulation`` micro-batches,
its metrics, then a checkpoint, validation, text samples and lm-eval's tasks (flame/train/evaluator.py) when due, until training.steps or the hard stop
training.stop_at_step. ``Trainer.__init__`` assembles the parts, one call each.
"""

import dataclasses
import os
import sys
import time
from datetime import timedelta

import torch
import torchtitan  # noqa: F401  (the real package, before flame.config parses: see compat.torchtitan_job_config)
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as tt_utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling

from flame import compat
from flame.checkpoint.hf_on_save import ExportOnSave
from flame.checkpoint.hub_upload import HubUploader
from flame.checkpoint.lock import hold_for_trainer
from flame.checkpoint.manager import CheckpointManager
from flame.checkpoint.preemption import Preempted, Preemption
from flame.checkpoint.rng import RNGState
from flame.config import parse_args
from flame.config.checks import last_step, validate_job
from flame.data import build_dataloader, build_tokenizer
from flame.data.prefetch import DevicePrefetcher
from flame.errors import FlameError
from flame.metrics import RANK_LOSS, MetricsLogger
from flame.models import check_device, load_model_args
from flame.models.common.args import ModelArgs
from flame.models.custom import import_custom_modules
from flame.optim.nonfinite import NonFiniteSteps
from flame.parallelize.activation_offload import host_peak_gib
from flame.process_end import end_with_parent
from flame.samples import SampleGenerator
from flame.train.evaluator import Evaluator
from flame.train.model_parts import Topology, build_model_parts
from flame.train.objective import DPOObjective, build_objective
from flame.train.step import StepResult, build_train_step
from flame.validate import Validator


def init_topology(job_config) -> Topology:
    """This process's device, the process groups and the parallel meshes of the job."""
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    world_size = dist_utils.init_distributed(job_config.comm, base_folder=job_config.job.dump_folder)
    p = job_config.parallelism
    parallel_dims = ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=world_size,
    )
    dist_utils.set_determinism(parallel_dims, device, job_config.debug, distinct_seed_mesh_dims=["pp"])
    return Topology.of(parallel_dims, device)


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


def accumulation_steps(training, dp_degree: int) -> int:
    """Micro-batches per optimizer step: given, or what makes training.global_batch_size."""
    if training.gradient_accumulation_steps is not None:
        return training.gradient_accumulation_steps
    if training.global_batch_size <= 0:
        return 1
    per_step = training.local_batch_size * dp_degree
    if training.global_batch_size % per_step:
        raise FlameError(
            f"training.global_batch_size {training.global_batch_size} is not a multiple of "
            f"local batch size x data-parallel degree = {per_step}"
        )
    return training.global_batch_size // per_step


@dataclasses.dataclass
class PendingLog:
    step: int
    result: StepResult
    lr: float
    tokens_seen: int


class Trainer(Stateful):
    def __init__(self, job_config):
        validate_job(job_config)
        self.job_config = job_config
        training = job_config.training
        self.last_step = last_step(job_config)  # training.steps, or training.stop_at_step (hard stop)
        self.topology = init_topology(job_config)
        self.dump_lock = hold_for_trainer(job_config.job.dump_folder)  # None when train.sh holds it
        self.device = self.topology.device
        self.dp_degree, self.dp_rank = self.topology.dp_degree, self.topology.dp_rank
        self.gc_handler = tt_utils.GarbageCollection(gc_freq=training.gc_freq, debug=training.gc_debug)

        # Tokenizer, model config and data.
        self.tokenizer = build_tokenizer(job_config)
        import_custom_modules(job_config.experimental)
        self.model_args, notices = load_model_args(job_config.model.config, job_config.model.impl)
        for notice in notices:
            logger.warning(f"{job_config.model.config}: {notice}")
        fit_vocab_to_tokenizer(self.model_args, self.tokenizer, job_config.model.resize_vocab)
        check_device(self.model_args, self.device.type)
        self.dataloader = build_dataloader(
            job_config,
            self.tokenizer,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_degree,
            device_type=self.device.type,
        )

        # Model and optimization; DPO also runs a frozen copy of the starting weights (the reference).
        self.model = build_model_parts(self.model_args, self.topology, job_config)
        self.model_parts = self.model.parts
        objective = build_objective(self.model_args, self.topology, job_config)
        self.reference = objective.reference if isinstance(objective, DPOObjective) else None
        self.accumulation = accumulation_steps(training, self.dp_degree)
        # The next step's micro-batches are fetched and copied while this step runs; checkpoints save the loader's
        # place as of the batches trained on. Context parallelism slices the rows on the host first.
        self.batches = DevicePrefetcher(
            self.dataloader,
            self.device if self.topology.cp_group is None else None,
            ahead=self.accumulation,
        )
        self.nonfinite_steps = NonFiniteSteps(
            training.skip_nan_inf, training.skip_nan_inf_limit, self.model_parts
        )
        self.train_step_fn = build_train_step(self.model, self.topology, job_config, objective=objective)
        self.optimizers = self.train_step_fn.optimizers
        self.lr_schedulers = self.train_step_fn.lr_schedulers
        self.amp = self.train_step_fn.amp

        # State saved with every checkpoint (train_state is this object: step, tokens, skipped steps; rng: the
        # random generators of every rank). flame.json in each step directory records the model config.
        self.step = 0
        self.ntokens_seen = 0
        self.pending_log: PendingLog | None = None  # a log step's metrics, read back during the next step
        self.hub_uploader = self._build_hub_uploader()  # checkpoints to the hub, in the background
        # Checkpoints to HF folders beside them, in the background.
        self.hf_exporter = self._build_hf_exporter()
        self.checkpointer = self._build_checkpointer()
        checkpoint = job_config.checkpoint
        self.preemption = Preemption(
            checkpoint.preempt_signals, checkpoint.preempt_timeout, job_config.job.dump_folder
        )
        # An async checkpoint must finish copying the weights before the optimizer changes them.
        self.train_step_fn.before_update = self.checkpointer.maybe_wait_for_staging

        # Metrics, and the optional work between steps: validation loss, text samples and evaluation.
        self.metrics = MetricsLogger(
            job_config, self.device, torch.distributed.get_rank(), self.model.flops_per_token, self.last_step
        )
        batch_mesh = (
            self.topology.parallel_dims.get_mesh("batch") if self.topology.parallel_dims.dp_enabled else None
        )
        self.validator = (
            Validator(job_config, self.tokenizer, self.dp_rank, self.dp_degree, batch_mesh)
            if job_config.validation.enable
            else None
        )
        self.sampler = SampleGenerator(job_config, self.tokenizer) if job_config.inference.interval else None
        self.evaluator = (
            Evaluator(job_config, self.model_args, self._tokenizer_source())
            if job_config.eval.interval
            else None
        )
        if job_config.profiling.enable_memory_snapshot and self.device.type != "cuda":
            raise FlameError("profiling.enable_memory_snapshot records CUDA memory; it needs a GPU")
        stop = f", stopping at step {self.last_step}" if self.last_step < training.steps else ""
        logger.info(
            f"Training {training.steps} steps{stop} of {training.local_batch_size} x {training.seq_len} tokens per "
            f"device, {self.dp_degree} data-parallel ranks, {self.accumulation} accumulation step(s)"
        )

    def _tokenizer_source(self) -> str:
        """The tokenizer as checkpoints and exports record it: an absolute folder, or a hub name."""
        path = self.job_config.model.tokenizer_path
        return os.path.abspath(path) if os.path.isdir(path) else path

    def _build_checkpointer(self) -> CheckpointManager:
        job_config = self.job_config
        states = {"train_state": self, "rng": RNGState()}
        if self.reference is not None:  # a resumed DPO run keeps comparing against its starting weights
            states["reference_model"] = ModelWrapper(self.reference.parts)
        return CheckpointManager(
            dataloader=self.batches,
            model_parts=self.model_parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states=states,
            checkpoint_config=job_config.checkpoint,
            sd_adapter=None,
            base_folder=job_config.job.dump_folder,
            model_config=self.model_args.to_dict(),
            tokenizer=self._tokenizer_source(),
            verify_checksums=job_config.checkpoint.verify_checksums,
            hub_uploader=self.hub_uploader,
            hf_exporter=self.hf_exporter,
        )

    def _build_hf_exporter(self) -> ExportOnSave | None:
        """checkpoint.convert_to_hf_on_save: the exporter, on rank 0 (which finishes every save: the rename)."""
        checkpoint = self.job_config.checkpoint
        if not (checkpoint.enable and checkpoint.convert_to_hf_on_save) or torch.distributed.get_rank() != 0:
            return None
        folder = os.path.join(self.job_config.job.dump_folder, checkpoint.folder)
        return ExportOnSave(folder, export_dtype=checkpoint.export_dtype)

    def _build_hub_uploader(self) -> HubUploader | None:
        """checkpoint.hf_upload_enabled: the uploader, on rank 0 (which finishes every save: the rename)."""
        checkpoint = self.job_config.checkpoint
        if not checkpoint.hf_upload_enabled or torch.distributed.get_rank() != 0:
            return None
        return HubUploader(
            checkpoint.hf_repo_base_name,
            os.path.join(self.job_config.job.dump_folder, checkpoint.folder),
            upload_format=checkpoint.hf_upload_format,
            keep_latest_k=checkpoint.keep_latest_k,
            private=checkpoint.hf_repo_private,
            export_dtype=checkpoint.export_dtype,
        )

    def train_step(self, data: DevicePrefetcher) -> None:
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        batches = [next(data) for _ in range(self.accumulation)]
        self.ntokens_seen += sum(labels.numel() for _, labels in batches)
        result = self.train_step_fn(batches)
        # The step ends here for its line's throughput, whenever that line is written: its values are read back
        # during the next step, or at once (below), and the lines must measure the same spans either way.
        self.metrics.end_step(self.step, result.tokens, self.batches.wait_seconds)
        self.batches.wait_seconds = 0.0
        # The step's kernels are queued: the next step's batches load and copy while they run, and the last log
        # step's metrics are read back (which waits for that step only, not for this one).
        data.prefetch()
        self.write_log()
        # training.skip_nan_inf: the last step's verdict is read now too (it names the parameters and stops at the
        # limit); this step's where it is logged or saved.
        self.nonfinite_steps.record(self.step, result.skipped, result.grad_norm, result.gradient_norms)
        final = self.step == self.last_step
        saves = self.checkpointer.due(self.step, final)
        if self.metrics.should_log(self.step):
            self.pending_log = PendingLog(self.step, result, lr, self.ntokens_seen * self.dp_degree)
            # At once: the first step's time is the time to it, the last has no next step, and a save waits for
            # its step anyway (its line is then on record before the save, should the save be cut short).
            if self.step == 1 or final or saves:
                self.write_log()
        if saves or final:
            self.nonfinite_steps.settle()

    def write_log(self) -> None:
        """Read back and log the metrics of the pending log step (every rank at the same step: collectives)."""
        if self.pending_log is None:
            return
        pending, self.pending_log = self.pending_log, None
        self.nonfinite_steps.settle()  # skipped_steps as of that step
        result = pending.result
        means = self.train_step_fn.global_metrics(result)
        metrics = {
            "loss/train": means.pop("loss"),
            # This rank's own mean, whose maximum over ranks the metrics logger reports (global_max_loss).
            RANK_LOSS: float(result.metrics["loss"] / result.local_share.clamp(min=1e-12)),
            "grad_norm": float(result.grad_norm),
            "lr": pending.lr,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": pending.tokens_seen,
        }
        if "z_loss" in means:
            metrics["loss/z_loss"] = means.pop("z_loss")
        if "aux_loss" in means:
            metrics["loss/aux"] = means.pop("aux_loss")
        metrics.update(means)
        self.metrics.log(pending.step, metrics)

    def validate(self) -> None:
        self.write_log()  # its step's line first
        start = time.perf_counter()
        with self.metrics.other_work():
            results = self.validator.validate(self.model_parts[0], self.device, self.amp)
        self.metrics.log_validation(self.step, results, time.perf_counter() - start)

    def sample(self) -> None:
        self.write_log()  # its step's line first
        with self.metrics.other_work():
            samples = self.sampler.generate(self.model_parts[0], self.device, self.amp, self.step)
        self.metrics.log_samples(self.step, samples)

    def evaluate(self) -> None:
        self.write_log()  # its step's line first
        start = time.perf_counter()
        with self.metrics.other_work():
            results = self.evaluator.evaluate(self.model_parts[0], self.step)
        self.metrics.log_eval(self.step, results, time.perf_counter() - start)

    def train(self) -> None:
        job_config = self.job_config
        self.checkpointer.load(step=job_config.checkpoint.load_step)
        if self.reference is not None and self.step == 0:
            # A new DPO run: the reference is the model it starts from (random, or checkpoint.initial_load_path).
            for reference, part in zip(self.reference.parts, self.model_parts):
                reference.load_state_dict(part.state_dict())
        logger.info(f"Training starts at step {self.step + 1}")
        self.metrics.reset_window(self.step)
        # Creating the iterator draws from torch's generator (the workers' base seed): kept out of the run's random
        # stream, so that a resumed run, which creates it at another step, draws what the uninterrupted run draws.
        with torch.random.fork_rng(devices=[]):
            iter(self.batches)
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
                self.train_step(self.batches)
                self.checkpointer.save(self.step, last_step=self.step == self.last_step)
                if self.step < self.last_step and self.preemption.requested():
                    self.write_log()
                    self.nonfinite_steps.settle()
                    self.preemption.save_and_stop(self.checkpointer, self.step)  # raises Preempted
                if self.validator and self.validator.should_validate(self.step, self.last_step):
                    self.validate()
                if self.sampler and self.sampler.should_sample(self.step):
                    self.sample()
                if self.evaluator and self.evaluator.should_evaluate(self.step, self.last_step):
                    self.evaluate()
                if torch_profiler:
                    torch_profiler.step()
                if memory_profiler:
                    memory_profiler.step()
                if self.step == 1:
                    if (host_gib := host_peak_gib(self.model_parts)) is not None:
                        logger.info(
                            f"Activation offloading: the first step's activations took {host_gib:.3g} GiB of host memory"
                        )
                    # Lazy init and compilation are done: tighten the timeout for faster failure.
                    dist_utils.set_pg_timeouts(
                        timedelta(seconds=job_config.comm.train_timeout_seconds), self.topology.parallel_dims
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

    @property
    def skipped_steps(self) -> int:
        return self.nonfinite_steps.skipped_steps

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.nonfinite_steps.skipped_steps = state_dict.get("skipped_steps", 0)

    def close(self) -> None:
        self.checkpointer.close()  # finishes the last save, which the hub uploader and the HF exporter then get
        # After a preemption signal the grace period is short: the next launch uploads what is left.
        preempted = self.preemption.received is not None
        if self.hf_exporter is not None:
            self.hf_exporter.close(wait=not preempted)
        if self.hub_uploader is not None:
            self.hub_uploader.close(0 if preempted else self.job_config.checkpoint.hf_upload_timeout)
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


def end_with_the_launcher() -> None:
    """Has the kernel kill this rank when torchrun, which started it, ends. torchrun starts each rank in a session
    of its own and stops it on SIGTERM; a SIGKILL to torchrun or its process group (a timeout's, ``kill -9``) leaves
    the ranks training and holding their GPUs. Linux's parent-death signal (prctl) ends them with torchrun; a
    crash mid-save keeps the previous checkpoint, as any crash does. A rank not started by torchrun is left as is
    (flame.launch_local asks for the same signal when it starts its ranks)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_parent()


# Set by train.sh (FLAME_EXPORT_HF, node 0): rank 0 exports the run's final checkpoint as an HF folder once the run has
# finished, where torch, DCP and transformers are imported already (a second process took ~4 s on a 2-core machine).
EXPORT_AT_END_ENV = "FLAME_EXPORT_HF_AT_END"


def main(argv: list[str] | None = None) -> int:
    end_with_the_launcher()
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
    if os.environ.get(EXPORT_AT_END_ENV) == "1" and int(os.environ.get("RANK", "0")) == 0:
        from flame.hf.export import export_after_training

        try:
            for line in export_after_training(job_config.job.dump_folder):
                print(line, flush=True)
        except FlameError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0
