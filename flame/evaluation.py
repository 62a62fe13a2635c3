"""Evaluation with lm-evaluation-harness (the optional extra ``eval``) on an HF export, a dump folder's checkpoint
or a hub model, with flame's and FLA's model classes registered (``flame.eval`` is the command; the trainer runs
:func:`evaluate` on exports of its weights every ``eval.interval`` steps, flame/train/evaluator.py).

A local folder is loaded into flame's HF classes (whatever format it was exported in), a hub model by transformers
with flame's and FLA's types registered; lm-eval's ``hf`` model runs it in bfloat16 on CUDA and float32 on CPU
(unless a dtype is given).
Tasks are lm-eval's own (their data sets are downloaded, or read from the HF cache offline) plus the YAMLs in
``flame/assets/eval`` and in the given include folders; relative ``data_files`` in those YAMLs are read beside the
YAML, so a task with local data runs anywhere without network. Results go into a folder as ``results.json``
(lm-eval's results, configs and versions) and ``results.md`` (its table).
"""

import contextlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flame.checkpoint.layout import CheckpointError, checkpoint_folder
from flame.errors import FlameError

SHIPPED_TASKS = Path(__file__).resolve().parent / "assets" / "eval"
LM_EVAL_PIN = "lm-eval[hf]==0.4.13"
INSTALL_HINT = f'pip install -e ".[eval]" (or pip install "{LM_EVAL_PIN}")'


@dataclass
class EvalTarget:
    model: str  # what lm-eval loads: an HF folder or a hub name
    results: Path  # where results.json and results.md go
    step_path: Path | None = None  # the checkpoint exported, for a dump folder


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise FlameError(f"lm-evaluation-harness is not installed: {INSTALL_HINT}")


def resolve_target(target: str, step: int | None, output: str | None = None) -> EvalTarget:
    """What to evaluate: an HF folder as it is (unless ``step`` is given), a dump folder's checkpoint ``step``
    (default: the latest, exported to ``<dump>/eval/step-<N>/hf`` in float32), or a hub name."""
    path = Path(target)
    if path.is_dir() and (path / "config.json").is_file() and step is None:
        return EvalTarget(str(path), Path(output) if output else path / "eval")
    if path.is_dir():
        try:
            folder = checkpoint_folder(path)
        except CheckpointError as e:
            raise FlameError(
                f"{path} is neither an HF model folder (no config.json) nor a dump folder: {e}"
            ) from e
        from flame.checkpoint.layout import resolve_step_dir
        from flame.hf.export import export_checkpoint

        step_path = resolve_step_dir(folder, -1 if step is None else step)
        results = Path(output) if output else path / "eval" / step_path.name
        export_checkpoint(path, int(step_path.name.removeprefix("step-")), results / "hf")
        return EvalTarget(str(results / "hf"), results, step_path)
    if path.exists() or target.startswith((".", "/")) or target.count("/") != 1:
        raise FlameError(f"{target} is not a folder or a hub name (owner/name)")
    if step is not None:
        raise FlameError("--step selects a checkpoint of a dump folder; a hub model has none")
    return EvalTarget(target, Path(output) if output else Path("eval") / target.replace("/", "__"))


def local_task_folder(source: Path, destination: Path) -> Path:
    """Copy the task YAMLs of source into destination with their relative data_files made absolute (lm-eval
    would read them relative to the working directory)."""
    import yaml

    destination.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.glob("*.yaml")):
        config = yaml.safe_load(file.read_text())
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            for split, name in files.items():
                if not Path(name).is_absolute():
                    files[split] = str((file.parent / name).resolve())
        (destination / file.name).write_text(yaml.safe_dump(config, sort_keys=False))
    return destination


