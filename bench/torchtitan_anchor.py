"""torchtitan's own trainer on flame's transformer shape: the anchor for flame's transformer throughput.

    python bench/torchtitan_anchor.py                                    # transformer_340M, 8 x 2048, eager, one GPU
    python bench/torchtitan_anchor.py --compile --json anchor.json       # torch.compile'd (torchtitan's per-block compile)
    python bench/torchtitan_anchor.py --batch_size 4 --seq_len 4096 --steps 30 --warmup 5
    python bench/torchtitan_anchor.py --device cpu --tiny                # 2 layers, dim 64: seq 64, batch 2, 3 steps, eager

What runs is torchtitan 0.2.2 as a user runs it: ``torchtitan.train.main(Trainer)`` in a process of its own, its
JobConfig parsed by its ConfigManager from command-line flags (``--model.name llama3 --model.flavor flame_anchor
--training.dataset flame_corpus --training.local_batch_size B --training.seq_len T --compile.enable ...``, printed
before the run), its llama3 ``Transformer`` built, parallelized (``parallelize_llama``: torch.compile per block with
``--compile``, no activation checkpointing unless ``--ac``) and initialised by its Trainer, its tokenizer on the
shipped tokenizer (flame/assets/tokenizer, ``--model.hf_assets_path``), its text dataloader on the shipped corpus
(flame/assets/corpus/train.jsonl.gz, read offline), its AdamW and LR schedule, its loss and its bf16 autocast, and
its own throughput metric: the ``tps`` of each step's log line (tokens per second per device, ``--metrics.log_freq
1``). Before ``main``, the process registers in-process the two entries a user adds to torchtitan's tables for a
new model size and a new dataset ("Add your dataset here"): the flavor ``flame_anchor`` in
``torchtitan.models.llama3``'s ``llama3_args`` (the config's shape as ``TransformerModelArgs``) and the dataset
``flame_corpus`` in ``torchtitan.hf_datasets.text_datasets.DATASETS`` (``datasets.load_dataset("json", ...,
streaming=True)`` on the local file, its ``text`` column), and applies the workarounds torchtitan 0.2.2 needs to
run here at all, the only flame code in that process, each named in the output:
flame.compat's ``fake_process_group`` (torchtitan's meshes give size-1 dimensions the c10d backend "fake", which
torch registers only when its test module is imported) and, without a GPU, ``torchtitan_cpu_device`` (torchtitan
falls back to cuda and NCCL, and its metrics ask torch.cuda for the device's name and memory). flame/compat.py is
loaded as a file, without the ``flame`` package.

The shape: the config (``--config``, default configs/transformer_340M.json) as flame reads it (flame's
TransformerArgs, its defaults included) mapped onto ``TransformerModelArgs``: dim, n_layers, n_heads, n_kv_heads,
vocab_size, norm_eps, rope_theta; the SwiGLU width through multiple_of / ffn_dim_multiplier so that torchtitan's
rule gives the same width (2816 for the 340M: its default multiple_of 256 already does); RoPE without llama3's
frequency scaling, which torchtitan's precompute always applies (scaling_factor 1 and every band left unscaled), as
flame and FLA rotate. A field torchtitan's llama3 cannot express is printed, one line each (the initialisation
always: torchtitan initialises its own way, which changes no timing). The parameter count is torchtitan's own
("size: N total parameters"), printed beside that of flame's model of the same config (built on the meta device).

Result: the median ``tps`` over the steps after ``--warmup`` (step 1 includes compilation), the largest ``memory``
(torchtitan's max reserved GiB) over those steps on a GPU, None on a CPU; one markdown row, and with ``--json PATH``
the dictionary of :func:`torchtitan_tokens_per_s`. torchtitan's log is kept in ``<dump_folder>/torchtitan.log``.
"""

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "transformer_340M.json"
CORPUS = REPO / "flame" / "assets" / "corpus" / "train.jsonl.gz"
TOKENIZER = REPO / "flame" / "assets" / "tokenizer"
COMPAT = REPO / "flame" / "compat.py"
FLAVOR = "flame_anchor"  # the llama3 flavor registered in the worker
DATASET = "flame_corpus"  # the dataset registered in the worker
# --tiny: the config at a size a CPU steps through in well under a second (vocab: the shipped tokenizer's 4096).
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "num_kv_heads": None, "vocab_size": 4096}
TINY_RUN = {"batch_size": 2, "seq_len": 64, "steps": 3, "warmup": 1}
# torchtitan's FeedForward: hidden = int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded up to multiple_of.
TITAN_MULTIPLE_OF = 256


