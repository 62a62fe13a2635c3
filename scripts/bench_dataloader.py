"""Benchmark flame's dataloader on this machine: tokens/s of one worker and how many workers feed a GPU.

    python scripts/bench_dataloader.py [--seq_len 2048] [--batch_size 8] [--tokens 3000000] [--target 150000]

It reads the shipped corpus (flame/assets/corpus) with the shipped tokenizer (flame/assets/tokenizer):

* per worker: the pipeline run in this process (no worker processes) with the tokenizer limited to one
  thread, as in a dataloader worker, so the figure is what one worker process produces on one core: reading,
  tokenizing, shuffling and packing (fixed windows and varlen), and reading prepared token shards;
* through the DataLoader with 1 and 2 worker processes, to check that workers add up on this machine;
* the number of workers needed to feed ``--target`` tokens/s per GPU, from the per-worker figure.

It prints a markdown table and writes it into the ``bench_dataloader`` section of docs/performance.md
(created if absent; the rest of the file is kept).
"""

import argparse
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flame.config import parse_args
from flame.data import build_dataloader, build_tokenizer
from flame.data.prepare import main as prepare_main

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "flame" / "assets"

PERFORMANCE_DOC = REPO / "docs" / "performance.md"
SECTION_START, SECTION_END = "<!-- bench_dataloader -->", "<!-- /bench_dataloader -->"


def tokens_per_second(make_loader, tokens: int, repeats: int) -> float:
    """Steady-state throughput, the median of ``repeats`` fresh loaders (this machine is shared): each clock
    starts after the first batch (worker start-up, first reads)."""
    rates = []
    for _ in range(repeats):
        batches = iter(make_loader())
        next(batches)
        seen, started = 0, time.perf_counter()
        while seen < tokens:
            inputs, _ = next(batches)
            seen += inputs["input"].numel()
        rates.append(seen / (time.perf_counter() - started))
    return statistics.median(rates)


def device() -> str:
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        model = found.group(1).strip() if found else model
    return f"{model}, {len(os.sched_getaffinity(0))} cores available"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="tokens timed per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per row (the median is shown)")
    parser.add_argument("--target", type=int, default=150_000, help="tokens/s one GPU consumes")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread, as in a dataloader worker

    def config(*flags: str):
        return parse_args(["--training.seq_len", str(args.seq_len), *flags])

    tokenizer = build_tokenizer(config())
    fixed = ["--training.batch_size", str(args.batch_size)]
    rows = []  # (what, worker processes, tokens/s)
    with tempfile.TemporaryDirectory() as prepared:
        prepare_main(
            [
                "--dataset",
                str(ASSETS / "corpus"),
                "--tokenizer",
                str(ASSETS / "tokenizer"),
                "--output",
                prepared,
            ]
        )
        cases = [
            ("online tokenization + fixed windows", fixed),
            ("online tokenization + varlen", ["--training.batch_size", "1", "--training.varlen"]),
            ("online tokenization + fixed windows, streaming", [*fixed, "--training.streaming"]),
            ("prepared tokens + fixed windows", [*fixed, "--training.dataset", prepared]),
        ]
        for workers in (1, 2):
            flags = [*fixed, "--training.dataloader.num_workers", str(workers)]
            cases.append(("online tokenization + fixed windows", flags))
        for what, flags in cases:
            job_config = config(*flags)
            rate = tokens_per_second(
                lambda c=job_config: build_dataloader(c, tokenizer), args.tokens, args.repeats
            )
            rows.append((what, job_config.training.dataloader.num_workers, rate))

    per_worker = rows[0][2]
    needed = math.ceil(args.target / per_worker)
    lines = [
        f"| pipeline (seq_len {args.seq_len}) | worker processes | tokens/s | tokens/s per worker |",
        "|---|---:|---:|---:|",
    ]
    for what, workers, rate in rows:
        shown = workers or "0 (main process)"
        lines.append(f"| {what} | {shown} | {rate:,.0f} | {rate / max(workers, 1):,.0f} |")
    table = "\n".join(lines)
    print(table)
    command = " ".join(["python scripts/bench_dataloader.py", *sys.argv[1:]])
    section = "\n".join(
        [
            SECTION_START,
            "## Dataloader throughput",
            "",
            f"Command: `{command}` on {device()} ({time.strftime('%Y-%m-%d')}); shipped corpus and tokenizer, "
            f"batch {args.batch_size} x {args.seq_len} (varlen: 1 x {args.seq_len}); median of {args.repeats} "
            f"runs of {args.tokens:,} tokens per row, timed after the first batch. Rows with 0 workers run the "
            "pipeline in the main process with one tokenizer thread, which is what one worker process does on "
            "one core.",
            "",
            table,
            "",
            f"One worker tokenizes and packs {per_worker:,.0f} tokens/s, {per_worker / args.target:.1f} times the "
            f"{args.target:,} tokens/s one GPU consumes: **{needed} dataloader worker{'s' * (needed > 1)} per GPU** "
            f"(`--training.dataloader.num_workers {needed}`), each on a core of its own, feed it. The rows with "
            "worker processes show how workers add up here, where they share the cores with the main process. "
            "Prepared tokens (`python -m flame.data.prepare`) cost almost nothing to read.",
            SECTION_END,
        ]
    )
    write_section(section)
    print(f"\nwrote the {SECTION_START} section of {PERFORMANCE_DOC.relative_to(REPO)}")


def write_section(section: str) -> None:
    text = PERFORMANCE_DOC.read_text() if PERFORMANCE_DOC.exists() else "# Performance\n"
    pattern = re.compile(re.escape(SECTION_START) + ".*?" + re.escape(SECTION_END), re.DOTALL)
    text = (
        pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    )
    PERFORMANCE_DOC.parent.mkdir(exist_ok=True)
    PERFORMANCE_DOC.write_text(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