def comma_list(text: str) -> list[str]:
    """The non-empty names of a comma-separated option (--tasks, eval.tasks, eval.include_path)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def task_manager(
    tasks: list[str], include_paths: list[str], folder: Path, include_option: str = "--include_path"
):
    """lm-eval's task index with the shipped tasks and the include folders (copied into folder, see
    local_task_folder); FlameError naming the first unknown task (include_option: the option that names the
    include folders, for the message)."""
    require_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    folders = [local_task_folder(SHIPPED_TASKS, folder)]
    for i, include in enumerate(include_paths):
        if not Path(include).is_dir():
            raise FlameError(f"{include_option} {include} is not a folder of task YAMLs")
        folders.append(local_task_folder(Path(include), folder / f"include-{i}"))
    # Indexing lm-eval's own thousands of YAMLs takes seconds; plain tasks of the local folders do not need them
    # (groups and tags may name lm-eval's tasks).
    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    if all(task in manager.all_subtasks for task in tasks):
        return manager
    manager = TaskManager(include_path=[str(f) for f in folders])
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise FlameError(
            f"unknown lm-eval task {unknown[0]}: name one of lm-eval {lm_eval.__version__}'s tasks "
            f"(python -m lm_eval ls tasks), flame_corpus_last_word (shipped with flame) or a task of {include_option}"
        )
    return manager


def check_tasks(tasks: list[str], include_paths: list[str], include_option: str = "--include_path") -> None:
    with tempfile.TemporaryDirectory(prefix="flame-eval-tasks-") as folder:
        task_manager(tasks, include_paths, Path(folder), include_option)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def language_model(model: str, device: str, dtype: str, batch_size: int):
    """lm-eval's HF model around a local folder loaded into flame's classes (flame.hf.modeling.from_export: the
    training model's code, which runs on CPU too, where FLA's classes need CUDA or flash-attn), or around a hub
    model loaded by transformers with flame's and FLA's model types registered."""
    import torch
    from lm_eval.models.huggingface import HFLM

    if Path(model).is_dir():
        from flame.hf.export import load_tokenizer
        from flame.hf.modeling import from_export

        loaded = from_export(model, device=device, dtype=getattr(torch, dtype))
        return HFLM(
            pretrained=loaded, tokenizer=load_tokenizer(model), batch_size=batch_size, backend="causal"
        )
    import flame.hf

    flame.hf.register()
    if importlib.util.find_spec("fla") is not None:
        import fla.models  # noqa: F401  (registers FLA's model types with transformers' Auto classes)
    return HFLM(pretrained=model, device=device, dtype=dtype, batch_size=batch_size, backend="causal")


@contextlib.contextmanager
def bootstrap_in_this_process():
    """lm-eval bootstraps some standard errors (perplexity's) in a pool of fork()ed processes unless
    DISABLE_MULTIPROC is set (the same resamples, in one process). Forked from a process with a SIGTERM handler (the
    trainer's preemption handler, or any process that ran a trainer), the workers ignore the pool's closing SIGTERM
    and the pool waits for them forever."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = before


def evaluate(
    target: EvalTarget,
    tasks: list[str],
    include_paths: list[str] = (),
    device: str | None = None,
    dtype: str | None = None,
    batch_size: int = 8,
    limit: float | None = None,
    num_fewshot: int | None = None,
) -> dict:
    """Run lm-eval's tasks on the target; writes results.json and results.md into ``target.results`` and returns
    lm-eval's results dict."""
    require_lm_eval()
    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table

    device = device or default_device()
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    with tempfile.TemporaryDirectory(prefix="flame-eval-tasks-") as folder, bootstrap_in_this_process():
        manager = task_manager(tasks, include_paths, Path(folder))
        try:
            results = lm_eval.simple_evaluate(
                model=language_model(target.model, device, dtype, batch_size),
                tasks=tasks,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                log_samples=False,
            )
        except (ConnectionError, TimeoutError) as e:
            raise FlameError(
                f"a task's data set could not be downloaded ({type(e).__name__}): run once with network access "
                "(then HF_DATASETS_OFFLINE=1 reads the cache), or give the task as a local YAML (--include_path)"
            ) from e
    target.results.mkdir(parents=True, exist_ok=True)
    (target.results / "results.json").write_text(
        json.dumps(results, indent=2, default=handle_non_serializable, sort_keys=True) + "\n"
    )
    (target.results / "results.md").write_text(make_table(results) + "\n")
    return results
