"""Every parallel setting trains like one process: FSDP, HSDP, DDP, TP (with and without sequence parallelism,
with loss parallelism), FSDP x TP, pipeline parallelism (1F1B, GPipe, interleaved; x FSDP, x TP), context parallelism
(2 and 4 ranks, x FSDP, x TP, x TP x FSDP, x PP with 1F1B and interleaved schedules, with activation checkpointing
and compiled blocks; on packed documents for GatedDeltaNet, DeltaNet, the hybrid and windowed softpick attention),
activation checkpointing, CPU offload and the Muon optimizer (whole matrices gathered from uneven shards),
for the transformer (GQA, QK-norm, per-head query scales, tied embeddings), GatedDeltaNet (grouped value heads), a
GatedDeltaNet/attention hybrid, DeltaNet and windowed softpick attention, on 2 and 4 gloo ranks in this machine's
processes. (A 3-D mesh, cp x tp x fsdp, needs 8 ranks: on this machine's 2 cores that one case cost 35 s of the suite,
and each pair of its dimensions is checked on 4 ranks.)

All runs start from the same full weights (scattered into each rank's shards), see the same global batch, and
train 3 steps as flame's trainer does. Loss and gradient norm must match the single-process run to float32
summation-order differences: 1e-5 relative for the loss, 1e-4 for the gradient norm (observed: <= 2e-5). The
pipeline runs check the fix of torchtitan#2972 (pipeline gradients token-count times too large): their gradient
norms equal the unpipelined ones.
"""

import pytest

from tests.parallelize.harness import Setting, reference_run, run_world

pytestmark = pytest.mark.slow

LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
ALL = ("transformer", "gated_deltanet", "hybrid", "delta_net")

# Packed documents (one row of 32 tokens, cu_seqlens) against the slice borders; the short convolutions reach
# conv_size - 1 = 3 tokens back. cp 2 (border 16): a document starts on the border; a document of 2 tokens ends on
# it, starting inside the 3 tokens before it.
ON_BORDER = (0, 9, 14, 16, 30, 32)
# cp 2: a document of 2 tokens crosses the border (the state relay then starts the second slice's first document
# from it), starting inside the 3 tokens before it.
ACROSS_BORDER = (0, 9, 15, 17, 32)
# cp 4 (borders 8, 16, 24): a document starts inside the 3 tokens before border 8, spans slices 0-2 and ends on
# border 24; documents of 2 and 1 tokens.
THREE_SLICES = (0, 2, 7, 24, 25, 32)
PACKED = ("gated_deltanet", "delta_net", "hybrid")