# ---------------------------------------------------------------------------------------------------------------
# The shape: flame's config as torchtitan's TransformerModelArgs


def read_config(config_path: str | Path, tiny: bool = False):
    """flame's args of the config (its TransformerArgs: defaults and checks included); ``tiny``: at TINY's size."""
    from flame.models import model_args_from_dict, read_model_config

    config = read_model_config(config_path)
    if config.get("model_type") != "transformer":
        raise SystemExit(
            f"{config_path}: model_type {config.get('model_type')!r}; the anchor is torchtitan's llama3, which "
            "reproduces flame's transformer family only"
        )
    if tiny:
        config = {**config, **TINY, "intermediate_size": None}
    return model_args_from_dict(config)[0]


def titan_ffn_width(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan 0.2.2's llama3 FeedForward width for a block of ``dim`` (models/llama3/model/model.py)."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def unscaled_rope(dim: int, n_heads: int, rope_theta: float) -> dict:
    """RoPEScalingArgs under which torchtitan's precompute_freqs_cis leaves every frequency as it is: scaling factor
    1, and original_max_position_embeddings so large that every wavelength falls in the "high frequency" band,
    which torchtitan never touches (plain RoPE, as flame's and FLA's attention rotate)."""
    head_dim = dim // n_heads
    longest_wavelength = 2 * math.pi * rope_theta ** ((head_dim - 2) / head_dim)
    high_freq_factor = 4.0
    return {
        "scaling_factor": 1.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": high_freq_factor,
        "original_max_position_embeddings": 2
        ** math.ceil(math.log2(high_freq_factor * longest_wavelength) + 1),
    }


def titan_model_args(margs) -> tuple[dict, list[str]]:
    """torchtitan's TransformerModelArgs of flame's transformer args ``margs``, as keyword arguments (JSON-able:
    rope_scaling_args as a dict), and one line per field torchtitan's llama3 cannot match."""
    layer = margs.layer_dims(0)
    dim, n_heads = margs.hidden_size, margs.num_heads
    width = layer.intermediate_size
    if titan_ffn_width(dim, TITAN_MULTIPLE_OF, None) == width:
        multiple_of, multiplier = TITAN_MULTIPLE_OF, None
    else:  # round up to the width itself from just below it
        multiple_of, multiplier = width, width / int(2 * (4 * dim) / 3)
    assert titan_ffn_width(dim, multiple_of, multiplier) == width, (dim, width, multiple_of, multiplier)
    kwargs = {
        "dim": dim,
        "n_layers": margs.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": margs.num_kv_heads or n_heads,
        "vocab_size": margs.vocab_size,
        "multiple_of": multiple_of,
        "ffn_dim_multiplier": multiplier,
        "norm_eps": margs.norm_eps,
        "rope_theta": float(margs.rope_theta),
        "rope_scaling_args": unscaled_rope(dim, n_heads, float(margs.rope_theta)),
        "attn_type": "sdpa",
        "attn_mask_type": "causal",
    }
    unmatched = [
        f"initializer_range {margs.initializer_range}: torchtitan initialises its own way (truncated normal 0.02, "
        "depth-scaled output projections, unit-normal embeddings); no effect on throughput"
    ]
    checks = [
        (margs.qk_norm, "qk_norm", "torchtitan's llama3 attention has no QK norm"),
        (margs.qkv_bias, "qkv_bias", "torchtitan's llama3 projections have no bias"),
        (
            margs.window_size is not None,
            "window_size",
            "torchtitan's llama3 attends causally over the whole row",
        ),
        (margs.window_pattern is not None, "window_pattern", "torchtitan's llama3 has no sliding windows"),
        (
            margs.layer_wise_scaling is not None,
            "layer_wise_scaling",
            "torchtitan's llama3 blocks are all alike",
        ),
        (
            margs.tie_word_embeddings,
            "tie_word_embeddings",
            "torchtitan's llama3 keeps a separate output matrix",
        ),
        (margs.use_l2warp, "use_l2warp", "torchtitan's loss is plain cross-entropy"),
        (
            margs.fuse_linear_cross_entropy,
            "fuse_linear_cross_entropy",
            "torchtitan computes the whole logits, then its (compiled with --compile) cross-entropy",
        ),
        (margs.attn_impl != "parallel_attn", "attn_impl", "torchtitan's attention is SDPA"),
    ]
    unmatched += [
        f"{name} {json.dumps(getattr(margs, name))}: {why}" for differs, name, why in checks if differs
    ]
    if any(layer != margs.layer_dims(i) for i in range(margs.num_hidden_layers)):
        unmatched.append("per-layer dims: torchtitan's llama3 blocks are all alike (layer 0's taken)")
    return kwargs, unmatched


def build_titan_model_args(kwargs: dict):
    """torchtitan's TransformerModelArgs from titan_model_args' keyword arguments (imports torchtitan)."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    kwargs = dict(kwargs)
    rope = RoPEScalingArgs(**kwargs.pop("rope_scaling_args"))
    return TransformerModelArgs(**kwargs, rope_scaling_args=rope)


def flame_params(margs) -> int:
    """flame's model of the same config, its parameters counted on the meta device (no run of it)."""
    import torch

    from flame.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(margs).parameters())


