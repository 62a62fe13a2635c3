"""flame.parallelize.cuda_graphs on the CPU: which runs and which calls the graphs serve, and that wrapping the blocks
changes neither a call the graphs do not serve nor the parameters' names. Capture and replay against the eager
blocks are tests/gpu/test_block_graphs.py's."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flame.config import parse_args
from flame.parallelize import compile as compile_module
from flame.parallelize import cuda_graphs
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
    lower = torch.rand(6, requires_grad=True)
    with_lower = call_signature(block, (x,), {"attention_mask": None, "scale": 0.5, "lower": lower})
    assert with_lower is not None and with_lower == call_signature(
        block, (x,), {"attention_mask": None, "scale": 0.5, "lower": torch.rand(6, requires_grad=True)}
    )
    differs = {
        "another constant": call_signature(block, (x,), {"attention_mask": None, "scale": 0.25}),
        "another shape": call_signature(block, (torch.randn(2, 7, 6, requires_grad=True),), {"scale": 0.5}),
        "another dtype": call_signature(block, (x.double(),), {"attention_mask": None, "scale": 0.5}),
        "a per-layer tensor": with_lower,
        "its shape": call_signature(
            block, (x,), {"attention_mask": None, "scale": 0.5, "lower": torch.rand(7)}
        ),
        "its requires_grad": call_signature(
            block, (x,), {"attention_mask": None, "scale": 0.5, "lower": lower.detach()}
        ),
        "a transposed view": call_signature(
            block, (x.transpose(0, 1),), {"attention_mask": None, "scale": 0.5}
        ),
    }
    assert all(signature is not None and signature != base for signature in differs.values()), differs
    assert len(set(differs.values())) == len(differs)
    with torch.no_grad():
        assert call_signature(block, (x,), {}) is None
    # Integer tensors (packed documents' boundaries, a mask) steer kernels from the host: not graph inputs.
    assert call_signature(block, (x,), {"cu_seqlens": torch.tensor([0, 5])}) is None
    block.eval()
    assert call_signature(block, (x,), {}) is None


def test_which_forwards_replay(monkeypatch, caplog):
    """The replay rule: the first training forward captures, later ones replay; a forward before the last replayed one's backward, or
    while a parameter holds a gradient (a step's later micro-batch, whose replay would overwrite the gradients in
    the graphs' pool), runs eagerly with one log line; so do another shape and a forward without grad, silently."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    blocks = [Block() for _ in range(2)]
    owner = BlockGraphs(blocks)

    def serves(hidden):  # as a forward's first block call asks it
        return owner.serves(call_signature(blocks[0], (hidden,), {}))

    x = torch.randn(2, 5, 6, requires_grad=True)
    assert not serves(x) and owner.capturing  # the first training forward runs eagerly and captures
    owner.capturing = False  # the forward captured its blocks:
    graph = object.__new__(_BlockGraph)  # a graph without its CUDA graphs
    graph.params = tuple(blocks[0].parameters())
    graph.signature = call_signature(blocks[0], (x,), {})
    owner.graphs = [graph]
    with caplog.at_level("INFO"):
        owner.backward_pending = True  # a replayed forward whose backward has not run
        assert not serves(x)
        owner.backward_pending = False
        blocks[0].linear.bias.grad = torch.zeros(6)  # the step's first micro-batch's gradient
        assert not serves(x)
        with torch.no_grad():
            assert not serves(x)
        blocks[0].linear.bias.grad = None  # the optimizer's zero_grad
        assert serves(x) and not owner.capturing
        assert not serves(torch.randn(2, 7, 6, requires_grad=True))
    assert len([r for r in caplog.records if "runs its blocks eagerly" in r.message]) == 1


class LayerBlock(nn.Module):
    """A block that takes a per-layer tensor (as HGRN's lower_bound) and, optionally, packed documents'
    boundaries."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, hidden, lower=None, cu_seqlens=None):
        return hidden + torch.tanh(self.linear(hidden)) * lower


# What torch raises for a kernel that waits on the host while its stream is captured (mom's router, H200): the reason
# is the first line, CUDA's advice the last.
CAPTURE_ERROR = (
    "CUDA error: operation not permitted when stream is capturing\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def stand_in_graphs(monkeypatch, owner, fail_at=None):
    """Capture and replay stood in for (CUDA graphs need a GPU): each forward capture (F<block>:<how many of its
    input tensors an earlier block returned>), replay (R<block>) and backward capture (B<blocks>) is recorded; the
    graph's outputs are the block's own outputs on the capture's inputs, and a replay runs the block's own forward
    on the tensors it is given."""
    events = []

    def capture_forward(index, args, kwargs, signature):
        if index == fail_at:
            raise RuntimeError(CAPTURE_ERROR)
        tensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if torch.is_tensor(leaf)]
        events.append(f"F{index}:{sum(cuda_graphs.output_key(t) in owner.written for t in tensors)}")
        graph = object.__new__(_BlockGraph)
        graph.index, graph.signature, graph.inputs = index, signature, tuple(tensors)
        graph.params = tuple(owner.blocks[index].parameters())
        graph.outputs = (owner.eager_forwards[index](*args, **kwargs).detach(),)
        graph.unflatten = lambda outputs: outputs[0]
        return graph

    def capture_backward():
        events.append("B" + "".join(str(graph.index) for graph in reversed(owner.graphs)))

    def replay(_, graph, hidden, lower, *params):
        events.append(f"R{graph.index}")
        return (owner.eager_forwards[graph.index](hidden, lower=lower),)

    monkeypatch.setattr(owner, "_capture_forward", capture_forward)
    monkeypatch.setattr(owner, "_capture_backward", capture_backward)
    monkeypatch.setattr(cuda_graphs._Replay, "apply", staticmethod(replay))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return events


def run_stack(blocks, x, lowers, packed_from=None):
    h = x
    for index, (block, lower) in enumerate(zip(blocks, lowers, strict=True)):
        packed = packed_from is not None and index >= packed_from
        h = block(h, lower=lower, cu_seqlens=torch.tensor([0, 5]) if packed else None)
    return h


def test_blocks_are_captured_one_by_one_beside_their_first_training_call(monkeypatch, caplog):
    """The first training forward captures each block at its call, with the tensors it is given (a per-layer
    tensor; the hidden states read from the previous block's graph), and replays it at once, and captures the
    backward graphs after the last block; a later forward replays the captured blocks up to the first call they
    cannot serve, which runs eagerly with every block after it; a capture stopped by such a call keeps the blocks
    before it."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    torch.manual_seed(0)
    plain = [LayerBlock() for _ in range(3)]
    x = torch.randn(2, 5, 6, requires_grad=True)
    lowers = [torch.rand(6, requires_grad=True) for _ in range(3)]
    want = run_stack(plain, x, lowers)

    blocks = [LayerBlock() for _ in range(3)]
    for block, source in zip(blocks, plain, strict=True):
        block.load_state_dict(source.state_dict())
    owner = BlockGraphs(blocks)
    events = stand_in_graphs(monkeypatch, owner)
    with caplog.at_level("INFO"):
        got = run_stack(blocks, x, lowers)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert events == ["F0:0", "R0", "F1:1", "R1", "F2:1", "R2", "B210"]
    assert [r.message for r in caplog.records if "Captured" in r.message] == [
        "Captured 3 of 3 blocks as CUDA graphs for hidden states of shape (2, 5, 6); they replay from the next "
        "training forward"
    ]
    assert owner.written == {} and not owner.capturing and owner.backward_pending
    owner.backward_pending = False  # the capturing forward's backward
    events.clear()
    torch.testing.assert_close(run_stack(blocks, x, lowers), want, rtol=0, atol=0)
    assert events == ["R0", "R1", "R2"] and owner.backward_pending
    owner.backward_pending = False  # the replayed forward's backward
    events.clear()
    torch.testing.assert_close(run_stack(blocks, x, lowers, packed_from=1), want, rtol=0, atol=0)
    assert events == ["R0"]  # block 1's packed call runs eagerly, and block 2 after it

    stopped = BlockGraphs([LayerBlock() for _ in range(3)])
    events = stand_in_graphs(monkeypatch, stopped)
    run_stack(stopped.blocks, x, lowers, packed_from=1)
    assert events == ["F0:0", "R0", "B0"] and not stopped.capturing
    stopped.backward_pending = False
    events.clear()
    run_stack(stopped.blocks, x, lowers)
    assert events == ["R0"]  # the captured prefix replays; the rest runs eagerly

    open_ended = BlockGraphs([LayerBlock() for _ in range(3)])
    events = stand_in_graphs(monkeypatch, open_ended)
    run_stack(open_ended.blocks[:2], x, lowers[:2])  # a forward that stops before the stack's last block
    assert events == ["F0:0", "R0", "F1:1", "R1"] and open_ended.capturing
    open_ended.backward_pending = False
    run_stack(open_ended.blocks, x, lowers)  # the next forward finishes that capture first
    assert events == ["F0:0", "R0", "F1:1", "R1", "B10", "R0", "R1"]


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_failed_capture_leaves_later_forwards_eager(monkeypatch, caplog, fail_at):
    """A failed capture drops every graph, with one log line, and every later forward runs eagerly; the blocks the
    capturing forward replayed before it keep their outputs (their gradients come from recomputation)."""
    torch.manual_seed(0)
    owner = BlockGraphs([LayerBlock() for _ in range(3)])
    x = torch.randn(2, 5, 6, requires_grad=True)
    lowers = [torch.rand(6) for _ in range(3)]
    want = run_stack(owner.blocks, x, lowers)  # on the CPU: the blocks' own forward
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    events = stand_in_graphs(monkeypatch, owner, fail_at=fail_at)
    with caplog.at_level("INFO"):
        torch.testing.assert_close(run_stack(owner.blocks, x, lowers), want, rtol=0, atol=0)
    assert events == ["F0:0", "R0"][: 2 * fail_at] and owner.graphs == [] and owner.failed
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == [
        f"The blocks run eagerly: capturing block {fail_at} as a CUDA graph failed (RuntimeError: CUDA error: "
        "operation not permitted when stream is capturing)"
    ]
    owner.backward_pending = False
    events.clear()
    torch.testing.assert_close(run_stack(owner.blocks, x, lowers), want, rtol=0, atol=0)
    assert events == []


def test_a_capture_that_raises_puts_torchs_cuda_state_back(monkeypatch):
    """A capture that raises ends with flame.compat.end_failed_capture on the graphs' pool before the error goes on;
    one that does not leaves the state alone."""
    ended = []
    monkeypatch.setattr(cuda_graphs, "end_failed_capture", ended.append)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool, capture_error_mode: contextlib.nullcontext())
    owner = BlockGraphs([LayerBlock()])
    owner.pool = (0, 7)
    with owner.capturing_into(object()):
        pass
    assert ended == []
    with pytest.raises(RuntimeError, match="refused"), owner.capturing_into(object()):
        raise RuntimeError("refused")
    assert ended == [(0, 7)]


def capture_error(inner: str) -> RuntimeError:
    """The error torch raises where a call inside a capture failed: the capture's end reports the invalidated capture
    while handling the first error."""
    try:
        try:
            raise RuntimeError(f"CUDA error: {inner}")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as error:
        return error


@pytest.mark.parametrize(
    "inner, hint",
    [("operation not permitted when stream is capturing", False),
     ("operation would make the legacy stream depend on a capturing blocking stream", True)],
)  # fmt: skip
def test_a_failed_capture_logs_the_error_raised_inside_it(monkeypatch, caplog, inner, hint):
    """The log line names the call the capture refused, not the capture's end; where an autograd graph from before
    the capture kept a parameter's gradient accumulator on the legacy stream, it says to drop that graph."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    owner = BlockGraphs([LayerBlock()])
    with caplog.at_level("WARNING"):
        owner.fail("capturing the blocks' backward as CUDA graphs", capture_error(inner))
    (line,) = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert line.startswith(
        f"The blocks run eagerly: capturing the blocks' backward as CUDA graphs failed (RuntimeError: CUDA error: "
        f"{inner})"
    )
    assert line.endswith("drop it before the first training forward") is hint
    assert cuda_graphs.capture_failure(RuntimeError("out of memory")).args == ("out of memory",)


def test_recomputed_gradients_are_the_blocks_own():
    """Where capturing the backward failed, the capturing forward's backward differentiates the block's forward run
    again on its graph's input buffers: the gradients of its inputs and parameters, in that order, as autograd gives
    them for the block's own call (None for an input that takes none)."""
    torch.manual_seed(0)
    block = LayerBlock()
    hidden = torch.randn(2, 5, 6, requires_grad=True)
    lower = torch.rand(6)  # takes no gradient
    grad = torch.randn(2, 5, 6)
    out = block(hidden, lower=lower)
    want = torch.autograd.grad(out, (hidden, *block.parameters()), grad)
    leaves, spec = tree_flatten(((hidden,), {"lower": lower}))
    graph = object.__new__(_BlockGraph)
    graph.inputs = (hidden.detach().requires_grad_(), lower)  # as a capture keeps them
    graph.params = tuple(block.parameters())
    graph.signature = (spec, (), (False, torch.bfloat16))
    graph.call = cuda_graphs._Call(block.forward, leaves, spec)
    got = graph.recompute_gradients((grad,))
    assert got[1] is None and len(got) == 4
    for g, w in zip((got[0], *got[2:]), want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


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
    (owner,) = owners
    assert owner.blocks == blocks
    assert list(model.state_dict()) == names
    lines = [r.message for r in caplog.records if "leaves the blocks eager" in r.message]
    assert len(lines) == 1 and "replay as CUDA graphs of the compiled blocks" in lines[0], lines
    assert "model_type 'gla'" in lines[0]
    # The graphs capture the blocks compiled; the calls they do not serve run the blocks' own forwards.
    assert all(
        captured is not eager and captured._torchdynamo_orig_callable == eager
        for captured, eager in zip(owner.captured_forwards, owner.eager_forwards, strict=True)
    )


def test_fla_classes_blocks_can_be_graphed_uncompiled():
    from flame.models import build_model, model_args_from_dict

    args, _ = model_args_from_dict(
        {"model_type": "gla", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2}
    )
    with torch.device("meta"):
        model = build_model(args)
    compile_module.compile_blocks(
        model, backend="eager", graph_eager_blocks=True, compile_graphed_blocks=False
    )
    (owner,) = {block.forward.func.__self__ for block in model.model.layers}
    assert owner.captured_forwards is owner.eager_forwards


def test_integer_tensors_are_graph_inputs_where_the_caller_says_they_are_read_on_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    block = Block()
    x = torch.randn(2, 5, 6, requires_grad=True)
    positions = torch.arange(5).expand(2, -1)
    assert call_signature(block, (x, positions), {}) is None
    served = call_signature(block, (x, positions), {}, integers_on_gpu=True)
    assert served is not None
    assert call_signature(block, (x, torch.arange(5).expand(2, -1)), {}, integers_on_gpu=True) == served
    assert call_signature(block, (x, torch.arange(7).expand(2, -1)), {}, integers_on_gpu=True) != served


def test_flames_decoder_blocks_are_served_without_packed_documents():
    from flame.models.common.spec import decoder_block_graph_call

    h, positions = torch.randn(1, 4, 6), torch.arange(4)[None]
    assert decoder_block_graph_call((h, positions, None), {})
    assert decoder_block_graph_call((h, positions), {})
    assert not decoder_block_graph_call((h, positions, torch.tensor([0, 2, 4])), {})
    assert not decoder_block_graph_call((h,), {"cu_seqlens": torch.tensor([0, 4])})


@pytest.mark.parametrize(
    "flags, world_size, on_gpu, graphs",
    [
        ([], 1, True, True),
        ([], 1, False, False),
        ([], 2, True, False),
        (["--compile.mode", "reduce-overhead"], 1, True, False),
        (["--compile.mode", "max-autotune-no-cudagraphs"], 1, True, True),
        (["--training.varlen"], 1, True, False),
        (["--activation_checkpoint.mode", "selective"], 1, True, False),
        (["--activation_offload.mode", "full"], 1, True, False),
    ],
)
def test_runs_whose_compiled_blocks_replay_as_graphs(flags, world_size, on_gpu, graphs):
    job_config = parse_args(["--compile.enable", *flags])
    assert compile_module.graphs_compiled_blocks(job_config, world_size, on_gpu) is graphs
    off = parse_args(["--compile.enable", "--compile.no-graph_compiled_blocks", *flags])
    assert not compile_module.graphs_compiled_blocks(off, world_size, on_gpu)


TINY_GDN = {"model_type": "gated_deltanet", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_heads": 2, "head_dim": 16, "expand_v": 1}  # fmt: skip


def test_flames_compiled_blocks_are_wrapped_for_graphs_and_unserved_calls_run_them_compiled(caplog):
    """On the CPU no call is served: each runs the compiled block (a counting backend sees it compiled once per
    block code and guard set), with the unwrapped model's outputs, gradients and parameter names."""
    from flame.models import build_model, model_args_from_dict, model_spec

    compiled_graphs = []

    def counting_backend(graph, inputs):
        compiled_graphs.append(graph)
        return graph.forward

    args, _ = model_args_from_dict(TINY_GDN)
    torch.manual_seed(0)
    plain = build_model(args)
    plain.init_weights()
    wrapped = build_model(args)
    wrapped.load_state_dict(plain.state_dict())
    names = list(wrapped.state_dict())
    with caplog.at_level("INFO"):
        compile_module.compile_blocks(wrapped, backend=counting_backend, graph_compiled_blocks=True)
    (owner,) = {block.forward.func.__self__ for block in model_spec(args).blocks(wrapped)[0].children()}
    assert owner.compiled_unserved and owner.own_forward(0) is owner.captured_forwards[0]
    assert list(wrapped.state_dict()) == names
    assert any("compiled blocks replay as CUDA graphs" in r.message for r in caplog.records)
    tokens = torch.randint(0, 64, (2, 9))
    results = []
    for model in (plain, wrapped):
        logits = model(tokens)
        logits.square().mean().backward()
        results.append((logits, [p.grad for p in model.parameters()]))
    assert compiled_graphs, "the unserved calls did not run the compiled blocks"
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert owner.graphs == []


def test_the_generic_familys_compiled_blocks_are_not_graphed():
    from flame.models import build_model, model_args_from_dict, model_spec

    args, _ = model_args_from_dict(
        {
            "model_type": "llama",
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        }  # fmt: skip
    )
    assert model_spec(args).block_graph_call is None
    with torch.device("meta"):
        model = build_model(args)
    compile_module.compile_blocks(model, backend="eager", graph_compiled_blocks=True)
    for stack in model_spec(args).blocks(model):
        assert all(isinstance(block, torch._dynamo.eval_frame.OptimizedModule) for block in stack.children())


@pytest.mark.parametrize("compiled_unserved", [False, True])
def test_a_block_that_fails_compiled_is_captured_uncompiled_unless_the_compiled_blocks_serve_the_rest(
    monkeypatch, compiled_unserved
):
    """FLA's classes' graphs fall back to capturing the eager block; flame's, whose unserved calls run the compiled
    blocks, let the failure stand (the capture fails with its log line, and the compiled calls meet the error)."""
    from flame.parallelize.cuda_graphs import _Call

    owner = BlockGraphs([Block()], {"backend": "eager"}, compiled_unserved=compiled_unserved)

    def warm_up_all(run, inputs, params):
        if run.forward is not owner.eager_forwards[0]:
            raise RuntimeError("the compiled block failed")

    monkeypatch.setattr(owner, "_warm_up_all", warm_up_all)
    x = torch.randn(2, 5, 6)
    call = _Call(owner.captured_forwards[0], *tree_flatten(((x,), {})))
    if compiled_unserved:
        with pytest.raises(RuntimeError, match="the compiled block failed"):
            owner._warmed_up(0, call, [x], ())
        assert owner.captured_forwards is not owner.eager_forwards
    else:
        assert owner._warmed_up(0, call, [x], ()).forward is owner.eager_forwards[0]
        assert owner.captured_forwards is owner.eager_forwards
