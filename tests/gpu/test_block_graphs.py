"""FLA classes' blocks replayed as CUDA graphs (flame/parallelize/cuda_graphs.py) against the same blocks run
eagerly, on random inputs of odd sizes under bf16 autocast: losses and every gradient agree to 1e-5 relative
(the graphs replay the eager blocks' kernels on the same inputs; the tolerance leaves room for kernels whose
atomics add in another order), through two micro-batches accumulated into one gradient (the second runs eagerly:
a replay would overwrite the first one's gradients, which live in the graphs' pool), a second forward begun before
the first one's backward (the DPO objective's order), a call of another shape, the trainer's step, and blocks
whose capture fails after the capturing forward has replayed the blocks before them. A graphed run reserves about
the memory of an eager one."""

import copy
import json

import pytest
import torch

from flame.loss import IGNORE_INDEX
from flame.models import build_model, model_args_from_dict, model_spec
from flame.parallelize.compile import compile_blocks
from flame.parallelize.cuda_graphs import BlockGraphs
from flame.train.kernels import prepare_gpu_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = {"model_type": "gla", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 3, "num_heads": 2}
RTOL = 1e-5


def twins(config):
    """The model of ``config`` on the GPU, initialised, and a copy of it; and its args."""
    prepare_gpu_kernels(torch.device("cuda"))
    args, _ = model_args_from_dict(config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(args)
    model.init_weights()
    return model, copy.deepcopy(model), args


def models(config=CONFIG, compile=None):
    """The model twice, the second one's blocks graphed (captured compiled with torch.compile's options
    ``compile`` where given, and then the first one's blocks compiled the same way)."""
    eager, graphed, args = twins(config)
    (stack,) = model_spec(args).blocks(graphed)
    owner = BlockGraphs(list(stack.children()), compile)
    if compile is not None:
        (stack,) = model_spec(args).blocks(eager)
        for name, block in stack.named_children():
            stack.register_module(name, torch.compile(block, **compile))
    return eager, graphed, owner


def batches(lengths):
    generator = torch.Generator(device="cuda").manual_seed(1)
    return [
        torch.randint(0, CONFIG["vocab_size"], (2, length), device="cuda", generator=generator)
        for length in lengths
    ]


def loss_of(model, tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())


def assert_same_gradients(eager, graphed):
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=RTOL * p.grad.abs().max().item(), msg=name)


def test_accumulated_micro_batches_and_an_interleaved_forward_give_the_eager_gradients():
    eager, graphed, owner = models()
    for step, order in enumerate(("sequential", "interleaved", "sequential")):
        micro = batches([509, 509])
        for model in (eager, graphed):
            model.zero_grad()
            if order == "sequential":  # forward, backward, forward, backward (gradient accumulation)
                losses = []
                for tokens in micro:
                    loss = loss_of(model, tokens)
                    loss.backward()
                    losses.append(loss.detach())
            else:  # both forwards, then one backward: the second forward must not overwrite the first's graph memory
                losses = [loss_of(model, tokens) for tokens in micro]
                sum(losses).backward()
            model.losses = torch.stack([loss.detach() for loss in losses])
        assert owner.graphs, "the graphs were not captured"
        torch.testing.assert_close(graphed.losses, eager.losses, rtol=RTOL, atol=0, msg=f"step {step}")
        assert_same_gradients(eager, graphed)
        with torch.no_grad():  # the same update for both
            for p, q in zip(eager.parameters(), graphed.parameters(), strict=True):
                p.sub_(1e-2 * p.grad.sign())
                q.sub_(1e-2 * q.grad.sign())


def test_another_shape_runs_eagerly_and_the_captured_shape_still_replays():
    eager, graphed, owner = models()
    for length in (257, 131, 257):
        (tokens,) = batches([length])
        for model in (eager, graphed):
            model.zero_grad()
            model.loss = loss_of(model, tokens)
            model.loss.backward()
        torch.testing.assert_close(graphed.loss, eager.loss, rtol=RTOL, atol=0, msg=f"length {length}")
        assert_same_gradients(eager, graphed)
    assert owner.graphs[0].inputs[0].shape[1] == 257