def tokenizer_vocab_size(path: Path = TOKENIZER) -> int:
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    return max(ids) + 1


# ---------------------------------------------------------------------------------------------------------------
# The run: torchtitan's main in a process of its own


def titan_flags(
    batch_size: int,
    seq_len: int,
    steps: int,
    compile: bool,
    dump_folder: Path,
    compile_backend: str = "inductor",
    ac: str = "none",
    extra: list[str] = (),
) -> list[str]:
    """torchtitan's command-line flags of the run (its JobConfig field names)."""
    flags = [
        "--job.dump_folder", str(dump_folder), "--job.description", "flame torchtitan anchor",
        "--model.name", "llama3", "--model.flavor", FLAVOR, "--model.hf_assets_path", str(TOKENIZER),
        "--training.dataset", DATASET, "--training.dataset_path", str(CORPUS),
        "--training.local_batch_size", str(batch_size), "--training.seq_len", str(seq_len),
        "--training.steps", str(steps),
        "--lr_scheduler.warmup_steps", str(max(1, min(steps, 2))),
        "--activation_checkpoint.mode", ac,
        "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--checkpoint.no-enable",
    ]  # fmt: skip
    if compile:
        flags += ["--compile.enable", "--compile.backend", compile_backend]
    return flags + list(extra)


STEP_LINE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*\S+\s+grad_norm:\s*\S+\s+memory:\s*(-?[\d.]+)GiB\(\s*-?[\d.]+%\)\s+tps:\s*([\d,]+)"
)
PARAMS_LINE = re.compile(r"size: ([\d,]+) total parameters")
SHIMS_LINE = re.compile(r"^anchor shims applied: (.*)$", re.M)


def parse_log(text: str) -> dict:
    """torchtitan's own numbers from its log: the parameter count and each step's (step, max reserved GiB, tps)."""
    params = PARAMS_LINE.search(text)
    shims = SHIMS_LINE.search(text)
    return {
        "params": int(params.group(1).replace(",", "")) if params else None,
        "steps": [(int(s), float(m), int(t.replace(",", ""))) for s, m, t in STEP_LINE.findall(text)],
        "shims": [s for s in shims.group(1).split(", ") if s] if shims else [],
    }


def last_error(text: str) -> str:
    """The exception of the last traceback in ``text``, else its last meaningful line (tyro's boxed refusal of an
    option read without the box)."""
    lines = [line for line in text.splitlines() if line.strip()]
    exceptions = []
    for i, line in enumerate(lines):
        if line.strip().startswith("Traceback"):
            tail = [line for line in lines[i + 1 :] if not line.startswith((" ", "\t"))]
            if tail:
                exceptions.append(tail[0].strip())
    if exceptions:
        return exceptions[-1]
    meaningful = [line.strip("│╭╮╰╯─ ") for line in lines]
    meaningful = [line for line in meaningful if line and not line.startswith("For full helptext")]
    return meaningful[-1] if meaningful else "no output"


