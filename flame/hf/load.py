"""A checkpoint as flame's own model (DecoderLM, eval mode) and its tokenizer, whatever form the checkpoint has.

- A flame DCP checkpoint: a folder holding ``step-<N>`` checkpoints (a dump folder or its checkpoint folder). The
  step given (default: the latest complete one) is read with the model config its ``flame.json`` records (or
  ``config``, which must describe the same model), as flame.cli.convert_dcp_to_hf reads it.
- An HF export written by flame.cli.convert_dcp_to_hf (formats fla, flame, llama): config.json and safetensors,
  mapped back to flame's parameter names by the format's state-dict adapter (load_flame_model).

A dump folder that holds both (train.sh exports into the dump folder) is read as DCP unless it has no complete
checkpoint. The tokenizer is ``tokenizer`` if given, else the one the run recorded (DCP) or the export's own files;
a relative recorded path that does not exist from the working directory is tried from flame's source tree, where
the default job's ``flame/assets/tokenizer`` lives.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flame.checkpoint.layout import (
    CheckpointError,
    checkpoint_folder,
    latest_step,
    read_sidecar,
    resolve_step_dir,
)
from flame.errors import FlameError
from flame.hf.export import check_tokenizer, load_tokenizer
from flame.models.common.config_json import loads_config

SOURCE_TREE = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    source: str  # what was read, for the report: "DCP checkpoint <path>" or "HF export <path> (<model_type>)"


def dcp_folder(path: Path, step: int | None) -> Path | None:
    """The checkpoint folder to read as DCP, or None to read ``path`` as an HF export."""
    try:
        folder = checkpoint_folder(path)
    except CheckpointError as e:
        if (path / "config.json").is_file():
            if step is not None:
                raise FlameError(f"--step is for DCP checkpoints; {path} is an HF export without any") from e
            return None
        raise CheckpointError(
            f"{path} holds no step-<N> checkpoint and no HF export (config.json); pass a dump folder, its "
            "checkpoint folder or an HF export folder"
        ) from e
    if step is None and latest_step(folder) < 0 and (path / "config.json").is_file():
        return None
    return folder


def resolve_tokenizer_path(recorded: str) -> str:
    path = Path(recorded)
    if not path.is_absolute() and not path.exists() and (SOURCE_TREE / path).exists():
        return str(SOURCE_TREE / path)
    return recorded


def load_dcp(step_path: Path, config: str | None, device: str, dtype: torch.dtype) -> tuple:
    from flame.checkpoint.dcp_io import load_model_tensors
    from flame.hf.export import checkpoint_model_args
    from flame.models import build_model

    sidecar = read_sidecar(step_path)
    args = checkpoint_model_args(step_path, config, sidecar)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    if args.generic:
        # transformers' classes keep buffers that checkpoints do not hold (rotary frequencies) and tie their
        # weights in init_weights, as the trainer runs it; flame's own models read every tensor from the checkpoint.
        model.init_weights()
    load_model_tensors(step_path, model.state_dict())
    return model.to(device=device, dtype=dtype).eval(), (sidecar or {}).get("tokenizer")


def read_hf_config(model: Path) -> dict:
    file = model / "config.json"
    if not file.is_file():
        raise FlameError(f"{model} holds no config.json; pass an HF model folder")
    try:
        return loads_config(file.read_text())
    except json.JSONDecodeError as e:
        raise FlameError(f"{file} is not valid JSON ({e.msg} at line {e.lineno})") from e


def load_flame_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """flame's model (DecoderLM) with the weights of an HF folder, in eval mode."""
    from flame.hf.formats import import_adapter
    from flame.hf.safetensors_io import load_safetensors
    from flame.models import build_model

    adapter = import_adapter(read_hf_config(Path(path)))
    with torch.device("meta"):
        model = build_model(adapter.args)
    state = adapter.from_hf(load_safetensors(path))
    model.load_state_dict(state, assign=True, strict=True)
    if adapter.args.tie_word_embeddings:
        model.lm_head.weight = model.embeddings.weight
    return model.to(device=device, dtype=dtype).eval()


def load_transformers_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    import flame  # noqa: F401  (flame's model types)

    if read_hf_config(Path(path)).get("model_type") in ("transformer", "gated_deltanet", "delta_net"):
        import fla.models  # noqa: F401  (FLA's model types)
    from transformers import AutoModelForCausalLM

    from flame.compat import fla_layers_on_flame
    from flame.models.generic.model import FLA_LAYER_REPLACEMENTS

    # FLA's classes build their flash-attn attention layers and Mamba2 as flame's where their fast path does not import.
    with fla_layers_on_flame(FLA_LAYER_REPLACEMENTS):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def quietly_load_tokenizer(name: str):
    """load_tokenizer without transformers' warning that it does not know an export's model type (AutoTokenizer
    reads config.json next to the tokenizer files; FLA's and flame's model types are registered only on import)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load_tokenizer(name)
    finally:
        hf_logging.set_verbosity(verbosity)


def load(
    path: str | Path,
    step: int | None = None,
    config: str | None = None,
    tokenizer: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Loaded:
    path = Path(path)
    if not path.is_dir():
        raise FlameError(
            f"the checkpoint folder {path} does not exist; pass a dump folder, its checkpoint folder or an HF export"
        )
    folder = dcp_folder(path, step)
    if folder is not None:
        step_path = resolve_step_dir(folder, -1 if step is None else step)
        model, recorded = load_dcp(step_path, config, device, dtype)
        source = f"DCP checkpoint {step_path}"
    else:
        if config is not None:
            raise FlameError(f"--config is for DCP checkpoints; the HF export {path} has its own config.json")
        model = load_flame_model(path, device, dtype)
        recorded = str(path) if any((path / name).is_file() for name in TOKENIZER_FILES) else None
        source = f"HF export {path} ({read_hf_config(path)['model_type']})"
    name = tokenizer or (resolve_tokenizer_path(recorded) if recorded else None)
    if name is None:
        raise FlameError(f"{source} records no tokenizer; pass --tokenizer (e.g. flame/assets/tokenizer)")
    loaded_tokenizer = quietly_load_tokenizer(name)
    check_tokenizer(loaded_tokenizer, model.args)
    return Loaded(model, loaded_tokenizer, source)