@pytest.mark.parametrize(
    "config",
    [
        # HGRN's blocks each take a slice of the model's lower_bounds parameter, whose gradient flows back through it.
        {"model_type": "hgrn", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 3},
        # RWKV7's first block returns v_first, which every later block reads (and returns as it is).
        {
            "model_type": "rwkv7",
            "vocab_size": 4096,
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "head_dim": 64,
        },
        # ABC's chunk kernels: its capture failed to compile while the backward ran under the forward's autocast.
        {"model_type": "abc", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 3, "num_heads": 2},
    ],
    ids=lambda config: config["model_type"],
)
def test_blocks_given_per_layer_tensors_replay_with_the_eager_gradients(config):
    assert_every_block_replays_with_the_eager_gradients(config)


@pytest.mark.parametrize(
    "config",
    [
        # flame's attention layer in FLA's classes (flash-attn absent): a capture refuses any host-to-device copy,
        # such as positions made from a Python int. samba: a window longer than the rows (SDPA serves it) and one
        # that bites (FLA's windowed kernel).
        {
            "model_type": "bitnet",
            "vocab_size": 4096,
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_heads": 2,
        },
        *(
            {
                "model_type": "samba",
                "vocab_size": 4096,
                "hidden_size": 128,
                "num_hidden_layers": 2,
                "attn": {"layers": [1], "num_heads": 2, "num_kv_heads": 2, "window_size": window},
            }
            for window in (2048, 64)
        ),
    ],
    ids=["bitnet", "samba_window_2048", "samba_window_64"],
)
def test_attention_blocks_replay_with_the_eager_gradients(config):
    assert_every_block_replays_with_the_eager_gradients(config)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        {"model_type": "hgrn", "vocab_size": 4096, "hidden_size": 96, "num_hidden_layers": 3},
    ],
    ids=["gla", "hgrn"],
)
def test_compiled_blocks_replay_with_the_compiled_blocks_gradients(config):
    """Captured compiled, the graphs replay inductor's kernels: the same as the blocks compiled without graphs."""
    eager, graphed, owner = models(config, compile={})
    assert_every_block_replays_with_the_eager_gradients(config, (eager, graphed, owner))
    assert all(forward is not eager for forward, eager in zip(owner.captured_forwards, owner.eager_forwards))


def refusing_backend(graph, inputs):
    raise RuntimeError("this backend compiles nothing")


def test_blocks_that_fail_to_compile_are_captured_uncompiled_with_one_line(caplog):
    eager, graphed, owner = models(compile={"backend": refusing_backend})
    (stack,) = model_spec(model_args_from_dict(CONFIG)[0]).blocks(eager)
    for name, block in stack.named_children():  # the reference runs eagerly: its backend would refuse too
        stack.register_module(name, block._orig_mod)
    with caplog.at_level("WARNING"):
        assert_every_block_replays_with_the_eager_gradients(CONFIG, (eager, graphed, owner))
    assert owner.captured_forwards is owner.eager_forwards and not owner.failed
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "captured uncompiled: compiled, block 0 failed" in warnings[0], warnings


def assert_every_block_replays_with_the_eager_gradients(config, built=None):
    eager, graphed, owner = built or models(config)
    for step in range(3):
        (tokens,) = batches([331])
        for model in (eager, graphed):
            model.zero_grad()
            model.loss = loss_of(model, tokens)
            model.loss.backward()
        assert len(owner.graphs) == config["num_hidden_layers"], "not every block was captured"
        torch.testing.assert_close(graphed.loss, eager.loss, rtol=RTOL, atol=0, msg=f"step {step}")
        assert_same_gradients(eager, graphed)
        with torch.no_grad():
            for p, q in zip(eager.parameters(), graphed.parameters(), strict=True):
                p.sub_(1e-2 * p.grad.sign())
                q.sub_(1e-2 * q.grad.sign())


def trainer_curve(make_trainer, config: dict, tmp_path, *flags) -> tuple[list[tuple[float, float]], bool]:
    """Four trainer steps of two micro-batches each of ``config``'s model compiled, with ``flags``: each step's
    loss and gradient norm, and whether the blocks' graphs were captured."""
    path = tmp_path / f"{config['model_type']}.json"
    path.write_text(json.dumps(config))
    trainer = make_trainer(
        "--model.config", str(path), "--compile.enable", "--training.gradient_accumulation_steps", "2", *flags
    )
    blocks = model_spec(trainer.model_args).blocks(trainer.model_parts[0])[0]
    generator = torch.Generator("cuda").manual_seed(3)
    micro = []
    for _ in range(2):
        tokens = torch.randint(0, config["vocab_size"], (2, 65), device="cuda", generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, :20] = IGNORE_INDEX
        micro.append(({"input": tokens[:, :-1]}, labels))
    values = []
    for step in range(1, 5):
        trainer.step = step
        result = trainer.train_step_fn(micro)
        values.append((trainer.train_step_fn.global_metrics(result)["loss"], float(result.grad_norm)))
    owner = getattr(next(iter(blocks.children())).forward, "func", None)
    return values, bool(owner and owner.__self__.graphs)