def torchtitan_tokens_per_s(
    config_path: str | Path = DEFAULT_CONFIG,
    batch_size: int = 8,
    seq_len: int = 2048,
    steps: int = 20,
    warmup: int = 5,
    compile: bool = False,
    device: str = "cuda",
    timeout_s: float = 600,
    *,
    tiny: bool = False,
    dump_folder: str | Path | None = None,
    compile_backend: str = "inductor",
    ac: str = "none",
    extra_flags: list[str] = (),
) -> dict:
    """torchtitan's trainer at the config's shape: its median tokens/s per device over the steps after ``warmup``.

    Keys: tokens_per_s (None on failure), peak_gib (largest max-reserved GiB over those steps; None on a CPU),
    params (torchtitan's count), flame_params (flame's model of the config), step_tps (every step's tps), steps_timed,
    model_args (the registered flavor), unmatched (fields torchtitan cannot match), shims (the workarounds applied in
    the run), command, log (torchtitan's log), error (None, or the reason there is no number), wall_s.
    """
    margs = read_config(config_path, tiny)
    kwargs, unmatched = titan_model_args(margs)
    dump = Path(dump_folder) if dump_folder else Path(tempfile.mkdtemp(prefix="torchtitan_anchor_"))
    dump.mkdir(parents=True, exist_ok=True)
    log = dump / "torchtitan.log"
    flags = titan_flags(batch_size, seq_len, steps, compile, dump, compile_backend, ac, extra_flags)
    worker = [str(Path(__file__).resolve()), "--worker", json.dumps(kwargs), "--", *flags]
    command = [sys.executable, *worker]
    from flame.launch import free_port  # here: the worker's process imports nothing of flame

    # One process with the environment torchrun would give it.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(dump / "hf_datasets_cache"), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torchtitan takes any GPU it sees
    result = {
        "config": str(config_path),
        "tiny": tiny,
        "device": device,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "compile": compile,
        "tokens_per_s": None,
        "peak_gib": None,
        "params": None,
        "flame_params": flame_params(margs),
        "step_tps": [],
        "steps_timed": 0,
        "model_args": kwargs,
        "unmatched": unmatched,
        "shims": [],
        "command": shlex.join(command),
        "log": str(log),
        "error": None,
        "wall_s": None,
    }
    vocab = tokenizer_vocab_size()
    if kwargs["vocab_size"] < vocab:
        result["error"] = (
            f"vocab_size {kwargs['vocab_size']} < the tokenizer's {vocab}: its ids would not embed"
        )
        return result
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the worker's children too
            process.wait()
            returncode = None
    result["wall_s"] = round(time.perf_counter() - start, 2)
    text = log.read_text(errors="replace")
    parsed = parse_log(text)
    result["params"], result["shims"] = parsed["params"], parsed["shims"]
    result["step_tps"] = [tps for _, _, tps in parsed["steps"]]
    timed = [(memory, tps) for step, memory, tps in parsed["steps"] if step > warmup]
    if returncode is None:
        result["error"] = f"no result within {timeout_s} s ({len(parsed['steps'])} steps logged)"
    elif returncode != 0:
        result["error"] = f"torchtitan exited with {returncode}: {last_error(text)}"
    elif not timed:
        result["error"] = f"no step after the {warmup} warm-up steps logged ({len(parsed['steps'])} in all)"
    if timed and result["error"] is None:
        result["steps_timed"] = len(timed)
        result["tokens_per_s"] = statistics.median(tps for _, tps in timed)
        peak = max(memory for memory, _ in timed)
        result["peak_gib"] = peak if device != "cpu" and peak > 0 else None
    return result


HEADER = (
    "| model | params (torchtitan) | params (flame) | batch x seq | mode | device | steps timed | tokens/s | peak GiB |\n"
    "|---|---:|---:|---|---|---|---:|---:|---:|"
)


def row(result: dict) -> str:
    name = Path(result["config"]).stem + (" (tiny)" if result["tiny"] else "")
    mode = "compiled" if result["compile"] else "eager"
    tokens = f"{result['tokens_per_s']:,.0f}" if result["tokens_per_s"] is not None else "error"
    peak = f"{result['peak_gib']:.1f}" if result["peak_gib"] is not None else "-"
    params = f"{result['params']:,}" if result["params"] is not None else "?"
    return (
        f"| torchtitan llama3 at {name} | {params} | {result['flame_params']:,} | {result['batch_size']} x "
        f"{result['seq_len']} | {mode} | {result['device']} | {result['steps_timed']} | {tokens} | {peak} |"
    )


# ---------------------------------------------------------------------------------------------------------------
# The worker: torchtitan's main, after the registrations and the workarounds


