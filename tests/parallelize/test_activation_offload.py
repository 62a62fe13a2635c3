"""Activation offloading (flame.parallelize.activation_offload) on the CPU, where a saved tensor's round trip is a
copy in host memory: the gradients equal those without it bit for bit (eager, under full activation checkpointing,
compiled blocks), what is copied (once per tensor, not the parameters, not small tensors), and a training run
with the flag. The GPU path (pinned memory, side stream): tests/gpu/test_activation_offload.py."""

import logging

import pytest
import torch
from torch import nn

from flame.config import parse_args
from flame.parallelize.activation_checkpoint import apply_activation_checkpointing
from flame.parallelize.activation_offload import (
    PIECE_BYTES,
    ActivationOffload,
    apply_activation_offload,
    host_bytes,
    host_peak_gib,
)
from flame.parallelize.compile import compile_blocks
from tests.models.helpers import tiny_model
from tests.trainer_helpers import tensorboard_scalars

CPU = torch.device("cpu")
FAMILIES = {
    "transformer": {"num_heads": 4},
    "hybrid": {"head_dim": 8, "num_heads": 2, "attn": {"layers": [1], "num_heads": 4}},
}


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(1))
    model(tokens).logsumexp(-1).square().mean().backward()
    # Compiled and checkpointed blocks name their parameters through their wrappers.
    names = {
        name: name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")
        for name, _ in model.named_parameters()
    }
    return {names[name]: p.grad for name, p in model.named_parameters()}


def with_offload(family: str, prepare=None, piece_bytes: int = PIECE_BYTES) -> tuple[dict, ActivationOffload]:
    model = tiny_model(family.replace("hybrid", "gated_deltanet"), **FAMILIES[family])
    if prepare is not None:
        prepare(model)
    offload = apply_activation_offload(model, CPU, min_bytes=0, piece_bytes=piece_bytes)
    return gradients(model), offload


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# The default pieces hold each of these tensors whole; 128-byte pieces split them (37-token rows: a last piece of
# another size).
@pytest.mark.parametrize("piece_bytes", [PIECE_BYTES, 128])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_without_offload(family, piece_bytes):
    want = gradients(tiny_model(family.replace("hybrid", "gated_deltanet"), **FAMILIES[family]))
    got, offload = with_offload(family, piece_bytes=piece_bytes)
    assert offload.offloaded_bytes > 100_000  # the blocks' activations went through the copies
    assert offload.live_bytes == 0  # backward done: autograd released every copy
    # Unpinned pieces take the tensors' bytes; the peak is reached before backward releases any, though a few of
    # the forward's saved tensors (1% of the hybrid's) go with intermediate results autograd drops in the forward.
    assert 0.95 * offload.offloaded_bytes < offload.peak_live_bytes <= offload.offloaded_bytes
    assert_equal(got, want)


def test_full_checkpointing_offloads_the_blocks_inputs():
    config = parse_args(["--activation_checkpoint.mode", "full"])
    want = gradients(tiny_model("transformer", **FAMILIES["transformer"]))
    got, offload = with_offload("transformer", lambda model: apply_activation_checkpointing(model, config))
    assert_equal(got, want)
    # What the checkpoint keeps of each of the 2 blocks: its input, [2, 37, 32] float32 (the rotary tables are
    # the model's buffers, shared by the blocks: copied once per block).
    hidden = 2 * 37 * 32 * 4
    assert hidden * 2 <= offload.offloaded_bytes < hidden * 4


def test_compiled_blocks_offload_their_graphs_saved_tensors():
    want = gradients(tiny_model("transformer", **FAMILIES["transformer"]))
    got, offload = with_offload("transformer", lambda model: compile_blocks(model, "aot_eager"))
    assert offload.offloaded_bytes > 100_000
    assert_equal(got, want)