def assert_same_curves(reference: list[tuple[float, float]], graphs: list[tuple[float, float]]) -> None:
    assert reference[-1][0] < reference[0][0], reference  # it trains
    for (loss, norm), (graph_loss, graph_norm) in zip(reference, graphs, strict=True):
        assert abs(graph_loss - loss) <= RTOL * abs(loss) and abs(graph_norm - norm) <= RTOL * norm, (
            reference,
            graphs,
        )


def test_the_trainer_step_with_graphed_blocks_trains_as_with_eager_blocks(make_trainer, tmp_path):
    eager, eager_graphed = trainer_curve(make_trainer, CONFIG, tmp_path, "--compile.no-graph_eager_blocks")
    graphs, graphed = trainer_curve(make_trainer, CONFIG, tmp_path)
    assert (eager_graphed, graphed) == (False, True)
    assert_same_curves(eager, graphs)


class _AutocastProbe(torch.autograd.Function):
    """Identity that records whether autocast is on where its backward runs."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _AutocastProbe.seen.append(torch.is_autocast_enabled("cuda"))
        return grad


class _ProbedBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(_AutocastProbe.apply(x)).to(x.dtype)


def test_the_captured_backward_runs_without_autocast_as_the_steps_backward_does():
    """The step calls backward outside its autocast region: the warm-up and the captured backward do too, so the
    graphs hold the kernels (and dtypes) of the step's own backward."""
    torch.manual_seed(0)
    blocks = [_ProbedBlock(48).cuda() for _ in range(2)]
    BlockGraphs(blocks)
    x = torch.randn(3, 17, 48, device="cuda", requires_grad=True)
    _AutocastProbe.seen.clear()
    for _ in range(3):  # capture, then replays
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = x
            for block in blocks:
                hidden = block(hidden)
        hidden.float().square().mean().backward()
    assert _AutocastProbe.seen and not any(_AutocastProbe.seen), _AutocastProbe.seen


