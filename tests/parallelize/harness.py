"""In-process multi-rank training on CPU/gloo: build a tiny model, parallelize it with flame's plan, load the same
initial weights everywhere, train a few steps as flame's trainer does (summed loss / global labelled tokens,
gradient clipping with torchtitan's clip_grad_norm_, torchtitan's optimizer) and report loss and gradient norm
per step. ``reference_run`` does the same in one process without any parallelism. A setting with ``documents``
trains on one packed row instead (training.varlen: those cu_seqlens over the first row of the batch).
"""

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# model_type + config overrides of the tiny models every configuration trains (heads divisible by 2 and 4 where
# tensor parallelism splits them).
FAMILIES: dict[str, dict] = {
    # GQA (4 query heads, 2 KV heads), QK-norm, per-head query scales (q_scale), tied embeddings.
    "transformer": {
        "model_type": "transformer",
        "num_heads": 4,
        "num_kv_heads": 2,
        "qk_norm": True,
        "attn_impl": "parallel_scaled_attn",
        "tie_word_embeddings": True,
    },
    # Grouped value heads (2 q/k heads, 4 value heads), output gate, short convs.
    "gated_deltanet": {
        "model_type": "gated_deltanet",
        "head_dim": 16,
        "num_heads": 2,
        "num_v_heads": 4,
        "expand_v": 1.0,
    },
    # GatedDeltaNet at layer 0, attention with QK-norm and GQA at layer 1.
    "hybrid": {
        "model_type": "gated_deltanet",
        "head_dim": 16,
        "num_heads": 2,
        "expand_v": 2.0,
        "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True},
    },
    "delta_net": {"model_type": "delta_net", "num_heads": 2, "use_gate": True},
    # Softpick attention with a sliding window shorter than the sequence (context parallelism's key ranges).
    "softpick_window": {
        "model_type": "transformer",
        "num_heads": 4,
        "num_kv_heads": 2,
        "attn_impl": "parallel_softpick_attn",
        "window_size": 12,
    },
    # Four layers (attention at 1 and 3): room for two pipeline stages per rank (interleaved schedules).
    "hybrid_4_layers": {
        "model_type": "gated_deltanet",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "num_heads": 2,
        "attn": {"every": 2, "offset": 1, "num_heads": 4, "num_kv_heads": 2},
    },
}
TINY = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96}
SEQ_LEN, GLOBAL_BATCH, STEPS, LR, MAX_NORM = 32, 4, 3, 1e-2, 1.0