def test_a_tensor_saved_twice_is_copied_once_and_parameters_and_small_tensors_stay():
    linear = nn.Linear(40, 24)  # saves its input and its weight
    x = torch.randn(7, 40, requires_grad=True)
    offload = ActivationOffload(CPU, min_bytes=7 * 40 * 4)
    offload.enter(linear, 0)
    y = linear(x) * x[:, :24].sin().sum()  # sin saves a view of x; the product saves small and large tensors
    offload.exit()
    # x once (a view with its own shape is another tensor: sin's input x[:, :24] is below min_bytes).
    assert offload.offloaded_bytes == 7 * 40 * 4
    y.sum().backward()
    want_x, want_w = torch.autograd.grad((linear(x) * x[:, :24].sin().sum()).sum(), (x, linear.weight))
    assert torch.equal(x.grad, want_x) and torch.equal(linear.weight.grad, want_w)


def test_a_tensor_in_pieces_comes_back_with_its_strides_and_values():
    """A saved tensor is stored as its bytes in memory order, in pieces; what comes back has its shape, strides and
    dtype (a transposed view at an offset into its storage, bf16) and its values bit for bit."""
    base = torch.randn(13, 29, 31).to(torch.bfloat16)
    saved = base[2:].transpose(0, 2)  # dense, permuted strides, storage offset 2 x 29 x 31
    offload = ActivationOffload(CPU, min_bytes=0, piece_bytes=256)
    offload.enter(nn.Linear(2, 2), 0)
    stash = offload.pack(saved)
    offload.exit()
    size = saved.numel() * 2  # 11 x 29 x 31 bf16: 19,778 bytes, 77 pieces of 256 and one of 66
    assert [piece.numel() for piece in stash.pieces] == [256] * 77 + [66] and offload.live_bytes == size
    back = offload.unpack(stash)
    assert back.shape == saved.shape and back.stride() == saved.stride() and back.dtype == torch.bfloat16
    assert torch.equal(back, saved) and back.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    expanded = torch.randn(1, 64).expand(64, 64)  # overlapping: its bytes would not make it again
    offload.enter(nn.Linear(2, 2), 1)
    assert offload.pack(expanded) is expanded
    offload.exit()


def test_host_bytes_count_the_pinned_allocators_rounding_of_the_last_piece():
    assert host_bytes(5 * 256, 256, pinned=True) == 5 * 256  # whole pieces: a power of two each, not rounded
    assert host_bytes(5 * 256 + 3, 256, pinned=True) == 5 * 256 + 4
    assert host_bytes(5 * 256 + 129, 256, pinned=True) == 6 * 256
    assert host_bytes(100, 256, pinned=True) == 128
    assert host_bytes(5 * 256 + 129, 256, pinned=False) == 5 * 256 + 129  # a plain host tensor takes its size
    # A 65,536 x 1,536 bf16 tensor: rounded whole it would take 256 MiB; in 16 MiB pieces, its 192 MiB.
    assert host_bytes(65536 * 1536 * 2, PIECE_BYTES, pinned=True) == 192 << 20


