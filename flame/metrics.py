"""What a run reports every ``metrics.log_freq`` steps: one console line and TensorBoard scalars."""

import os
import resource
import time
from datetime import datetime, timedelta

import torch
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import get_peak_flops


def device_memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) GiB on a GPU; on the CPU the process's peak resident set twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return peak_rss, peak_rss


class MetricsLogger:
    def __init__(self, job_config, device: torch.device, rank: int, flops_per_token: int):
        self.log_freq = job_config.metrics.log_freq
        self.total_steps = job_config.training.steps
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak_flops = (
            get_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        )
        self.writer = None
        if job_config.metrics.enable_tensorboard and (rank == 0 or job_config.metrics.save_for_all_ranks):
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(
                job_config.job.dump_folder,
                job_config.metrics.save_tb_folder,
                datetime.now().strftime("%Y%m%d-%H%M"),
            )
            if job_config.metrics.save_for_all_ranks:
                folder = os.path.join(folder, f"rank_{rank}")
            self.writer = SummaryWriter(folder, max_queue=1000)
        self.reset_window(step=0)

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def reset_window(self, step: int) -> None:
        self.window_start = time.perf_counter()
        self.window_step = step
        self.window_tokens = 0
        self.window_data_time = 0.0
        if step == 0:
            self.run_start = self.window_start

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Add throughput, MFU, memory and ETA to ``metrics`` (loss, grad_norm, lr ...), print, write TB."""
        elapsed = time.perf_counter() - self.window_start
        tokens_per_second = self.window_tokens / elapsed
        metrics["throughput/tokens_per_second_per_device"] = tokens_per_second
        metrics["throughput/data_loading_share"] = self.window_data_time / elapsed
        if self.peak_flops:
            metrics["throughput/mfu_percent"] = (
                100 * self.flops_per_token * tokens_per_second / self.peak_flops
            )
        metrics["memory/peak_allocated_gib"], metrics["memory/peak_reserved_gib"] = device_memory_gib(
            self.device
        )
        steps_done = step - self.window_step
        eta = timedelta(seconds=int(elapsed / max(steps_done, 1) * (self.total_steps - step)))

        mfu = f"  mfu {metrics['throughput/mfu_percent']:5.1f}%" if self.peak_flops else ""
        logger.info(
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {metrics['loss/train']:7.4f}  "
            f"grad_norm {metrics['grad_norm']:7.3f}  lr {metrics['lr']:.2e}  "
            f"tok/s {tokens_per_second:,.0f}{mfu}  mem {metrics['memory/peak_reserved_gib']:.2f}GiB  "
            f"data {100 * metrics['throughput/data_loading_share']:.0f}%  eta {eta}"
        )
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
        self.reset_window(step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
