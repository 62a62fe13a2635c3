"""Evaluate a model with lm-evaluation-harness (``pip install -e ".[eval]"``).

    python -m flame.eval <export dir | dump folder [--step N] | hub name> --tasks <task>[,<task> ...]
        [--include_path <dir of task YAMLs>] [--batch_size 8] [--device cuda|cpu] [--dtype bfloat16|float32]
        [--limit N] [--num_fewshot N] [--output <dir>]

An HF folder is evaluated as it is; a dump folder's checkpoint (``--step``, default the latest) is exported first
into ``<dump>/eval/step-<N>/hf``. Results: ``results.json`` and ``results.md`` in ``<folder>/eval`` (an HF
folder), ``<dump>/eval/step-<N>`` (a checkpoint) or ``eval/<owner>__<name>`` (a hub model), or ``--output``.
``flame_corpus_last_word`` is shipped with flame and runs offline. See docs/evaluation.md.
"""

import argparse
import sys

from flame.cli import run_cli
from flame.errors import FlameError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flame.eval", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="HF export folder, dump folder, or hub name (owner/name)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--step", type=int, help="checkpoint step of a dump folder (default: the latest)")
    parser.add_argument(
        "--include_path", action="append", default=[], help="folder of task YAMLs (repeatable)"
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--device", help="cuda or cpu (default: cuda where available)")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument("--limit", type=float, help="examples per task (a fraction below 1)")
    parser.add_argument("--num_fewshot", type=int)
    parser.add_argument("--output", help="results folder (default: next to the model, see above)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    from flame.evaluation import check_tasks, comma_list, evaluate, resolve_target

    options = parse(argv)
    tasks = comma_list(options.tasks)
    if not tasks:
        raise FlameError("--tasks names no task")
    check_tasks(tasks, options.include_path)  # before an export that would be wasted
    target = resolve_target(options.model, options.step, options.output)
    results = evaluate(
        target,
        tasks,
        include_paths=options.include_path,
        device=options.device,
        dtype=options.dtype,
        batch_size=options.batch_size,
        limit=options.limit,
        num_fewshot=options.num_fewshot,
    )
    from lm_eval.utils import make_table

    print(make_table(results))
    print(f"Results: {target.results / 'results.json'}, {target.results / 'results.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
