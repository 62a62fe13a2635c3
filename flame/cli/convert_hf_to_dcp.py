"""Convert an HF model folder to a flame DCP checkpoint that a run loads as step 0 and trains on from.

    python -m flame.cli.convert_hf_to_dcp --model <hf dir or hub name> --checkpoint <dump_folder>/checkpoint/step-0
        [--custom_model_path <package, .py file or dotted module>]

Reads FLA's model types (``transformer``, ``gated_deltanet``, ``delta_net``), flame's (``flame_<family>``),
``llama``, and any other model_type transformers knows, under its own names (flame's generic family; a user's
class once ``--custom_model_path`` has registered it); writes the model's tensors in float32 under flame's names
at the top level of a model-only DCP checkpoint (what torchtitan reads at step 0; upstream's PR #48 nested them
under ``model``, which it cannot read), ``flame.json`` and ``model_config.json`` (the flame model config to train
with: ``--model.config``). An existing checkpoint is never overwritten.
"""

import argparse
import sys
from pathlib import Path

from flame.checkpoint.layout import write_sidecar
from flame.cli import run_cli
from flame.errors import FlameError
from flame.hf.export import check_output_folder, check_tokenizer, load_tokenizer
from flame.hf.formats import import_adapter
from flame.hf.hub import resolve_model_folder
from flame.hf.load import TOKENIZER_FILES, read_hf_config
from flame.models.common.config_json import dumps_config
from flame.models.common.state_dict_adapter import ExportError
from flame.models.custom import import_target


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.cli.convert_hf_to_dcp", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model", required=True, help="HF model folder (config.json + safetensors) or hub name"
    )
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint folder to create: <dump>/checkpoint/step-0"
    )
    parser.add_argument(
        "--custom_model_path",
        help="module registering the model's classes (as --experimental.custom_model_path)",
    )
    return parser.parse_args(argv)


def convert(argv: list[str]) -> int:
    options = parse(argv)
    model, target = Path(resolve_model_folder(options.model)), Path(options.checkpoint)
    if not model.is_dir():
        raise FlameError(f"the HF model folder {model} does not exist")
    if target.name != "step-0":
        raise FlameError(
            f"flame loads a converted model as step 0: name the checkpoint folder step-0, not {target.name}"
        )
    if target.exists() and any(target.iterdir()):
        raise FlameError(
            f"{target} already exists and is not empty; remove it or choose another --checkpoint"
        )
    if options.custom_model_path:
        import_target(options.custom_model_path)
    adapter = import_adapter(read_hf_config(model))
    args = adapter.args
    has_tokenizer = any((model / name).is_file() for name in TOKENIZER_FILES)
    if has_tokenizer:
        check_tokenizer(load_tokenizer(str(model)), args)
    check_output_folder(target)

    import torch

    from flame.checkpoint.dcp_io import save_model_tensors
    from flame.hf.safetensors_io import load_safetensors
    from flame.models import build_model

    state = adapter.from_hf(load_safetensors(model))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model(args).state_dict().items()}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != expected[k])
    if missing or extra or wrong:
        what = (f"{wrong[0]} has shape {list(state[wrong[0]].shape)}, the config gives {list(expected[wrong[0]])}"
                if wrong else f"missing {missing[0]}" if missing else f"unexpected {extra[0]}")  # fmt: skip
        raise ExportError(f"the weights in {model} do not fit its config.json: {what}")
    state = {k: state[k].float() for k in expected}  # flame trains float32 master weights
    target.mkdir(parents=True, exist_ok=True)
    write_sidecar(target, args.to_dict(), str(model.resolve()) if has_tokenizer else None)
    (target / "model_config.json").write_text(dumps_config(args.to_dict(), indent=2) + "\n")
    save_model_tensors(target, state)  # .metadata last: the checkpoint is complete once it exists
    hint = f" --job.dump_folder {target.parent.parent}" if target.parent.name == "checkpoint" else ""
    print(f"Wrote {target} ({args.model_type}, {len(state)} tensors). Train on from it with:{hint} "
          f"--model.config {target / 'model_config.json'}" + (f" --model.tokenizer_path {model}" if has_tokenizer else ""))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(convert, argv)


if __name__ == "__main__":
    sys.exit(main())