class _HostCall(torch.autograd.Function):
    """Identity whose forward or backward makes a call a CUDA graph capture refuses: "sync" reads a value back to the
    host (mom's router does in its forward on an H200), "query" asks whether the stream is idle (which does not wait,
    so torch's sync debug mode lets it through, and the capture itself fails)."""

    @staticmethod
    def forward(ctx, x, call):
        ctx.call = call
        if call.startswith("forward"):
            _HostCall.make(call, x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.call.startswith("backward"):
            _HostCall.make(ctx.call, grad)
        return grad, None

    @staticmethod
    def make(call: str, x: torch.Tensor) -> None:
        if call.endswith("sync"):
            x.sum().item()
        else:
            torch.cuda.current_stream().query()


class _LinearBlock(torch.nn.Module):
    def __init__(self, width: int, host_call: str | None = None):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.host_call = host_call

    def forward(self, x):
        if self.host_call:
            x = _HostCall.apply(x, self.host_call)
        return x + torch.tanh(self.linear(x)).to(x.dtype)


def run_linear_blocks(blocks, x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = x
        for block in blocks:
            hidden = block(hidden)
    loss = hidden.float().square().mean()
    loss.backward()
    return loss.detach()


def train_beside_eager_blocks(host_call: str, block: int) -> BlockGraphs:
    """Three steps of four blocks, one of which makes ``host_call``, graphed against eager: losses and gradients
    agree at every step (the first is the capturing one)."""
    torch.manual_seed(0)
    eager = [_LinearBlock(40, host_call if i == block else None).cuda() for i in range(4)]
    graphed = copy.deepcopy(eager)
    owner = BlockGraphs(graphed)
    x = torch.randn(3, 29, 40, device="cuda", requires_grad=True)
    pairs = list(
        zip(
            [p for b in eager for p in b.parameters()],
            [q for b in graphed for q in b.parameters()],
            strict=True,
        )
    )
    for step in range(3):
        results = []
        for blocks in (eager, graphed):
            for b in blocks:
                b.zero_grad()
            x.grad = None
            results.append((run_linear_blocks(blocks, x), x.grad))
        (loss, x_grad), (graph_loss, graph_x_grad) = results
        torch.testing.assert_close(graph_loss, loss, rtol=RTOL, atol=0, msg=f"step {step}")
        torch.testing.assert_close(graph_x_grad, x_grad, rtol=RTOL, atol=RTOL * x_grad.abs().max().item())
        for p, q in pairs:
            torch.testing.assert_close(q.grad, p.grad, rtol=RTOL, atol=RTOL * p.grad.abs().max().item())
        with torch.no_grad():
            for p, q in pairs:
                p.sub_(1e-2 * p.grad.sign())
                q.sub_(1e-2 * q.grad.sign())
    return owner


@pytest.mark.parametrize("host_call, block", [("forward sync", 2), ("backward sync", 1)])
def test_a_block_that_reads_the_host_is_found_in_the_warm_up_and_runs_eagerly(host_call, block, caplog):
    """Its warm-up refuses the host read (no capture is begun), the blocks before it that the capturing forward
    replayed get their gradients by recomputation, and every later step runs eagerly; torch's CUDA state is left
    whole (a random draw on the GPU works)."""
    with caplog.at_level("WARNING"):
        owner = train_beside_eager_blocks(host_call, block)
    assert owner.failed and owner.graphs == []
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"capturing block {block} as a CUDA graph failed" in warnings[0], warnings
    torch.randn(4, device="cuda")


@pytest.mark.parametrize("host_call, block", [("forward query", 2), ("backward query", 1)])
def test_a_capture_that_fails_after_replays_trains_as_the_eager_blocks_and_leaves_cuda_whole(
    host_call, block, caplog
):
    """A call that only the capture refuses: the forward capture of a later block, or the backward capture, fails;
    the replayed blocks' gradients come from recomputation, and torch's CUDA state is as before the capture (a random
    draw on the GPU works, and a new capture that draws random numbers replays new ones)."""
    with caplog.at_level("WARNING"):
        owner = train_beside_eager_blocks(host_call, block)
    assert owner.failed and not owner.graphs
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "The blocks run eagerly: capturing" in warnings[0], warnings
    torch.randn(4, device="cuda")
    drawn = torch.empty(1000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drawn.uniform_()
    graph.replay()
    first = drawn.clone()
    graph.replay()
    assert not torch.equal(first, drawn) and drawn.min() >= 0 and drawn.max() <= 1


def reserved_by_steps(model, tokens, steps=3) -> int:
    """How much memory the caching allocator reserves over ``steps`` training steps (the graphs' pool included: its
    memory is reserved, while a replay's tensors are not the allocator's and never count as allocated)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss_of(model, tokens).backward()
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved() - before


def test_the_capturing_step_holds_no_activations_beside_the_graphs():
    """The capturing forward replays each block's graph as it is captured: the memory a graphed run takes is the
    graphs' pool and little more, not the eager activations of its capturing step on top of the pool."""
    assert_graphs_reserve_about_the_reference(
        lambda: models({**CONFIG, "hidden_size": 256, "num_hidden_layers": 6, "num_heads": 4}), "eager"
    )


def assert_graphs_reserve_about_the_reference(build, reference_name: str) -> None:
    """The six-block model that ``build`` makes twice (the reference, the graphed one, the graphs' owner): the graphed
    one reserves at most 1.3x what the reference does over three steps, each measured alone."""
    reference, graphed, owner = build()
    (tokens,) = batches([4096])
    torch.cuda.empty_cache()
    reference_bytes = reserved_by_steps(reference, tokens)
    del reference
    torch.cuda.empty_cache()  # what the reference's steps reserved is free again
    graphed_bytes = reserved_by_steps(graphed, tokens)
    assert len(owner.graphs) == 6
    print(
        f"reserved over 3 steps: graphed {graphed_bytes / 2**20:.0f} MiB, {reference_name} "
        f"{reference_bytes / 2**20:.0f} MiB"
    )
    assert graphed_bytes <= 1.3 * reference_bytes, (graphed_bytes, reference_bytes)


# flame's own families: their compiled blocks replay as CUDA graphs (--compile.graph_compiled_blocks), the positions an
# integer graph input; against the same blocks compiled without graphs.
FLAME_GDN = {"model_type": "gated_deltanet", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 3,
             "num_heads": 2, "head_dim": 64, "expand_v": 2}  # fmt: skip
FLAME_FAMILIES = {
    "gated_deltanet": FLAME_GDN,
    "hybrid": {**FLAME_GDN, "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qk_norm": True}},
    "transformer": {"model_type": "transformer", "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 3,
                    "num_heads": 4, "num_kv_heads": 2},
}  # fmt: skip


def compiled_models(config):
    """The model twice with its blocks compiled, the second one's replayed as CUDA graphs, and their owner."""
    # Each test's compilations on their own: the blocks of every family share a code object, and past dynamo's
    # recompile limit its frames would run eagerly, uncompiled.
    torch._dynamo.reset()
    compiled, graphed, args = twins(config)
    compile_blocks(compiled, "inductor")
    compile_blocks(graphed, "inductor", graph_compiled_blocks=True)
    (stack,) = model_spec(args).blocks(graphed)
    owner = next(iter(stack.children())).forward.func.__self__
    assert owner.compiled_unserved and owner.integers_on_gpu is not None
    return compiled, graphed, owner


@pytest.mark.parametrize("name", FLAME_FAMILIES)
def test_flames_compiled_blocks_replay_with_the_compiled_blocks_gradients(name):
    """Captured compiled, the graphs replay the compiled blocks' kernels (flame's custom ops among them) on the same
    inputs, the positions copied into their own graph input: losses and gradients within 1e-5 over three steps."""
    config = FLAME_FAMILIES[name]
    assert_every_block_replays_with_the_eager_gradients(config, compiled_models(config))


def packed_documents_step(model, tokens, positions, cu_seqlens) -> torch.Tensor:
    """One forward and backward of packed documents; the loss without its autograd graph, which a capture must not
    find alive (the cuda_graphs module's BlockGraphs)."""
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens, position_ids=positions, cu_seqlens=cu_seqlens)
    loss = torch.nn.functional.cross_entropy(logits.float()[0], tokens.roll(-1, 1)[0])
    loss.backward()
    return loss.detach()


def test_flames_packed_documents_and_evaluation_run_the_compiled_blocks():
    """A call with packed documents' boundaries, whose launches the host sizes, and one without grad are not served:
    they run the compiled blocks (no graph is captured for them), and a later plain batch is still captured."""
    compiled, graphed, owner = compiled_models(FLAME_GDN)
    tokens = torch.randint(0, FLAME_GDN["vocab_size"], (1, 331), device="cuda")
    cu_seqlens = torch.tensor([0, 120, 331], dtype=torch.int32, device="cuda")
    positions = torch.cat([torch.arange(120), torch.arange(211)]).to("cuda")[None]
    for step in range(2):
        for model in (compiled, graphed):
            model.loss = packed_documents_step(model, tokens, positions, cu_seqlens)
        torch.testing.assert_close(graphed.loss, compiled.loss, rtol=RTOL, atol=0, msg=f"step {step}")
        assert_same_gradients(compiled, graphed)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(graphed, tokens), loss_of(compiled, tokens), rtol=RTOL, atol=0)
    assert owner.graphs == [] and not owner.failed
    assert_every_block_replays_with_the_eager_gradients(FLAME_GDN, (compiled, graphed, owner))


def test_the_trainer_step_with_flames_graphed_blocks_trains_as_with_compiled_blocks(make_trainer, tmp_path):
    """Through the trainer (two micro-batches a step: the second runs the compiled blocks): the same losses and
    gradient norms as the compiled blocks without graphs."""
    compiled, compiled_graphed = trainer_curve(
        make_trainer, FLAME_GDN, tmp_path, "--compile.no-graph_compiled_blocks"
    )
    graphs, graphed = trainer_curve(make_trainer, FLAME_GDN, tmp_path)
    assert (compiled_graphed, graphed) == (False, True)
    assert_same_curves(compiled, graphs)


def test_flames_graphed_blocks_reserve_about_the_compiled_blocks_memory():
    """The graphs' pool holds the activations the compiled blocks would: a graphed GatedDeltaNet reserves at most 1.3x
    what the compiled one does over three steps (its first the capture)."""
    assert_graphs_reserve_about_the_reference(
        lambda: compiled_models({**FLAME_GDN, "hidden_size": 256, "num_hidden_layers": 6, "num_heads": 4}),
        "compiled",
    )
