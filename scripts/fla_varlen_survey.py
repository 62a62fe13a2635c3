"""Which FLA families keep packed documents apart on the GPU: for each FLA 0.6.0 model type, a tiny model (float32,
TF32 off) reads one row of three documents with cu_seqlens, as flame's generic model passes them with
--training.varlen, and each document alone; a family whose layers all honour cu_seqlens gives the same logits.

    python scripts/fla_varlen_survey.py [--families gla,kda,...]

prints one line per family: its largest difference relative to the logits' scale, and whether flame lists it in
flame.models.generic.args.FLA_PACKED_DOCUMENT_MODEL_TYPES (the families --training.varlen accepts). A family that
passes here is added there together with a row of tests/gpu/test_fla_varlen.py. Needs a CUDA GPU."""

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.generic.args import FLA_PACKED_DOCUMENT_MODEL_TYPES, fla_model_types  # noqa: E402

LENGTHS = (100, 1, 155)  # three documents; lengths that no chunk size divides
TOLERANCE = 1e-4  # float32 kernels, chunked differently for the packed row and each document
SHAPE = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 2}
# Settings some families need at this size (as tests/models/generic/test_fla_families.py builds them).
OVERRIDES = {
    "rodimus": {"ska_attn": {"num_heads": 4}},
    "samba": {"attn": {"layers": [1], "num_heads": 4}},
}


def packed_difference(model_type: str, device: torch.device) -> float:
    """max |packed - alone| / max |alone| over the logits of the three documents."""
    config = {"model_type": model_type, **SHAPE, **OVERRIDES.get(model_type, {})}
    args, _ = model_args_from_dict(config, impl="fla")  # FLA's class, also for the types flame implements
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args)
    model.init_weights()
    model.eval()
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, sum(LENGTHS)), device=device, generator=generator)
    bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = model(tokens, position_ids=positions, cu_seqlens=bounds)
        alone = torch.cat([model(doc) for doc in tokens.split(list(LENGTHS), dim=1)], dim=1)
    return ((packed - alone).abs().max() / alone.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", default="", help="comma-separated model types (default: every FLA family)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the survey runs FLA's Triton kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    from flame.train.model_parts import prepare_gpu_kernels

    prepare_gpu_kernels(torch.device("cuda"))
    families = args.families.split(",") if args.families else sorted(fla_model_types())
    for model_type in families:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                difference = packed_difference(model_type, torch.device("cuda"))
            verdict = "apart" if difference <= TOLERANCE else "MIXED"
            line = f"{difference:.1e} {verdict}"
        except Exception as e:  # one family's failure is its line, the survey goes on
            line = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        listed = "listed" if model_type in FLA_PACKED_DOCUMENT_MODEL_TYPES else "not listed"
        print(f"{model_type}: {line} ({listed})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
