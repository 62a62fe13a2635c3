"""What a run reports: one console line every ``metrics.log_freq`` steps, the same values as TensorBoard scalars
(``--metrics.enable_tensorboard``, on by default) and W&B (``--metrics.enable_wandb``), plus validation results,
text samples and lm-eval scores (eval/<task>/<metric>). docs/metrics.md lists every metric.

Only rank 0 writes (every rank with ``--metrics.save_for_all_ranks``, each in its own TensorBoard folder); the
values are global (loss summed over data-parallel ranks) except throughput and memory, which are per device.
"""

import contextlib
import dataclasses
import os
import resource
import time
from datetime import datetime, timedelta

import torch
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import get_peak_flops

from flame.errors import ConfigError


def device_memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) GiB since start on a GPU; on the CPU the process's peak resident set twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return peak_rss, peak_rss


class TensorBoardWriter:
    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(folder, max_queue=1000)

    def scalars(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        # On disk at once (SummaryWriter would wait up to two minutes): a live TensorBoard, and a reader right
        # after training, see every logged step.
        self.writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """A W&B run in <dump_folder>/wandb; WANDB_MODE=offline logs there without network (``wandb sync`` later)."""

    def __init__(self, job_config):
        try:
            import wandb
        except ImportError as e:  # also checked at start-up by flame.config.checks
            raise ConfigError(
                "metrics.enable_wandb needs the wandb package: pip install 'flame[wandb]' (or pip install wandb)"
            ) from e
        self.wandb = wandb
        dump = job_config.job.dump_folder
        os.makedirs(dump, exist_ok=True)
        wandb.init(
            project=os.environ.get("WANDB_PROJECT", "flame"),
            name=os.environ.get("WANDB_NAME") or os.path.basename(os.path.abspath(dump)),
            dir=dump,
            config=dataclasses.asdict(job_config),
        )
        logger.info(f"W&B run {wandb.run.name} ({os.environ.get('WANDB_MODE', 'online')})")

    def scalars(self, metrics: dict[str, float], step: int) -> None:
        self.wandb.log(metrics, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.wandb.log({tag: self.wandb.Html(f"<pre>{text}</pre>")}, step=step)

    def close(self) -> None:
        self.wandb.finish()


# Upstream flame's (torchtitan's) names, written beside flame's own so that dashboards built on upstream runs read
# flame's: upstream name -> flame's metric it repeats. grad_norm and lr have the same names in both.
UPSTREAM_NAMES = {
    "loss_metrics/global_avg_loss": "loss/train",
    "throughput(tps)": "throughput/tokens_per_second_per_device",
    "mfu(%)": "throughput/mfu_percent",
    "memory/max_active(GiB)": "memory/peak_allocated_gib",
    "memory/max_reserved(GiB)": "memory/peak_reserved_gib",
}
# The trainer's per-rank value from which the logger takes the maximum over ranks (upstream's global_max_loss).
RANK_LOSS = "loss/rank_mean"


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of all ranks (every rank calls this at the same step)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return value
    tensor = torch.tensor(value, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor)


def upstream_metrics(metrics: dict[str, float], flops_per_token: int) -> dict[str, float]:
    """Upstream flame's names for ``metrics`` (after the logger added throughput and memory)."""
    named = {name: metrics[ours] for name, ours in UPSTREAM_NAMES.items() if ours in metrics}
    tokens_per_second = metrics["throughput/tokens_per_second_per_device"]
    named["tflops"] = flops_per_token * tokens_per_second / 1e12
    named["time_metrics/data_loading(%)"] = 100 * metrics["throughput/data_loading_share"]
    return named


@dataclasses.dataclass
class Instant:
    """A point of the training loop: the host's clock and, on a GPU, an event queued behind the work so far (its
    time is when the device got there)."""

    time: float
    event: torch.cuda.Event | None

    @classmethod
    def now(cls, device: torch.device) -> "Instant":
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
        return cls(time.perf_counter(), event)

    def device_seconds_since(self, start: "Instant") -> float:
        """From ``start`` to here as the device ran it: on a GPU between the events (this waits for the work queued
        before this one, which reading back its results has mostly waited for already); on the CPU, which ran the
        work before it was queued, between the host's times."""
        if self.event is None or start.event is None:
            return self.time - start.time
        self.event.synchronize()
        return start.event.elapsed_time(self.event) / 1000


@dataclasses.dataclass
class StepEnd:
    """Where a step ended (or a measuring window started), with the run's totals up to there."""

    step: int
    at: Instant
    tokens: int
    data_seconds: float  # host clock
    other_seconds: float  # host clock
    other_device_seconds: float


class MetricsLogger:
    """A line covers the steps since the last line: from where the last logged step ended to where this one ended.
    The trainer marks each step's end (``end_step``) as soon as the step is queued, and writes the line later (a
    step's values are read back while the next step runs), so a line's window does not depend on when it is written.
    """

    def __init__(self, job_config, device: torch.device, rank: int, flops_per_token: int, last_step: int):
        self.log_freq = job_config.metrics.log_freq
        self.last_step = last_step
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak_flops = (
            get_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        )
        self.writers = []
        metrics = job_config.metrics
        if rank == 0 or metrics.save_for_all_ranks:
            if metrics.enable_tensorboard:
                folder = os.path.join(
                    job_config.job.dump_folder, metrics.save_tb_folder, datetime.now().strftime("%Y%m%d-%H%M")
                )
                if metrics.save_for_all_ranks:
                    folder = os.path.join(folder, f"rank_{rank}")
                self.writers.append(TensorBoardWriter(folder))
            if metrics.enable_wandb and rank == 0:
                self.writers.append(WandbWriter(job_config))
        # Running totals: tokens trained on, seconds the training loop waited for data, and the time of the work
        # between steps that is not training (validation, text samples, evaluation: ``other_work``).
        self.tokens = 0
        self.data_seconds = 0.0
        self.other_seconds = 0.0
        self.other_device_seconds = 0.0
        self.step_ends: dict[int, StepEnd] = {}  # of the log steps whose line is not written yet
        self.reset_window(step=0)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.last_step

    def mark(self, step: int) -> StepEnd:
        """Here, as the end of ``step``."""
        return StepEnd(
            step,
            Instant.now(self.device),
            self.tokens,
            self.data_seconds,
            self.other_seconds,
            self.other_device_seconds,
        )

    def end_step(self, step: int, tokens: int, data_seconds: float) -> None:
        """``step``'s work is queued (on the CPU: done): it trained on ``tokens`` tokens after ``data_seconds`` of
        waiting for data since the last step ended. Its line's window ends here, whenever the line is written."""
        self.tokens += tokens
        self.data_seconds += data_seconds
        if self.should_log(step):  # only a logged step's end bounds a window: no event on the other steps
            self.step_ends[step] = self.mark(step)

    @contextlib.contextmanager
    def other_work(self):
        """Around work between steps that is not training (validation, text samples, evaluation): the throughput
        leaves its time out."""
        start = Instant.now(self.device)
        yield
        end = Instant.now(self.device)
        self.other_seconds += end.time - start.time
        self.other_device_seconds += end.device_seconds_since(start)

    def reset_window(self, step: int) -> None:
        """Start a new measuring window (throughput, data-loading share and ETA average over it) here."""
        self.window_start = self.mark(step)
        self.step_ends.clear()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Add throughput, MFU, memory and ETA to ``metrics`` (loss, grad_norm, lr ...), print, write (with
        upstream flame's names too). Every rank calls it at the same steps: the max loss over ranks is a collective."""
        rank_loss = metrics.pop(RANK_LOSS, None)
        # The window: from the end of the step last logged to the end of this one (here, if end_step did not mark
        # it); on a GPU timed by the device, the data waits by the host that waited.
        end = self.step_ends.pop(step, None) or self.mark(step)
        start, self.window_start = self.window_start, end
        for earlier in [s for s in self.step_ends if s < step]:
            del self.step_ends[earlier]
        elapsed = end.at.device_seconds_since(start.at)
        training_time = elapsed - (end.other_device_seconds - start.other_device_seconds)
        tokens_per_second = (end.tokens - start.tokens) / max(training_time, 1e-9)
        metrics["throughput/tokens_per_second_per_device"] = tokens_per_second
        host_training_time = end.at.time - start.at.time - (end.other_seconds - start.other_seconds)
        metrics["throughput/data_loading_share"] = (end.data_seconds - start.data_seconds) / max(
            host_training_time, 1e-9
        )
        if self.peak_flops:
            metrics["throughput/mfu_percent"] = (
                100 * self.flops_per_token * tokens_per_second / self.peak_flops
            )
        metrics["memory/peak_allocated_gib"], metrics["memory/peak_reserved_gib"] = device_memory_gib(
            self.device
        )
        steps_done = max(step - start.step, 1)
        eta = timedelta(seconds=int(elapsed / steps_done * (self.last_step - step)))

        parts = [
            f"step {step:>{len(str(self.last_step))}}/{self.last_step}",
            f"loss {metrics['loss/train']:7.4f}",
            f"z_loss {metrics['loss/z_loss']:.2e}" if "loss/z_loss" in metrics else "",
            f"grad_norm {metrics['grad_norm']:7.3f}",
            f"lr {metrics['lr']:.2e}",
            f"tok/s {tokens_per_second:,.0f}",
            f"mfu {metrics['throughput/mfu_percent']:5.1f}%" if self.peak_flops else "",
            f"mem {metrics['memory/peak_reserved_gib']:.2f}GiB",
            f"data {100 * metrics['throughput/data_loading_share']:.0f}%",
            f"skipped {metrics['skipped_steps']}" if metrics.get("skipped_steps") else "",
            f"eta {eta}",
        ]
        logger.info("  ".join(part for part in parts if part))
        written = {**metrics, **upstream_metrics(metrics, self.flops_per_token)}
        if rank_loss is not None:
            written["loss_metrics/global_max_loss"] = max_over_ranks(rank_loss, self.device)
        for writer in self.writers:
            writer.scalars(written, step)

    def log_validation(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        logger.info(
            f"validation at step {step}: loss {metrics['loss/validation']:.4f}  "
            f"perplexity {metrics['perplexity/validation']:.2f}  "
            f"({metrics['validation/tokens']:,.0f} tokens, {seconds:.1f}s)"
        )
        for writer in self.writers:
            writer.scalars(metrics, step)

    def log_eval(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        """lm-eval's scores as eval/<task>/<metric>: one console line (standard errors left out), every writer."""
        tasks: dict[str, list[str]] = {}
        for name, value in metrics.items():
            task, metric = name.removeprefix("eval/").split("/", 1)
            if "_stderr" not in metric:
                tasks.setdefault(task, []).append(f"{metric} {value:.4g}")
        scores = "; ".join(f"{task} {' '.join(values)}" for task, values in tasks.items())
        logger.info(f"eval at step {step} ({seconds:.1f}s): {scores}")
        for writer in self.writers:
            writer.scalars(metrics, step)

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """(prompt, completion) pairs: console, and TensorBoard text under samples/<i>."""
        for i, (prompt, completion) in enumerate(samples):
            logger.info(f"sample {i} at step {step}: {prompt!r} -> {completion!r}")
            for writer in self.writers:
                writer.text(f"samples/{i}", f"**{prompt}**{completion}", step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
