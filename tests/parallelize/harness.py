"""In-process multi-rank training on CPU/gloo through the trainer's own builder and step (build_model_parts,
TrainStep): a tiny model parallelized with flame's plan, the same initial weights loaded everywhere, a few steps on
one batch, and the global loss and gradient norm per step. ``reference_run`` does the same in one process without
any parallelism. A setting with ``documents`` trains on one packed row instead (training.varlen: those cu_seqlens
over the first row of the batch).
"""

import copy
import faulthandler
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

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
    # The hybrid with 97 MLP rows: FSDP shards the gate and up projections unevenly (Muon gathers them).
    "hybrid_uneven": {
        "model_type": "gated_deltanet",
        "head_dim": 16,
        "num_heads": 2,
        "intermediate_size": 97,
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
    # The loss from the hidden states through lm_head, chunk by chunk (flame/ops/linear_cross_entropy.py): tied
    # (lm_head in the root's FSDP group) and untied (its own group with the final norm).
    "transformer_fused": {
        "model_type": "transformer",
        "num_heads": 4,
        "num_kv_heads": 2,
        "tie_word_embeddings": True,
        "fuse_linear_cross_entropy": True,
    },
    "hybrid_fused": {
        "model_type": "gated_deltanet",
        "head_dim": 16,
        "num_heads": 2,
        "attn": {"layers": [1], "num_heads": 4},
        "fuse_linear_cross_entropy": True,
    },
    # Four layers (attention at 1 and 3): room for two pipeline stages per rank (interleaved schedules).
    "hybrid_4_layers": {
        "model_type": "gated_deltanet",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "num_heads": 2,
        "attn": {"every": 2, "offset": 1, "num_heads": 4, "num_kv_heads": 2},
    },
    # transformers' own classes on the generic path, all with GQA: qwen2 with q/k/v biases, qwen3 with per-head q/k
    # norms and tied embeddings, olmo2 with q/k norms over all heads.
    "llama": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"model_type": "mistral", "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen2": {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2},
    "olmo2": {"model_type": "olmo2", "num_attention_heads": 4, "num_key_value_heads": 2},
    "qwen3": {
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
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
    # Flags of ``flags`` that the one-process reference takes too (another optimizer).
    reference_flags: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


def model_args(family: str):
    from flame.models import model_args_from_dict

    args, unknown = model_args_from_dict({**TINY, **FAMILIES[family]})
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

    # A constant learning rate: every step moves the weights as much as the first.
    return parse_args(
        ["--training.seq_len", str(SEQ_LEN), "--optimizer.lr", str(LR), "--training.max_norm", str(MAX_NORM),
         "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0", *flags]
    )  # fmt: skip


def train(
    family: str, dims, config, inputs: dict, labels: torch.Tensor, **build
) -> list[tuple[float, float]]:
    """STEPS of the trainer's own step (build_model_parts + TrainStep) on one batch: every model part starts from
    ``initial_state``; returns the step's global loss and gradient norm per step."""
    from flame.train.model_parts import Topology, build_model_parts
    from flame.train.step import build_train_step

    full = initial_state(family)

    def initialize(part):
        part.init_weights()  # the trainer's path (random init of DTensors); overwritten below
        load_full_state(part, full)  # identical initial weights in every setting

    topology = Topology.of(dims, torch.device("cpu"))
    model = build_model_parts(model_args(family), topology, config, initialize=initialize, **build)
    step = build_train_step(model, topology, config)
    history = []
    for _ in range(STEPS):
        result = step([(inputs, labels)])
        history.append((step.global_metrics(result)["loss"], float(result.grad_norm)))
    return history


def reference_run(
    family: str, documents: tuple[int, ...] | None = None, flags: tuple[str, ...] = ()
) -> list[tuple[float, float]]:
    """One process, no parallelism: the numbers every setting must reproduce (on one packed row with
    ``documents``; with the job ``flags``)."""
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    if documents is None:
        inputs, labels = batch()
        inputs = {"input": inputs}
    else:
        inputs, labels = packed_batch(documents)
    return train(family, dims, job_config(list(flags)), inputs, labels)


def parallel_run(setting: Setting, family: str) -> list[tuple[float, float]]:
    """Run on every rank of an initialized gloo world of setting.world_size ranks: this rank's rows of the
    batch (all of them with context parallelism, whose step slices them), through the trainer's step."""
    from torchtitan.distributed import ParallelDims

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
    if setting.documents is None:
        inputs, labels = data_shard(dims)
        inputs = {"input": inputs}
    else:  # one packed row: no data parallelism, every rank reads it
        assert not dims.dp_enabled
        inputs, labels = packed_batch(setting.documents)
    if setting.pp > 1:
        # Micro-batches of one row (a cp rank's slice of one row with context parallelism; the packed row whole).
        config.training.local_batch_size = inputs["input"].shape[0]
        config.parallelism.pipeline_parallel_microbatch_size = 1
    return train(
        family, dims, config, inputs, labels,
        loss_parallel=setting.loss_parallel, sequence_parallel=setting.sequence_parallel,
    )  # fmt: skip


def data_shard(dims) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch."""
    inputs, labels = batch()
    if dims.dp_enabled:
        batch_mesh = dims.get_mesh("batch")
        rows = GLOBAL_BATCH // batch_mesh.size()
        start = batch_mesh.get_local_rank() * rows
        inputs, labels = inputs[start : start + rows], labels[start : start + rows]
    return inputs, labels


def _worker(rank: int, world_size: int, rendezvous: str, jobs: list[tuple[Setting, str]], out: str) -> None:
    from flame import compat

    faulthandler.enable()  # a rank killed by a signal prints its Python stack (mp.spawn reports only the signal)
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
