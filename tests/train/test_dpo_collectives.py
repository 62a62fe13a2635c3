"""One DPO step under FSDP2 on 2 gloo ranks gathers each block's parameters in a fixed number of collectives,
whatever the number of parameter tensors in the block: 3 per block (the policy's forward, its backward after the
forward resharded it, the reference's forward). A GatedDeltaNet block holds about twice an attention block's
tensors and costs the same; ZeRO-3's per-parameter gathers are what made hybrid DPO slow (shared/seeds)."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {
    "transformer": {"model_type": "transformer", "num_heads": 4},
    "gated_deltanet": {"model_type": "gated_deltanet", "num_heads": 2, "head_dim": 16},
}
TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64}


def gathers_of_one_dpo_step(family: str, layers: int) -> tuple[int, int]:
    """(all-gathers in one step after a warm-up step, parameter tensors per block) on this rank."""
    from torchtitan.distributed import ParallelDims

    from flame.config import parse_args
    from flame.models import get_model_spec
    from flame.train.model_parts import Topology, build_model_parts
    from flame.train.objective import build_objective
    from flame.train.step import build_train_step

    config = parse_args(["--job.task", "dpo", "--training.seq_len", "16", "--training.batch_size", "1",
                         "--parallelism.data_parallel_shard_degree", "2"])  # fmt: skip
    spec = {**TINY, **MODELS[family], "num_hidden_layers": layers}
    args, _ = get_model_spec(spec["model_type"]).args_cls.from_dict(spec)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    dims.build_mesh()
    topology = Topology.of(dims, torch.device("cpu"))
    policy = build_model_parts(args, topology, config)
    step = build_train_step(policy, topology, config, objective=build_objective(args, topology, config))
    tokens = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(0))
    batches = [({"input": tokens[:, :-1]}, tokens[:, 1:])]
    step(batches)
    calls = 0
    original = dist.all_gather_single

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        step(batches)
    finally:
        dist.all_gather_single = original
    tensors_per_block = len(list(policy.parts[0].layers["0"].parameters()))
    return calls, tensors_per_block


def _worker(rank: int, rendezvous: str, out: str) -> None:
    from flame import compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    compat.apply()
    try:
        results = {f"{f}/{n}": gathers_of_one_dpo_step(f, n) for f in MODELS for n in (2, 4)}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dpo_step_gathers_each_block_a_fixed_number_of_times(tmp_path):
    if not hasattr(dist, "all_gather_single"):
        pytest.fail("FSDP2's all-gather is no longer torch.distributed.all_gather_single: update this test")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path / "gathers.json"
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(out)), nprocs=2, join=True)
    results = {key: tuple(value) for key, value in json.loads(out.read_text()).items()}
    (t2, t_tensors), (t4, _) = results["transformer/2"], results["transformer/4"]
    (g2, g_tensors), (g4, _) = results["gated_deltanet/2"], results["gated_deltanet/4"]
    assert g_tensors >= 2 * t_tensors  # many more tensors per GatedDeltaNet block ...
    assert (t2, t4) == (g2, g4)  # ... the same gathers
    assert t4 - t2 == 2 * 3  # 3 per block
