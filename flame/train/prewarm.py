"""Compile a job's Triton kernels beside its start: ``python -m flame.train.prewarm <the job's flags>``.

A GPU compiles each Triton kernel (FLA's, flame's) at its first call, one after another inside the first training
step, most of a fresh machine's first step (docs/performance.md, "Time to the first step"). train.sh starts this module beside the launcher on each node with a
GPU. It builds one block of each kind the model has (blocks that print alike, module by module, are one kind: a
hybrid has two) and runs its forward and backward once at the job's micro-batch shape, as the ranks will: the job's
kernel choices (flame.train.kernels), bf16 autocast or, under FSDP, bf16 parameters, traced by dynamo where the job
compiles its blocks (so that the same custom ops run on the same inputs), packed documents' cu_seqlens where the
job packs them. The kernels it compiles, and the tuning results it measures where flame ships none (under
flame.ops.autotune's per-kernel lock: a rank reaching that kernel waits and reads the result), land in the host's
Triton cache while the ranks import, build their model and compile, and the ranks find them there.

The ranks do not depend on it: it uses at most a tenth of the GPU's memory, leaves out jobs whose ranks reshape the
blocks (tensor, context or pipeline parallelism) and models other than flame's own decoder families (transformers'
and FLA's classes), and a failure ends it with one line in <dump_folder>/logs/prewarm.log. That log also has
flame.ops.autotune's lines: the shipped tuning results written and each kernel the prewarm tuned. ``FLAME_PREWARM=0``
turns it off.
"""

import contextlib
import logging
import os
import sys
import time

import torch
from torch import nn

from flame.config import parse_args
from flame.errors import first_line
from flame.models import build_model, load_model_args, model_spec
from flame.models.common.decoder import DecoderLM
from flame.models.custom import import_custom_modules
from flame.ops import autotune

MEMORY_FRACTION = 0.1
# flame.ops.autotune's lines (the shipped tuning results written, each kernel tuned here), into the prewarm's log.
TUNING_LOG = autotune.logger
# dynamo's graph run by PyTorch: the custom ops the compiled blocks call, without AOTAutograd's tracing or inductor's
# compiling (tests/gpu/test_prewarm.py: the rank then finds every FLA and flame kernel it calls compiled).
BACKEND = "eager"


def block_kinds(model: DecoderLM) -> dict[str, nn.Module]:
    """One block of each kind, by layer name in model order: blocks whose module trees print alike (classes,
    sizes, options) call the same kernels."""
    kinds: dict[str, tuple[str, nn.Module]] = {}
    for stack in model_spec(model.args).blocks(model):
        for name, block in stack.named_children():
            kinds.setdefault(repr(block), (name, block))
    return dict(kinds.values())


def keep_only(model: DecoderLM, names: set[str]) -> None:
    """The model reduced to the blocks named ``names``, without embeddings or output layer, as a pipeline stage
    holding only them would be (its ``init_weights`` initializes what is left)."""
    for stack in model_spec(model.args).blocks(model):
        for name in [name for name, _ in stack.named_children() if name not in names]:
            del stack[name]
    model.embeddings = None
    model.lm_head = None


def skip_reason(model: nn.Module, degrees: dict[str, int]) -> str | None:
    if not isinstance(model, DecoderLM):
        return f"{type(model).__name__} is not one of flame's decoder families"
    if reshaped := [name for name in ("tp", "cp", "pp") if degrees[name] > 1]:
        return f"the ranks reshape the blocks ({', '.join(reshaped)} > 1)"
    return None


def compiles_blocks(job_config, model_args) -> bool:
    compiled = job_config.compile
    return (
        compiled.enable
        and "model" in compiled.components
        and model_spec(model_args).eager_reason(model_args) is None
    )