AC_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]
# float32 iterations: bfloat16 would round the shards' slightly different sums differently.
MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
AC_LAYER = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "1"]
FUSED = ("transformer_fused", "hybrid_fused")
TWO_RANKS = [
    (Setting("fsdp2", dp_shard=2), (*ALL, *FUSED)),
    (Setting("ddp2", dp_replicate=2), ("transformer", "gated_deltanet", *FUSED)),
    (Setting("tp2", tp=2), ALL),
    (Setting("tp2_no_sequence_parallel", tp=2, sequence_parallel=False), ("hybrid",)),
    (Setting("tp2_loss_parallel", tp=2, loss_parallel=True), ("transformer", "hybrid")),
    (
        Setting("fsdp2_full_ac", dp_shard=2, flags=["--activation_checkpoint.mode", "full"]),
        ("gated_deltanet",),
    ),
    (Setting("fsdp2_op_sac", dp_shard=2, flags=AC_OP), ("hybrid",)),
    (Setting("tp2_layer_sac", tp=2, flags=AC_LAYER), ("transformer",)),
    (Setting("fsdp2_cpu_offload", dp_shard=2, flags=["--training.enable_cpu_offload"]), ("transformer",)),
    (Setting("fsdp2_muon", dp_shard=2, flags=list(MUON), reference_flags=MUON), ("hybrid_uneven",)),
    # Blocks 0-2 in one FSDP unit, block 3 in another.
    (
        Setting(
            "fsdp2_units_of_3_blocks",
            dp_shard=2,
            flags=["--parallelism.fsdp_blocks_per_unit", "3"],
        ),
        ("hybrid_4_layers",),
    ),
    (Setting("pp2_1f1b", pp=2), ("gated_deltanet", "hybrid")),
    (Setting("cp2", cp=2), (*ALL, "softpick_window", *FUSED)),
    (Setting("cp2_full_ac", cp=2, flags=["--activation_checkpoint.mode", "full"]), ("hybrid",)),
    (Setting("cp2_op_sac", cp=2, flags=AC_OP), ("hybrid",)),
    (Setting("cp2_varlen_on_border", cp=2, documents=ON_BORDER), PACKED),
    (Setting("cp2_varlen_across_border", cp=2, documents=ACROSS_BORDER), (*PACKED, "softpick_window")),
    # The hybrid's GatedDeltaNet and attention blocks both compile here (44 s of this file on an idle 2-core machine),
    # with the state relay across the border: compiled blocks under context parallelism are checked on packed rows
    # (the 4-row batch's compiled blocks: tests/parallelize/test_compile.py, its cp slices: cp2 above).
    (Setting("cp2_varlen_compiled", cp=2, documents=ACROSS_BORDER, flags=COMPILED), ("hybrid",)),
    (Setting("pp2_gpipe", pp=2, flags=["--parallelism.pipeline_parallel_schedule", "GPipe"]), ("hybrid",)),
    (
        Setting(
            "pp2_interleaved", pp=2, flags=["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
        ),
        ("hybrid_4_layers",),
    ),
]
# Four ranks combine parallelisms that each family passes alone on two: the hybrid (attention and GatedDeltaNet
# blocks in one model) carries the combinations, DeltaNet its own tensor-parallel plan.
FOUR_RANKS = [
    (Setting("hsdp2x2", dp_replicate=2, dp_shard=2), ("hybrid",)),
    (Setting("fsdp2_x_tp2", dp_shard=2, tp=2), ("hybrid", "delta_net")),
    (Setting("pp2_x_fsdp2", pp=2, dp_shard=2), ("hybrid",)),
    (Setting("pp2_x_tp2", pp=2, tp=2), ("gated_deltanet",)),
    (Setting("cp2_x_fsdp2", cp=2, dp_shard=2), ("hybrid",)),
    (Setting("cp4", cp=4), ("hybrid",)),
    (Setting("cp4_varlen", cp=4, documents=THREE_SLICES), PACKED),
    # FSDP over the cp ranks as well: a 2-D (fsdp, tp) mesh
    (Setting("cp2_x_tp2", cp=2, tp=2), ("hybrid", "delta_net")),
    (Setting("cp2_x_tp2_varlen", cp=2, tp=2, documents=ACROSS_BORDER), ("gated_deltanet", "hybrid")),
    (Setting("pp2_x_cp2", pp=2, cp=2), ("gated_deltanet", "hybrid")),
    (
        Setting(
            "pp2_x_cp2_interleaved",
            pp=2,
            cp=2,
            flags=["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
        ),
        ("hybrid_4_layers",),
    ),
    # One packed row through Interleaved1F1B (two stages per rank) x cp 2: cu_seqlens reach every stage, and every
    # stage relays the states of documents that cross the slice border.
    (
        Setting(
            "pp2_x_cp2_interleaved_varlen",
            pp=2,
            cp=2,
            documents=ACROSS_BORDER,
            flags=["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
        ),
        ("hybrid_4_layers",),
    ),
]
WORLDS = ((2, TWO_RANKS), (4, FOUR_RANKS))
CASES = [(setting, family, world) for world, table in WORLDS for setting, families in table for family in families]  # fmt: skip


@pytest.fixture(scope="module")
def references():
    runs = sorted(
        {(family, setting.documents or (), setting.reference_flags) for setting, family, _ in CASES}
    )
    return {
        (family, documents, flags): reference_run(family, documents or None, flags)
        for family, documents, flags in runs
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """All settings of one world size run in one spawn of that many ranks (each rank starts torch once)."""
    tmp = tmp_path_factory.mktemp("parallel")
    found = {}
    for world, _ in WORLDS:
        jobs = [(setting, family) for setting, family, w in CASES if w == world]
        found.update(run_world(world, jobs, tmp))
    return found


@pytest.mark.parametrize(
    ("setting", "family"), [(s, f) for s, f, _ in CASES], ids=[f"{s.name}-{f}" for s, f, _ in CASES]
)
def test_matches_one_process(setting, family, results, references):
    got = results[f"{setting.name}/{family}"]
    want = references[family, setting.documents or (), setting.reference_flags]
    assert len(got) == len(want) == 3
    assert want[-1][0] < want[0][0] - 0.3  # the steps do train
    for step, ((loss, grad_norm), (ref_loss, ref_grad_norm)) in enumerate(zip(got, want), 1):
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL), (step, got, want)
        assert grad_norm == pytest.approx(ref_grad_norm, rel=GRAD_NORM_RTOL), (step, got, want)