def test_offloading_past_the_hosts_free_memory_stops_with_one_line(monkeypatch):
    """The host's free memory is measured when the offloaded bytes pass what it had free at the last measurement,
    and a tensor that would leave less than the reserve stops the step with a FlameError naming what to do."""
    from flame.errors import FlameError
    from flame.parallelize import activation_offload

    offload = ActivationOffload(CPU, min_bytes=0)
    offloads, measured = [offload], []

    def available_host_bytes():  # a host with 3,000 bytes to spare, less what the offloads hold
        held = sum(o.live_bytes for o in offloads)
        measured.append(held)
        return activation_offload.HOST_RESERVE_BYTES + 3000 - held

    monkeypatch.setattr(activation_offload, "available_host_bytes", available_host_bytes)
    offload.enter(nn.Linear(2, 2), 0)
    first, second = offload.pack(torch.randn(250)), offload.pack(torch.randn(250))  # 1,000 bytes each
    assert measured == [0] and offload.live_bytes == 2000
    with pytest.raises(
        activation_offload.HostMemoryExhausted, match="activation_checkpoint.mode full"
    ) as error:
        offload.pack(torch.randn(500))  # 2,000 more: measured again, 1,000 left
    assert isinstance(error.value, FlameError) and measured == [0, 2000]
    offload.exit()
    del first  # autograd dropped it
    assert offload.live_bytes == 1000
    offload.enter(nn.Linear(2, 2), 1)
    offload.pack(torch.randn(500))  # within what the last measurement left: not measured again
    assert measured == [0, 2000] and offload.live_bytes == 3000 and offload.peak_live_bytes == 3000
    offload.exit()
    assert sum(piece.numel() for piece in second.pieces) == 1000
    # Two ranks on the host: each takes half of what is free.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = ActivationOffload(CPU, min_bytes=0)
    offloads.append(shared)
    shared.enter(nn.Linear(2, 2), 0)
    with pytest.raises(activation_offload.HostMemoryExhausted, match="of 2 on the host"):
        shared.pack(torch.randn(500))  # 3,000 held by the other rank: none left
    offload.live_bytes = 0  # the other rank's tensors gone: 3,000 free, 1,500 for each rank
    kept = shared.pack(torch.randn(250))
    shared.pack(torch.randn(125))  # 1,500 in all
    with pytest.raises(activation_offload.HostMemoryExhausted):
        shared.pack(torch.randn(250))  # measured again: 1,500 free, 750 for this rank
    assert shared.live_bytes == 1500
    shared.exit()
    assert (
        sum(piece.numel() for piece in kept.pieces) == 1000 and shared.live_bytes == 1000
    )  # the unheld stash released with the block


def test_a_compilers_traced_tensors_stay_where_they_are(monkeypatch):
    """AOTAutograd runs the hooks on its fake tensors when a traced op saves one in Python: they pass through (the
    compiled block's saved tensors are offloaded at run time)."""
    offload = ActivationOffload(CPU, min_bytes=0)
    offload.enter(nn.Linear(2, 2), 0)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = torch.randn(64, 40)
        assert offload.pack(fake) is fake
    real = torch.randn(64, 40)
    assert offload.pack(real) is not real  # a stash in host memory
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert offload.pack(real) is real
    offload.exit()
    assert offload.offloaded_bytes == 64 * 40 * 4


def test_training_with_offload_repeats_the_run_without(make_trainer, tmp_path, monkeypatch, caplog):
    from flame.parallelize import parallelize

    caplog.set_level(logging.INFO)

    applied = []

    def recorded(*args, **kwargs):
        applied.append(apply_activation_offload(*args, **kwargs))
        return applied[-1]

    monkeypatch.setattr(parallelize, "apply_activation_offload", recorded)
    flags = ["--training.steps", "2"]
    make_trainer(*flags, dump=tmp_path / "plain").train()
    assert applied == []
    make_trainer(*flags, "--activation_offload.mode", "full", dump=tmp_path / "offload").train()
    # The default tiny model's hidden states (2 x 64 x 256 float32) are above MIN_OFFLOAD_BYTES.
    assert len(applied) == 1 and applied[0].offloaded_bytes > 0
    # The first step says how much host memory its offloaded activations took at their peak.
    said = [
        r.message for r in caplog.records if r.message.startswith("Activation offloading: the first step")
    ]
    assert said == [
        f"Activation offloading: the first step's activations took {applied[0].peak_live_bytes / 2**30:.3g} GiB "
        "of host memory"
    ]
    plain, offloaded = (tensorboard_scalars(tmp_path / name, "loss/train") for name in ("plain", "offload"))
    assert sorted(plain) == [1, 2] and offloaded == plain


def test_host_peak_gib_sums_the_offloading_parts_of_a_model():
    first, second, plain = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    for part, peak in ((first, 3 << 30), (second, 1 << 29)):
        part.activation_offload = ActivationOffload(CPU)
        part.activation_offload.peak_live_bytes = peak
    assert host_peak_gib([first, plain, second]) == 3.5
    assert host_peak_gib([plain]) is None
