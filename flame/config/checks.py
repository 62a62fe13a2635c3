"""Value checks of a parsed job: a wrong value stops the run at start-up with one line naming the option.

:func:`validate_job` runs in train.sh's pre-flight (flame.launch) and again in the trainer (for runs started
without train.sh), after the aliases are resolved. Parsing (flame.config.manager) only checks names and types;
this module checks that the values make sense together.
"""

import importlib.util
import math
import re

from flame.errors import ConfigError

# A hub repository id, [namespace/]name, as huggingface_hub's validate_repo_id accepts it (without the import).
HUB_REPO = re.compile(r"([\w.-]{1,96}/)?[\w.-]{1,96}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def varlen_batch_problem(varlen: bool, batch_size: int) -> str | None:
    """The one rule of varlen packing that a job's options can break (shared with flame.data.config)."""
    if varlen and batch_size != 1:
        return (
            f"training.varlen packs documents into one row of seq_len tokens: training.batch_size must be 1, "
            f"got {batch_size} (raise training.seq_len instead)"
        )
    return None


def schedule_steps(job_config) -> int:
    """Steps the LR schedule spans: lr_scheduler.total_steps if set, else training.steps."""
    total = job_config.lr_scheduler.total_steps
    return job_config.training.steps if total is None else total


def last_step(job_config) -> int:
    """The step a run ends at: training.stop_at_step (hard stop) if set, else training.steps."""
    stop = job_config.training.stop_at_step
    return job_config.training.steps if stop is None else stop


def l2warp_factor(model_args, job_config) -> float:
    """The strength of flame.loss.l2_warp in training (0: none): on with the model config's ``use_l2warp`` (FLA's key, true
    by default in RWKV7's config) or upstream flame's ``--training.enable_l2wrap``, at ``--training.l2wrap_factor``
    (FLA's 1e-4 unless set)."""
    training = job_config.training
    if not (model_args.use_l2warp or training.enable_l2wrap):
        return 0.0
    return 1e-4 if training.l2wrap_factor is None else training.l2wrap_factor


def validate_job(job_config) -> None:
    """Raise ConfigError with one line for the first bad value."""
    _check_training(job_config)
    _check_optimizer(job_config.optimizer)
    _check_lr_scheduler(job_config)
    _check_metrics(job_config.metrics)
    _check_hub_upload(job_config.checkpoint)
    _check_validation(job_config.validation)
    _check_inference(job_config.inference)
    _check_eval(job_config.eval)
    _check_profiling(job_config.profiling)
    _check_pipeline(job_config)
    _check_dpo(job_config)


def _check_training(job_config) -> None:
    training = job_config.training
    _require(training.steps >= 1, f"training.steps must be >= 1, got {training.steps}")
    stop = training.stop_at_step
    _require(
        stop is None or 1 <= stop <= training.steps,
        f"training.stop_at_step must be between 1 and training.steps ({training.steps}), got {stop}",
    )
    _require(
        math.isfinite(training.max_norm) and training.max_norm > 0,
        f"training.max_norm must be a positive number, got {training.max_norm} "
        "(gradients are always clipped; a large value such as 1e9 leaves them unchanged)",
    )
    _require(
        math.isfinite(training.z_loss) and training.z_loss >= 0,
        f"training.z_loss must be >= 0 (0 disables it), got {training.z_loss}",
    )
    factor = training.l2wrap_factor
    _require(
        factor is None or (math.isfinite(factor) and factor >= 0),
        f"training.l2wrap_factor must be >= 0, got {factor}",
    )
    _require(training.gc_freq >= 1, f"training.gc_freq must be >= 1, got {training.gc_freq}")
    problem = varlen_batch_problem(bool(training.varlen), training.local_batch_size)
    _require(problem is None, problem)


def _check_hub_upload(checkpoint) -> None:
    if not checkpoint.hf_upload_enabled:
        return
    _require(
        checkpoint.enable,
        "checkpoint.hf_upload_enabled uploads checkpoints, but checkpoint.enable is off; turn checkpoints on",
    )
    repo = checkpoint.hf_repo_base_name
    _require(
        bool(repo),
        "checkpoint.hf_upload_enabled needs the hub repository: pass --checkpoint.hf_repo_base_name <user/name>",
    )
    _require(
        HUB_REPO.fullmatch(repo) is not None and ".." not in repo and "--" not in repo,
        f"checkpoint.hf_repo_base_name must be a hub repository name 'user/name' (letters, digits, '-', '_', '.'), "
        f"got '{repo}'",
    )
    _require(
        checkpoint.hf_upload_format != "hf" or checkpoint.export_dtype in ("float32", "bfloat16"),
        f"checkpoint.hf_upload_format hf exports in float32 or bfloat16, got checkpoint.export_dtype "
        f"{checkpoint.export_dtype}",
    )
    _require(
        checkpoint.hf_upload_timeout >= 0,
        f"checkpoint.hf_upload_timeout must be >= 0 seconds, got {checkpoint.hf_upload_timeout}",
    )


def _check_optimizer(optimizer) -> None:
    _require(
        optimizer.name in ("Adam", "AdamW", "Muon"),
        f"optimizer.name must be AdamW, Adam or Muon, got '{optimizer.name}'",
    )
    _require(
        0 <= optimizer.muon_momentum < 1,
        f"optimizer.muon_momentum must be in [0, 1), got {optimizer.muon_momentum}",
    )
    _require(
        optimizer.muon_ns_iterations >= 1,
        f"optimizer.muon_ns_iterations must be >= 1, got {optimizer.muon_ns_iterations}",
    )
    _require(
        math.isfinite(optimizer.lr) and optimizer.lr > 0, f"optimizer.lr must be > 0, got {optimizer.lr}"
    )
    _require(optimizer.eps > 0, f"optimizer.eps must be > 0, got {optimizer.eps}")
    for name in ("beta1", "beta2"):
        value = getattr(optimizer, name)
        _require(0 <= value < 1, f"optimizer.{name} must be in [0, 1), got {value}")
    _require(
        optimizer.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {optimizer.weight_decay}"
    )
    _require(
        not optimizer.early_step_in_backward,
        "optimizer.early_step_in_backward is not supported: flame clips the gradient norm before every step",
    )


def _check_lr_scheduler(job_config) -> None:
    scheduler = job_config.lr_scheduler
    total = schedule_steps(job_config)
    _require(
        total >= job_config.training.steps,
        f"lr_scheduler.total_steps ({total}) must be >= training.steps ({job_config.training.steps}); "
        "to stop early on a longer schedule use --training.stop_at_step",
    )
    _require(
        scheduler.warmup_steps >= 0,
        f"lr_scheduler.warmup_steps must be >= 0, got {scheduler.warmup_steps}",
    )
    _require(
        0 <= scheduler.min_lr_factor <= 1,
        f"lr_scheduler.min_lr_factor (lr_min) is a fraction of the peak LR in [0, 1], got {scheduler.min_lr_factor}",
    )
    if scheduler.decay_ratio is not None:
        _require(
            0 <= scheduler.decay_ratio <= 1,
            f"lr_scheduler.decay_ratio must be in [0, 1], got {scheduler.decay_ratio}",
        )
        decay_steps = round(total * scheduler.decay_ratio)
        _require(
            min(scheduler.warmup_steps, total) + decay_steps <= total,
            f"lr_scheduler.warmup_steps ({scheduler.warmup_steps}) + decay steps ({decay_steps} = "
            f"decay_ratio x {total}) exceed the schedule ({total} steps)",
        )


def _check_metrics(metrics) -> None:
    _require(metrics.log_freq >= 1, f"metrics.log_freq must be >= 1, got {metrics.log_freq}")
    if metrics.enable_wandb:
        _require(
            importlib.util.find_spec("wandb") is not None,
            "metrics.enable_wandb needs the wandb package: pip install 'flame[wandb]' (or pip install wandb)",
        )


def _check_validation(validation) -> None:
    if not validation.enable:
        return
    _require(
        validation.dataset_path is None,
        "validation.dataset_path is not read by flame; name the data with --validation.dataset (and "
        "--validation.dataset_name, --validation.split)",
    )
    _require(validation.freq >= 1, f"validation.freq must be >= 1, got {validation.freq}")
    _require(
        validation.steps >= 1 or validation.steps == -1,
        f"validation.steps must be >= 1, or -1 for the whole split, got {validation.steps}",
    )
    for name in ("local_batch_size", "seq_len"):
        value = getattr(validation, name)
        _require(value is None or value >= 1, f"validation.{name} must be >= 1, got {value}")


def _check_inference(inference) -> None:
    _require(inference.interval >= 0, f"inference.interval must be >= 0 (0: off), got {inference.interval}")
    if not inference.interval:
        return
    _require(
        any(p.strip() for p in inference.prompt.split("|")),
        "inference.prompt is empty; give a prompt (several separated by '|')",
    )
    _require(
        inference.max_new_tokens >= 1,
        f"inference.max_new_tokens must be >= 1, got {inference.max_new_tokens}",
    )
    _require(
        inference.temperature >= 0,
        f"inference.temperature must be >= 0 (0: greedy), got {inference.temperature}",
    )
    _require(inference.top_k >= 0, f"inference.top_k must be >= 0 (0: all tokens), got {inference.top_k}")


def _check_eval(evaluation) -> None:
    """eval.* values, then lm-eval itself and every task name: a run that would fail at its first evaluation,
    possibly hours in, stops here instead."""
    _require(evaluation.interval >= 0, f"eval.interval must be >= 0 (0: off), got {evaluation.interval}")
    if not evaluation.interval:
        return
    from flame.evaluation import INSTALL_HINT, check_tasks, comma_list

    tasks = comma_list(evaluation.tasks)
    _require(
        bool(tasks),
        "eval.interval is set but eval.tasks names no task: give --eval.tasks <task>[,<task> ...] "
        "(flame_corpus_last_word runs offline) or set --eval.interval 0",
    )
    _require(evaluation.batch_size >= 1, f"eval.batch_size must be >= 1, got {evaluation.batch_size}")
    _require(
        evaluation.limit >= 0 and (evaluation.limit < 1 or evaluation.limit == int(evaluation.limit)),
        f"eval.limit is a number of examples per task or a fraction below 1 (0: all), got {evaluation.limit}",
    )
    _require(
        importlib.util.find_spec("lm_eval") is not None,
        f"eval.interval needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}",
    )
    check_tasks(tasks, comma_list(evaluation.include_path), include_option="eval.include_path")


def _check_profiling(profiling) -> None:
    if not (profiling.enable_profiling or profiling.enable_memory_snapshot):
        return
    _require(
        profiling.profile_freq >= 1, f"profiling.profile_freq must be >= 1, got {profiling.profile_freq}"
    )
    if profiling.enable_profiling:
        _require(
            profiling.profiler_warmup >= 0 and profiling.profiler_active >= 1,
            "profiling.profiler_warmup must be >= 0 and profiling.profiler_active >= 1",
        )
        _require(
            profiling.profiler_warmup + profiling.profiler_active <= profiling.profile_freq,
            f"profiling.profile_freq ({profiling.profile_freq}) must be >= profiler_warmup + profiler_active "
            f"({profiling.profiler_warmup} + {profiling.profiler_active})",
        )


def _check_dpo(job_config) -> None:
    if job_config.job.task != "dpo":
        return
    parallelism = job_config.parallelism
    _require(
        parallelism.pipeline_parallel_degree <= 1 and parallelism.context_parallel_degree <= 1,
        "job.task dpo scores whole sequences on one rank: use data parallelism (FSDP/HSDP) and tensor parallelism, "
        "not pipeline_parallel_degree or context_parallel_degree > 1",
    )
    _require(
        not job_config.training.varlen, "job.task dpo pads each reply to seq_len: drop --training.varlen"
    )
    _require(
        math.isfinite(job_config.dpo.beta) and job_config.dpo.beta > 0,
        f"dpo.beta must be a positive number, got {job_config.dpo.beta}",
    )


def _check_pipeline(job_config) -> None:
    if job_config.parallelism.pipeline_parallel_degree <= 1:
        return
    _require(
        job_config.training.z_loss == 0,
        "training.z_loss is not computed by the pipeline schedule's loss; set it to 0 with pipeline_parallel_degree > 1",
    )
    _require(
        not job_config.validation.enable,
        "validation runs the whole model on one rank; drop --validation.enable with pipeline_parallel_degree > 1",
    )
    _require(
        not job_config.inference.interval,
        "text samples run the whole model on one rank; set inference.interval 0 with pipeline_parallel_degree > 1",
    )
    _require(
        not job_config.eval.interval,
        "evaluation exports the whole model from one rank; set eval.interval 0 with pipeline_parallel_degree > 1 "
        "and evaluate the checkpoints with python -m flame.eval",
    )