@dataclass
class Setting:
    """One parallel configuration: degrees plus job options. ``flags`` are extra ``--section.field value`` flags."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    flags: list[str] = field(default_factory=list)
    loss_parallel: bool = False
    sequence_parallel: bool = True
    # cu_seqlens of one packed row of SEQ_LEN tokens (training.varlen), None for the 4-row batch.
    documents: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


def model_args(family: str):
    from flame.models import get_model_spec

    config = {**TINY, **FAMILIES[family]}
    args, unknown = get_model_spec(config["model_type"]).args_cls.from_dict(config)
    assert unknown == [], unknown
    return args


def initial_state(family: str) -> dict[str, torch.Tensor]:
    """The full initial weights, the same in every process (seeded init on one CPU process)."""
    from flame.models import build_model

    torch.manual_seed(0)
    model = build_model(model_args(family))
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: random tokens, labels shifted by one, a few labels ignored (-100)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :5] = -100
    labels[3, -3:] = -100
    return inputs, labels


def packed_batch(documents: tuple[int, ...]) -> tuple[dict, torch.Tensor]:
    """One packed row (the batch's first) as the varlen loader yields it: cu_seqlens and per-document positions."""
    from flame.ops.varlen import position_ids_from_cu_seqlens

    inputs, labels = batch()
    cu_seqlens = torch.tensor(documents, dtype=torch.int32)
    assert int(cu_seqlens[-1]) == SEQ_LEN
    positions = position_ids_from_cu_seqlens(cu_seqlens)[None]
    return {"input": inputs[:1], "cu_seqlens": cu_seqlens, "position_ids": positions}, labels[:1]


@torch.no_grad()
def load_full_state(model, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a parallelized model: each rank takes its own block of every DTensor (the offsets
    DCP uses when it reshards), plain parameters are copied whole."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    state = get_model_state_dict(model)
    assert set(state) <= set(full), sorted(set(state) - set(full))  # a pipeline stage holds a part
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            block = full[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            tensor.to_local().copy_(block)
        else:
            tensor.copy_(full[name])


def job_config(flags: list[str]):
    from flame.config import parse_args

    return parse_args(["--training.seq_len", str(SEQ_LEN), "--optimizer.lr", str(LR), *flags])


def train(
    model,
    model_parts_params,
    optimizers,
    inputs,
    labels,
    global_tokens,
    reduce_mesh,
    loss_ctx,
    model_kwargs=None,
):
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import utils as dist_utils

    history = []
    for _ in range(STEPS):
        optimizers.zero_grad()
        with loss_ctx():
            logits = model(inputs, **(model_kwargs or {}))
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
            )
            loss = loss_sum / global_tokens
            loss.backward()
        loss = loss.detach()
        if isinstance(loss, DTensor):  # loss parallel
            loss = loss.full_tensor()
        grad_norm = dist_utils.clip_grad_norm_(model_parts_params(), MAX_NORM, foreach=True)
        optimizers.step()
        if reduce_mesh is not None:
            loss = dist_utils.dist_sum(loss, reduce_mesh)
        history.append((float(loss), float(grad_norm)))
    return history


def reference_run(family: str, documents: tuple[int, ...] | None = None) -> list[tuple[float, float]]:
    """One process, no parallelism: the numbers every setting must reproduce (on one packed row with
    ``documents``)."""
    import contextlib

    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims

    from flame.models import build_model

    model = build_model(model_args(family))
    model.load_state_dict(initial_state(family))
    config = job_config([])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers([model], config.optimizer, dims)
    kwargs = {}
    if documents is None:
        inputs, labels = batch()
    else:
        packed, labels = packed_batch(documents)
        inputs, kwargs = packed["input"], {k: packed[k] for k in ("position_ids", "cu_seqlens")}
    tokens = (labels != -100).sum().float()
    return train(
        model, model.parameters, optimizers, inputs, labels, tokens, None, contextlib.nullcontext, kwargs
    )


def parallel_run(setting: Setting, family: str) -> list[tuple[float, float]]:
    """Run on every rank of an initialized gloo world of setting.world_size ranks."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims

    from flame.models import build_model
    from flame.parallelize import parallelize_model, tie_embeddings

    flags = [
        "--parallelism.data_parallel_replicate_degree", str(setting.dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(setting.dp_shard),
        "--parallelism.tensor_parallel_degree", str(setting.tp),
        "--parallelism.pipeline_parallel_degree", str(setting.pp),
        "--parallelism.context_parallel_degree", str(setting.cp),
        *(["--training.varlen", "--training.batch_size", "1"] if setting.documents else []),
        *setting.flags,
    ]  # fmt: skip
    config = job_config(flags)
    dims = ParallelDims(
        dp_replicate=setting.dp_replicate, dp_shard=setting.dp_shard, cp=setting.cp, tp=setting.tp, pp=setting.pp, ep=1, etp=1,
        world_size=dist.get_world_size(),
    )  # fmt: skip
    dims.build_mesh()
    with torch.device("meta"):
        model = build_model(model_args(family))
    if setting.pp > 1:
        assert setting.documents is None, "pipeline_run trains on the 4-row batch"
        return pipeline_run(model, dims, config, family)
    model = parallelize_model(
        model, dims, config, loss_parallel=setting.loss_parallel, sequence_parallel=setting.sequence_parallel
    )
    model.to_empty(device="cpu")
    tie_embeddings(model)
    model.init_weights()  # the trainer's path (random init of DTensors); overwritten below
    # Identical initial weights in every setting: the full tensors, scattered to each rank's shards.
    load_full_state(model, initial_state(family))
    model.train()
    optimizers = build_optimizers([model], config.optimizer, dims)

    loss_ctx = loss_parallel if setting.loss_parallel else contextlib.nullcontext
    if setting.documents is None:
        inputs, labels, global_tokens = data_shard(dims)
        inputs = {"input": inputs}
    else:  # one packed row: no data parallelism, every rank reads it
        assert not dims.dp_enabled
        inputs, labels = packed_batch(setting.documents)
        global_tokens = (labels != -100).sum().float()
    if dims.cp_enabled:
        # The trainer's split: every rank of a cp group trains on one slice of each row, inside sequence_sharded
        # (which gets the whole row's cu_seqlens of a packed row).
        from flame.ops.context_parallel import sequence_sharded
        from flame.parallelize.context_parallel import ROW_CU_SEQLENS, shard_batch

        group = dims.get_mesh("cp").get_group()
        inputs, labels = shard_batch(inputs, labels, group)

        def loss_ctx():
            return sequence_sharded(group, inputs.get(ROW_CU_SEQLENS))

    kwargs = {k: inputs[k] for k in ("position_ids", "cu_seqlens") if k in inputs}
    return train(
        model, model.parameters, optimizers, inputs["input"], labels, global_tokens,
        dims.get_optional_mesh("loss"), loss_ctx, kwargs,
    )  # fmt: skip


def data_shard(dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch, and the global count of labelled tokens."""
    inputs, labels = batch()
    global_tokens = (labels != -100).sum().float()
    if dims.dp_enabled:
        batch_mesh = dims.get_mesh("batch")
        rows = GLOBAL_BATCH // batch_mesh.size()
        start = batch_mesh.get_local_rank() * rows
        inputs, labels = inputs[start : start + rows], labels[start : start + rows]
    return inputs, labels, global_tokens


def pipeline_run(model, dims, config, family: str) -> list[tuple[float, float]]:
    """The trainer's step with a pipeline schedule: micro-batches of 1 row, loss normalised by the global
    token count inside the schedule, gradient norm reduced over the stages. With context parallelism the rows
    are this rank's slices, the positions go to every stage and the schedule runs inside sequence_sharded."""
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import utils as dist_utils

    from flame.ops.context_parallel import sequence_sharded
    from flame.parallelize import tie_embeddings
    from flame.parallelize.pipeline import TokenNormalizedLoss, pipeline_model

    inputs, labels, global_tokens = data_shard(dims)
    kwargs, cp_group = {}, None
    if dims.cp_enabled:
        from flame.parallelize.context_parallel import shard_batch

        cp_group = dims.get_mesh("cp").get_group()
        sharded, labels = shard_batch({"input": inputs}, labels, cp_group)
        inputs, kwargs = sharded["input"], {"position_ids": sharded["position_ids"]}
    config.training.local_batch_size = inputs.shape[0]
    config.parallelism.pipeline_parallel_microbatch_size = 1
    loss_fn = TokenNormalizedLoss()
    schedule, parts, first, last = pipeline_model(model, dims, config, torch.device("cpu"), loss_fn)
    full = initial_state(family)
    for part in parts:
        part.to_empty(device="cpu")
        tie_embeddings(part)
        part.init_weights()
        load_full_state(part, full)
        part.train()
    optimizers = build_optimizers(parts, config.optimizer, dims)
    pp_mesh = dims.get_mesh("pp")
    history = []
    for _ in range(STEPS):
        optimizers.zero_grad()
        loss_fn.global_tokens = global_tokens
        losses = [] if last else None
        args = (inputs,) if first else ()
        with sequence_sharded(cp_group):
            schedule.step(*args, target=labels if last else None, losses=losses, **kwargs)
        loss = torch.stack(losses).sum().detach() if last else torch.zeros(())
        grad_norm = dist_utils.clip_grad_norm_(
            [p for part in parts for p in part.parameters()], MAX_NORM, foreach=True, pp_mesh=pp_mesh
        )
        optimizers.step()
        # Only the last stage has the loss; data-parallel and cp ranks each have their part.
        loss_mesh = dims.get_optional_mesh("loss")
        loss = dist_utils.dist_sum(loss, pp_mesh, extra_pg=loss_mesh.get_group() if loss_mesh else None)
        history.append((float(loss), float(grad_norm)))
    return history


def _worker(rank: int, world_size: int, rendezvous: str, jobs: list[tuple[Setting, str]], out: str) -> None:
    from flame import compat

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    compat.apply()
    results = {}
    try:
        for setting, family in jobs:
            try:
                results[f"{setting.name}/{family}"] = parallel_run(setting, family)
            except Exception as e:  # reported per job, so one failure does not hide the others
                results[f"{setting.name}/{family}"] = f"{type(e).__name__}: {e}"
                raise
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.destroy_process_group()


def run_world(world_size: int, jobs: list[tuple[Setting, str]], tmp: Path) -> dict:
    """Spawn ``world_size`` gloo ranks that run every job in turn; rank 0's results per 'setting/family'."""
    import torch.multiprocessing as mp

    out = tmp / f"results-{world_size}.json"
    mp.spawn(
        _worker,
        args=(world_size, str(tmp / f"rendezvous-{world_size}"), copy.deepcopy(jobs), str(out)),
        nprocs=world_size,
        join=True,
    )
    return json.loads(out.read_text())
