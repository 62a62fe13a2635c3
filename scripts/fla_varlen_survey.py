"""Which FLA families keep packed documents apart on the GPU: for each FLA 0.6.0 model type, a tiny model reads one
row of three documents with cu_seqlens, as flame's generic model passes them with --training.varlen, and each
document alone; a family whose layers all honour cu_seqlens gives the same logits. The model runs in float32 with
full-precision products (no TF32 in torch's matmuls or in Triton's float32 dots: TRITON_F32_DEFAULT=ieee), so
chunking the row differently leaves differences near float32's rounding, and a document that sees another's
tokens differs by orders of magnitude more; families whose FLA kernels refuse float32 run in bfloat16 with a
tolerance above bfloat16's rounding.

    python scripts/fla_varlen_survey.py [--families gla,kda,...] [--processes 4 --timeout_s 300] [--tune]

prints one line per family: its largest difference relative to the logits' scale, and whether flame lists it in
flame.models.generic.args.FLA_PACKED_DOCUMENT_MODEL_TYPES (the families --training.varlen accepts). A family that
passes here is added there together with a row of tests/gpu/test_fla_varlen.py. Needs a CUDA GPU. With --processes,
each family runs in a process of its own, that many at once on the one GPU (Triton's and TileLang's compilers, which
take most of a family's time on a fresh machine, run on the host's cores), and a family past --timeout_s is a line
saying so. FLA's kernels run the first config their own pruning keeps instead of autotuning (what the survey checks
holds for any valid config, and tuning takes minutes per family on a fresh machine); --tune tunes them as training
does."""

import argparse
import contextlib
import os
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flame.models import build_model, model_args_from_dict  # noqa: E402
from flame.models.generic.args import FLA_PACKED_DOCUMENT_MODEL_TYPES, fla_model_types  # noqa: E402
from flame.ops.autotune import fla_kernels_on_first_config  # noqa: E402

LENGTHS = (100, 1, 155)  # three documents; lengths that no chunk size divides
# Largest difference (relative to the logits' scale) of documents kept apart: float32 kernels chunked differently
# for the packed row and each document; bfloat16 rounds each layer's output at ~4e-3.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
SHAPE = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 2}
# Settings some families need at this size (as tests/models/generic/test_fla_families.py builds them).
OVERRIDES = {
    "rodimus": {"ska_attn": {"num_heads": 4}},
    "samba": {"attn": {"layers": [1], "num_heads": 4}},
    # NSA's kernels take 16, 32, ... query heads per key/value head.
    "nsa": {"num_heads": 16, "num_kv_heads": 1},
}
# Configs that take no num_heads, or derive it from their other keys.
WITHOUT_HEADS = {"hgrn", "log_linear_mamba2", "mamba", "mamba2", "mamba3", "rodimus", "samba", "yoco"}


def exact_float32() -> None:
    """No TF32 anywhere: torch's matmuls, and Triton's dots on float32 (FLA's kernels leave it to the default)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ["TRITON_F32_DEFAULT"] = "ieee"


def survey_config(model_type: str) -> dict:
    config = {"model_type": model_type, **SHAPE, **OVERRIDES.get(model_type, {})}
    if model_type in WITHOUT_HEADS:
        del config["num_heads"]
    return config


def packed_difference(model_type: str, device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """max |packed - alone| / max |alone| over the logits of the three documents, the model in ``dtype``."""
    # FLA's class, also for the types flame implements.
    args, _ = model_args_from_dict(survey_config(model_type), impl="fla")
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(args)
    model.init_weights()
    model.to(dtype).eval()
    generator = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, sum(LENGTHS)), device=device, generator=generator)
    bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[None]
    with torch.no_grad():
        packed = model(tokens, position_ids=positions, cu_seqlens=bounds)
        alone = torch.cat([model(doc) for doc in tokens.split(list(LENGTHS), dim=1)], dim=1)
    return ((packed - alone).abs().max() / alone.abs().max()).item()


def family_difference(model_type: str, device: torch.device) -> tuple[float, torch.dtype]:
    """packed_difference in float32, or in bfloat16 for a family whose FLA kernels assert half precision; and the
    dtype it ran in."""
    try:
        return packed_difference(model_type, device, torch.float32), torch.float32
    except (AssertionError, TypeError) as e:  # FLA's kernels that assert or check half precision
        if not any(word in str(e) for word in ("float32", "fp16", "bf16")):
            raise
    return packed_difference(model_type, device, torch.bfloat16), torch.bfloat16


def survey_in_a_process(model_type: str, timeout_s: float | None, tune: bool = False) -> str:
    """The family's survey line from a process of its own."""
    command = [sys.executable, __file__, "--families", model_type, *(["--tune"] if tune else [])]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{model_type}: failed: no verdict within {timeout_s:g} s"
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"{model_type}: ")]
    if lines:
        return lines[-1]
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{model_type}: failed: exit {result.returncode}: {last}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", default="", help="comma-separated model types (default: every FLA family)"
    )
    parser.add_argument("--processes", type=int, default=1, help="families surveyed at once, a process each")
    parser.add_argument("--timeout_s", type=float, default=None, help="per family, with --processes")
    parser.add_argument(
        "--tune", action="store_true", help="autotune FLA's kernels instead of their first config"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the survey runs FLA's Triton kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    families = args.families.split(",") if args.families else sorted(fla_model_types())
    if args.processes > 1:
        # Each line as its family finishes, so that a run cut short keeps every verdict it reached.
        with ThreadPoolExecutor(args.processes) as pool:
            surveys = [
                pool.submit(survey_in_a_process, family, args.timeout_s, args.tune) for family in families
            ]
            for survey in as_completed(surveys):
                print(survey.result(), flush=True)
        return 0
    exact_float32()
    from flame.train.kernels import prepare_gpu_kernels

    prepare_gpu_kernels(torch.device("cuda"))
    with contextlib.nullcontext() if args.tune else fla_kernels_on_first_config():
        for model_type in families:
            print(survey_line(model_type), flush=True)
    return 0


def survey_line(model_type: str) -> str:
    """``<model type>: <largest difference> apart|MIXED (<dtype>) (listed|not listed)``, or the family's failure."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            difference, dtype = family_difference(model_type, torch.device("cuda"))
        verdict = "apart" if difference <= TOLERANCE[dtype] else "MIXED"
        line = f"{difference:.1e} {verdict} ({str(dtype).removeprefix('torch.')})"
    except Exception as e:  # one family's failure is its line, the survey goes on
        line = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    listed = "listed" if model_type in FLA_PACKED_DOCUMENT_MODEL_TYPES else "not listed"
    return f"{model_type}: {line} ({listed})"


if __name__ == "__main__":
    sys.exit(main())