def _load_flame_compat():
    """flame/compat.py as a module of its own, without running the flame package (no flame code is imported)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flame_compat_for_anchor", COMPAT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def apply_shims() -> list[str]:
    """The workarounds torchtitan 0.2.2 needs to run at all on this torch and machine; returns their names."""
    import torch

    compat = _load_flame_compat()
    applied = []
    # flame.compat SHIMS "fake_process_group": torchtitan's meshes give size-1 dimensions the backend "fake".
    compat._register_fake_process_group()
    applied.append("fake_process_group (flame.compat)")
    if not torch.accelerator.is_available():
        # flame.compat SHIMS "torchtitan_cpu_device": torchtitan falls back to cuda and NCCL without an accelerator.
        compat._use_cpu_when_no_accelerator()
        applied.append("torchtitan_cpu_device (flame.compat)")
    return applied


def _load_local_jsonl(path: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=path, split="train", streaming=True)


def _text(sample: dict) -> str:
    return sample["text"]


def worker(flavor: str, flags: list[str]) -> None:
    # torchtitan's ConfigManager.parse_args takes sys.argv[1:] as bound when its module is imported: set it first.
    sys.argv = [sys.argv[0], *flags]
    applied = apply_shims()
    print(f"anchor shims applied: {', '.join(applied)}", flush=True)

    import torchtitan.models.llama3 as llama3
    from torchtitan.hf_datasets import DatasetConfig, text_datasets

    llama3.llama3_args[FLAVOR] = build_titan_model_args(json.loads(flavor))
    text_datasets.DATASETS[DATASET] = DatasetConfig(
        path=str(CORPUS), loader=_load_local_jsonl, sample_processor=_text
    )
    print(f"anchor registered: llama3 flavor {FLAVOR!r}, dataset {DATASET!r} ({CORPUS.name})", flush=True)
    print(f"anchor torchtitan flags: {shlex.join(flags)}", flush=True)

    from torchtitan.train import Trainer, main

    main(Trainer)


# ---------------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a transformer config JSON (flame's reading)"
    )
    parser.add_argument("--batch_size", type=int, default=None, help="rows per step per device (default 8)")
    parser.add_argument("--seq_len", type=int, default=None, help="default 2048")
    parser.add_argument("--steps", type=int, default=None, help="steps in all (default 20)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="first steps left out of the median (default 5)"
    )
    parser.add_argument("--compile", action="store_true", help="--compile.enable (model and loss)")
    parser.add_argument("--compile_backend", default="inductor")
    parser.add_argument(
        "--ac", default="none", help="--activation_checkpoint.mode (torchtitan's default: selective)"
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default: cuda where there is one"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument(
        "--tiny", action="store_true", help="2 layers, dim 64; seq 64, batch 2, 3 steps, eager"
    )
    parser.add_argument(
        "--dump_folder", default=None, help="torchtitan's --job.dump_folder (default: a temp dir)"
    )
    parser.add_argument("--titan_flags", default="", help="more torchtitan flags, e.g. '--optimizer.lr 3e-4'")
    parser.add_argument("--json", default=None, help="write the result dictionary here")
    args = parser.parse_args(argv)
    defaults = TINY_RUN if args.tiny else {"batch_size": 8, "seq_len": 2048, "steps": 20, "warmup": 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    args = parse(argv)
    result = torchtitan_tokens_per_s(
        args.config, args.batch_size, args.seq_len, args.steps, args.warmup, args.compile, args.device,
        args.timeout, tiny=args.tiny, dump_folder=args.dump_folder, compile_backend=args.compile_backend,
        ac=args.ac, extra_flags=shlex.split(args.titan_flags),
    )  # fmt: skip
    print(f"torchtitan llama3 flavor {FLAVOR}: {json.dumps(result['model_args'])}")
    for line in result["unmatched"]:
        print(f"not matched: {line}")
    print(f"shims applied in torchtitan's process: {', '.join(result['shims']) or 'none'}")
    print(f"command: {result['command']}")
    print(f"torchtitan's log: {result['log']}")
    if result["params"] is not None and result["params"] != result["flame_params"]:
        print(f"parameters differ: torchtitan {result['params']:,}, flame {result['flame_params']:,}")
    if result["error"]:
        print(f"error: {result['error']}")
    print(f"\n{HEADER}\n{row(result)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
