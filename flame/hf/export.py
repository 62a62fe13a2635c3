"""Writing a flame model as an HF model folder: config.json, generation_config.json, tokenizer files, safetensors.

Every check (format, tokenizer vocabulary, output folder) runs before the first file is written, so bad input
leaves the output folder as it was.
"""

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from flame.checkpoint.layout import (
    NO_TRAINED_CHECKPOINT,
    CheckpointError,
    checkpoint_folder,
    config_differences,
    has_trained_checkpoint,
    read_sidecar,
    resolve_step_dir,
)
from flame.errors import FlameError, first_line
from flame.hf.export_options import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES
from flame.hf.formats import export_adapter
from flame.hf.safetensors_io import existing_export_files, parse_size, save_safetensors
from flame.models.common.args import ModelArgs
from flame.models.common.config_json import dumps_config
from flame.models.common.state_dict_adapter import StateDictAdapter

DTYPES = {name: getattr(torch, dtype) for name, dtype in EXPORT_DTYPES.items()}


@dataclass
class ExportPlan:
    adapter: StateDictAdapter
    note: str | None
    output: Path
    dtype: torch.dtype
    tokenizer: object | None


def check_output_folder(output: Path) -> None:
    """FlameError unless output is (or can be created as) a folder this process can write into."""
    if output.exists() and not output.is_dir():
        raise FlameError(f"output {output} exists and is not a folder; choose another --output")
    ancestor = output
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FlameError(f"cannot create the output folder {output}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise FlameError(f"the output folder {output} is not writable ({ancestor}); choose another --output")
    if output.exists():  # permissions can lie (network file systems, read-only mounts): try it
        try:
            with tempfile.NamedTemporaryFile(dir=output):
                pass
        except OSError as e:
            raise FlameError(f"cannot write into the output folder {output}: {e.strerror}") from e


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise FlameError(f"cannot load the tokenizer {path}: {first_line(e)}") from e


def check_tokenizer(tokenizer, args: ModelArgs) -> None:
    if len(tokenizer) > args.vocab_size:
        raise FlameError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {args.vocab_size}: "
            "it is not the tokenizer this model was trained with; pass the right --tokenizer"
        )


def plan_export(args: ModelArgs, output: Path, fmt: str, dtype: str, tokenizer: str | None) -> ExportPlan:
    if dtype not in DTYPES:
        raise FlameError(f"dtype {dtype} is not supported; choose one of: {', '.join(DTYPES)}")
    adapter, note = export_adapter(args, fmt)
    loaded = None
    if tokenizer is not None:
        loaded = load_tokenizer(tokenizer)
        check_tokenizer(loaded, args)
    check_output_folder(output)
    return ExportPlan(adapter, note, output, DTYPES[dtype], loaded)


def write_export(plan: ExportPlan, state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write the HF folder; returns the names of the files written."""
    import transformers
    from transformers import GenerationConfig

    hf_state = {k: v.to(plan.dtype) for k, v in plan.adapter.to_hf(state_dict).items()}
    config = plan.adapter.hf_config()
    config["dtype"] = str(plan.dtype).removeprefix("torch.")
    config["transformers_version"] = transformers.__version__
    output = plan.output
    output.mkdir(parents=True, exist_ok=True)
    for old in existing_export_files(output):  # an earlier export may have had other shards
        old.unlink()
    (output / "config.json").write_text(dumps_config(config, indent=2, sort_keys=True) + "\n")
    generation = GenerationConfig(
        bos_token_id=plan.adapter.args.bos_token_id,
        eos_token_id=plan.adapter.args.eos_token_id,
        pad_token_id=getattr(plan.tokenizer, "pad_token_id", None),
    )
    generation.save_pretrained(output)
    files = ["config.json", "generation_config.json"]
    if plan.tokenizer is not None:
        files += [Path(f).name for f in plan.tokenizer.save_pretrained(output)]
    files += save_safetensors(hf_state, output, max_shard_bytes)
    return files


def checkpoint_model_args(step_path: Path, config: str | None, sidecar: dict | None) -> ModelArgs:
    """The model args of a checkpoint: from ``config`` (which must match what the run recorded) or the sidecar."""
    from flame.models import load_model_args, model_args_from_dict

    if config is not None:
        args, _ = load_model_args(config)
        if sidecar is not None:
            differences = config_differences(sidecar["model_config"], args.to_dict())
            if differences:
                raise CheckpointError(
                    f"checkpoint {step_path} was trained with a different model config than {config}: "
                    + "; ".join(differences)
                )
        return args
    if sidecar is None:
        raise CheckpointError(
            f"checkpoint {step_path} records no model config (no flame.json); pass --config"
        )
    saved = sidecar["model_config"]
    args, _ = model_args_from_dict(saved)
    return args


def export_checkpoint(
    path: str | os.PathLike,
    step: int,
    output: Path,
    fmt: str = "auto",
    dtype: str = "float32",
    config: str | None = None,
    tokenizer: str | None = None,
    max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE),
) -> tuple[ExportPlan, Path, list[str]]:
    """Export checkpoint ``step`` (-1: the latest complete one) of a dump folder (or its checkpoint folder) as an HF
    folder; ``tokenizer`` defaults to the run's. Returns the plan, the step's folder and the files written."""
    step_path = resolve_step_dir(checkpoint_folder(path), step)
    sidecar = read_sidecar(step_path)
    args = checkpoint_model_args(step_path, config, sidecar)
    export_adapter(args, fmt)  # an impossible format fails before anything else is read
    tokenizer = tokenizer or (sidecar or {}).get("tokenizer")
    if tokenizer is None:
        raise FlameError(f"checkpoint {step_path} records no tokenizer; pass --tokenizer")
    plan = plan_export(args, output, fmt, dtype, tokenizer)

    from flame.checkpoint.dcp_io import load_model_tensors
    from flame.models import build_model

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in build_model(args).state_dict().items()}
    state = {k: torch.empty(shape, dtype=torch.float32) for k, shape in shapes.items()}
    load_model_tensors(step_path, state)
    return plan, step_path, write_export(plan, state, max_shard_bytes)


def export_report(plan: ExportPlan, step_path: Path, files: list[str]) -> list[str]:
    """What an export says when done: its format (with the note of flame's own format) and the files written."""
    model_type = plan.adapter.hf_config()["model_type"]
    dtype = str(plan.dtype).removeprefix("torch.")
    lines = [f"Exporting as {model_type} (loads after `import flame`): {plan.note}"] if plan.note else []
    return lines + [f"Converted {step_path} to {plan.output} ({model_type}, {dtype}): {', '.join(files)}"]


def export_after_training(dump_folder: str | os.PathLike) -> list[str]:
    """train.sh's end-of-run export, as upstream flame's train.sh converts its final checkpoint: the latest complete
    checkpoint past step 0 as an HF folder in the dump folder, with the run's recorded config and tokenizer; the
    lines to print."""
    if not has_trained_checkpoint(dump_folder):
        return [NO_TRAINED_CHECKPOINT]
    plan, step_path, files = export_checkpoint(dump_folder, -1, Path(dump_folder))
    return export_report(plan, step_path, files)
