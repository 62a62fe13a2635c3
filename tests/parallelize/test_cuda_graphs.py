"""flame.parallelize.cuda_graphs on the CPU: which runs and which calls the graphs serve, and that wrapping the blocks
changes neither a call the graphs do not serve nor the parameters' names. Capture and replay against the eager
blocks are tests/gpu/test_block_graphs.py's."""

import pytest
import torch
from torch import nn

from flame.config import parse_args
from flame.parallelize import compile as compile_module
from flame.parallelize.cuda_graphs import BlockGraphs, _BlockGraph, call_signature


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, hidden, attention_mask=None, scale=1.0, cu_seqlens=None):
        return (hidden + scale * torch.tanh(self.linear(hidden)), None)


def test_wrapped_blocks_run_their_own_forward_where_the_graphs_do_not_serve():
    """On the CPU no call is served: outputs, gradients and state-dict names are the unwrapped blocks'."""
    torch.manual_seed(0)
    plain = nn.ModuleList(Block() for _ in range(3))
    wrapped = nn.ModuleList(Block() for _ in range(3))
    wrapped.load_state_dict(plain.state_dict())
    owner = BlockGraphs(list(wrapped))
    x = torch.randn(2, 5, 6)
    results = []
    for blocks in (plain, wrapped):
        h = x
        for block in blocks:
            h = block(h, attention_mask=None, scale=0.5)[0]
        h.square().sum().backward()
        results.append((h, [p.grad for p in blocks.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert owner.graphs == [] and not owner.replaying


def test_call_signature_names_the_calls_a_graph_serves(monkeypatch):
    block = Block()
    x = torch.randn(2, 5, 6, requires_grad=True)
    assert call_signature(block, (x,), {}) is None  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    base = call_signature(block, (x,), {"attention_mask": None, "scale": 0.5})
    assert base is not None
    assert (
        call_signature(block, (x.detach().clone().requires_grad_(),), {"attention_mask": None, "scale": 0.5})
        == base
    )
    differs = {
        "another constant": call_signature(block, (x,), {"attention_mask": None, "scale": 0.25}),
        "another shape": call_signature(block, (torch.randn(2, 7, 6, requires_grad=True),), {"scale": 0.5}),
        "another dtype": call_signature(block, (x.double(),), {"attention_mask": None, "scale": 0.5}),
    }
    assert all(signature is not None and signature != base for signature in differs.values()), differs
    with torch.no_grad():
        assert call_signature(block, (x,), {}) is None
    # Tensors beyond the hidden states (packed documents' boundaries, a mask) are not graph inputs.
    assert call_signature(block, (x,), {"cu_seqlens": torch.tensor([0, 5])}) is None
    block.eval()
    assert call_signature(block, (x,), {}) is None


def test_which_forwards_replay(monkeypatch, caplog):
    """The replay rule, with the capture stood in for (CUDA graphs need a GPU): the first training forward captures
    and replays; a forward before the last replayed one's backward, or while a parameter holds a gradient (a step's
    later micro-batch, whose replay would overwrite the gradients in the graphs' pool), runs eagerly with one log
    line; so do another shape and a forward without grad, silently."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    blocks = [Block() for _ in range(2)]
    owner = BlockGraphs(blocks)
    captures = []

    def capture(args, kwargs):
        captures.append(args[0].shape)
        owner.graphs = []
        for block in blocks:
            graph = object.__new__(_BlockGraph)  # its CUDA graphs aside
            graph.params = tuple(block.parameters())
            graph.signature = call_signature(block, args, kwargs)
            owner.graphs.append(graph)

    monkeypatch.setattr(owner, "capture", capture)

    def serves(hidden):  # as a forward's first block call asks it
        return owner.serves(call_signature(blocks[0], (hidden,), {}), (hidden,), {})

    x = torch.randn(2, 5, 6, requires_grad=True)
    with caplog.at_level("INFO"):
        assert serves(x) and captures == [x.shape]
        owner.backward_pending = True  # a replayed forward whose backward has not run
        assert not serves(x)
        owner.backward_pending = False
        blocks[0].linear.bias.grad = torch.zeros(6)  # the step's first micro-batch's gradient
        assert not serves(x)
        with torch.no_grad():
            assert not serves(x)
        blocks[0].linear.bias.grad = None  # the optimizer's zero_grad
        assert serves(x)
        assert not serves(torch.randn(2, 7, 6, requires_grad=True))
    assert captures == [x.shape]
    assert len([r for r in caplog.records if "runs its blocks eagerly" in r.message]) == 1


@pytest.mark.parametrize(
    "flags, world_size, on_gpu, graphs",
    [
        ([], 1, True, True),
        ([], 1, False, False),
        ([], 2, True, False),
        (["--compile.no-graph_eager_blocks"], 1, True, False),
        (["--activation_checkpoint.mode", "full"], 1, True, False),
        (["--activation_offload.mode", "full"], 1, True, False),
    ],
)
def test_runs_whose_eager_blocks_replay_as_graphs(flags, world_size, on_gpu, graphs):
    job_config = parse_args(["--compile.enable", *flags])
    assert compile_module.graphs_eager_blocks(job_config, world_size, on_gpu) is graphs


def test_fla_classes_blocks_are_wrapped_for_graphs_with_one_log_line(caplog):
    from flame.models import build_model, model_args_from_dict, model_spec

    args, _ = model_args_from_dict(
        {"model_type": "gla", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2}
    )
    with torch.device("meta"):
        model = build_model(args)
    names = list(model.state_dict())
    with caplog.at_level("INFO"):
        compile_module.compile_blocks(model, backend="eager", graph_eager_blocks=True)
    blocks = [block for stack in model_spec(args).blocks(model) for block in stack]
    owners = {block.forward.func.__self__ for block in blocks}
    assert len(owners) == 1 and next(iter(owners)).blocks == blocks
    assert list(model.state_dict()) == names
    lines = [r.message for r in caplog.records if "leaves the blocks eager" in r.message]
    assert len(lines) == 1 and "replay as CUDA graphs" in lines[0] and "model_type 'gla'" in lines[0]