def precision(
    job_config, degrees: dict[str, int], device_type: str
) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(the dtype FSDP casts the blocks' parameters and inputs to, the autocast dtype) of the ranks on
    ``device_type``, as flame.train.model_parts.autocast_context has them: on a GPU, FSDP casts (data-parallel
    sharding) and otherwise autocast runs over float32 parameters; a CPU trains in float32 throughout."""
    if device_type != "cuda":
        return None, None
    dtype = getattr(torch, job_config.training.mixed_precision_param)
    return (dtype, None) if degrees["dp_shard"] > 1 else (None, dtype)


def prewarm(job_config, device: torch.device, world_size: int = 1) -> str:
    """Run one block of each kind of the job's model forward and backward at its micro-batch shape on ``device``;
    what it ran (or why nothing), one line."""
    from flame.data.config import data_spec
    from flame.parallelize.checks import check_parallelism
    from flame.train.kernels import choose_kernels

    import_custom_modules(job_config.experimental)
    model_args, _ = load_model_args(job_config.model.config, job_config.model.impl)
    degrees = check_parallelism(job_config, model_args, world_size=world_size)
    with torch.device("meta"):
        model = build_model(model_args)
    if reason := skip_reason(model, degrees):
        return f"nothing to compile ahead: {reason}"
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION, device)
    choose_kernels(job_config, device)
    kinds = block_kinds(model)
    keep_only(model, set(kinds))
    model.to_empty(device=device)
    model.init_weights()

    data = data_spec(job_config)
    batch, seq_len = data.batch_size, data.seq_len
    cast, autocast_dtype = precision(job_config, degrees, device.type)
    if cast is not None:
        model.to(cast)
    autocast = (
        contextlib.nullcontext()
        if autocast_dtype is None
        else torch.autocast(device.type, dtype=autocast_dtype)
    )
    position_ids = torch.arange(seq_len, device=device).expand(batch, -1)
    cu_seqlens = None
    # Packed documents: documents of context_len tokens (the ranks' documents vary; the kernels' variant does not).
    if data.varlen:
        starts = list(range(0, seq_len, data.context_len)) + [seq_len]
        cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
        position_ids = position_ids % data.context_len
    compiled = compiles_blocks(job_config, model_args)
    for block in kinds.values():
        run = torch.compile(block, backend=BACKEND) if compiled else block
        hidden = torch.randn(
            batch,
            seq_len,
            model_args.hidden_size,
            device=device,
            dtype=cast or torch.float32,
            requires_grad=True,
        )
        with autocast:
            out = run(hidden, position_ids, cu_seqlens)
            if model.norm is not None:  # the model's last norm, outside the blocks: eager in the ranks too
                out = model.norm(out)
        out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    names = ", ".join(
        f"{name} ({type(getattr(block, 'attn', block)).__name__})" for name, block in kinds.items()
    )
    how = "traced by dynamo" if compiled else "eager"
    return f"{model_args.model_type}: layers {names} forward and backward at {batch} x {seq_len}, {how}"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    world_size = int(os.environ.get("NGPU", "1")) * int(os.environ.get("NNODE", "1"))
    tuning_lines = logging.StreamHandler(sys.stdout)
    tuning_lines.setFormatter(logging.Formatter("prewarm: %(message)s"))
    level = TUNING_LOG.level
    TUNING_LOG.addHandler(tuning_lines)
    TUNING_LOG.setLevel(logging.INFO)
    try:
        job_config = parse_args(sys.argv[1:] if argv is None else argv)
        summary = prewarm(job_config, torch.device("cuda", 0), world_size)  # the first visible GPU
    except Exception as e:  # the ranks compile what is missing themselves
        print(f"prewarm: stopped: {first_line(e)}", flush=True)
        return 1
    finally:
        TUNING_LOG.removeHandler(tuning_lines)
        TUNING_LOG.setLevel(level)
    print(f"prewarm: {summary} in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from flame.compat import defer_fla_package_imports

    defer_fla_package_imports()  # as the rank does (flame/train/__main__.py)
    sys.exit(main())
