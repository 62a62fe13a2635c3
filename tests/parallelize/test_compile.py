"""flame.parallelize.compile on the CPU (dynamo with the eager backend: what is traced and how often)."""

import pytest
import torch
from torch import nn

from flame.parallelize import compile as compile_module


class LayerBranchingBlock(nn.Module):
    """A block whose code branches on its layer's index (FLA's HGRN does on ``layer_idx > 0``)."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return x * 2 if self.layer_idx > 0 else x


def test_every_block_is_compiled_past_dynamos_recompile_limit(monkeypatch):
    """Twelve blocks that each specialise on their index: each is a graph of its own, none left to run eagerly
    (dynamo's default limit, 8, would leave the last four uncompiled)."""
    from torch._dynamo.utils import counters

    model = nn.Module()
    model.layers = nn.ModuleList(LayerBranchingBlock(i) for i in range(12))
    model.args = None
    spec = type(
        "Spec",
        (),
        {"blocks": staticmethod(lambda m: [m.layers]), "eager_reason": staticmethod(lambda args: None)},
    )()
    monkeypatch.setattr(compile_module, "model_spec", lambda args: spec)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    torch._dynamo.reset()
    counters.clear()
    compile_module.compile_blocks(model, backend="eager")
    x = torch.randn(3, 4)
    for block in model.layers:
        x = block(x)
    assert counters["stats"]["unique_graphs"] == 12
    torch._dynamo.reset()


def test_fla_classes_blocks_stay_eager_and_transformers_classes_compile(caplog):
    """The generic family leaves FLA's classes' blocks eager (ModelSpec.eager_blocks: their Triton autograd functions
    split each block into graphs that cost more than they save) with one log line, and compiles a transformers
    class's blocks and those of FLA's classes that trace whole (mamba: FLA_MODEL_TYPES_TRACED_WHOLE)."""
    from flame.models import build_model, model_args_from_dict, model_spec

    shape = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2}
    configs = {
        "gla": {"model_type": "gla", **shape, "num_heads": 2},
        "llama": {"model_type": "llama", **shape, "intermediate_size": 64, "num_attention_heads": 2},
        "mamba": {"model_type": "mamba", **shape},
    }
    compiled = {}
    for name, config in configs.items():
        args, _ = model_args_from_dict(config)
        with torch.device("meta"):
            model = build_model(args)
        with caplog.at_level("INFO"):
            compile_module.compile_blocks(model, backend="eager")
        blocks = [block for stack in model_spec(args).blocks(model) for block in stack]
        compiled[name] = [isinstance(block, torch._dynamo.eval_frame.OptimizedModule) for block in blocks]
    assert compiled == {"gla": [False, False], "llama": [True, True], "mamba": [True, True]}
    eager_lines = [r.message for r in caplog.records if "leaves the blocks eager" in r.message]
    assert len(eager_lines) == 1 and "model_type 'gla' is FLA's class" in eager_lines[0]


def test_graph_breaks_are_reported_once_after_the_first_compiled_step(make_trainer, caplog):
    """The tiny transformer's compiled blocks and loss trace without a break on a CPU (no report after its first
    step); a break the regions had (one added to dynamo's counters here) is named once, after the first step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = make_trainer("--compile.enable", "--compile.backend", "aot_eager")
    vocab = trainer.model_args.vocab_size
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    batches = [({"input": tokens[:, :-1]}, tokens[:, 1:])]
    with caplog.at_level("WARNING"):
        trainer.train_step_fn(batches)
    assert not [r for r in caplog.records if "broke the compiled graphs" in r.message]
    assert compile_module.graph_break_report() is None

    counters["graph_break"]["Attempted to call function marked as skipped\n  Explanation: `side`"] += 2
    second = make_trainer("--compile.enable", "--compile.backend", "aot_eager")
    with caplog.at_level("WARNING"):
        for _ in range(2):
            second.train_step_fn(batches)
    reports = [r.message for r in caplog.records if "broke the compiled graphs" in r.message]
    assert reports == [
        "torch.compile broke the compiled graphs at 2 places, each a return to Python at every call: Attempted to "
        "call function marked as skipped Explanation: `side`"
    ]
    for index in range(4):
        counters["graph_break"][f"reason {index}"] += 1
    assert compile_module.graph_break_report().endswith(
        "at every call: Attempted to call function marked as skipped Explanation: `side`; reason 0; reason 1; "
        "and 2 other reasons"
    )
    counters.clear()
    torch._dynamo.reset()


@pytest.mark.slow
def test_flames_models_trace_whole_on_the_cuda_paths_of_their_ops():
    """Dynamo traces each flame family's forward, and FLA's mamba (also with packed documents), mamba2, mamba3, samba and moba, on the branches a GPU run takes (FLA's ops
    and flame's kernels as custom ops, FlashQLA installed, serving K = V = 128 heads and refusing the others; FLA's
    norms and activations as flame's PyTorch code) without a graph break:
    cuda_path_graphs.py, in a process of its own (it registers CPU implementations of the custom ops)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("cuda_path_graphs.py")
    models = [
        "transformer",
        "softpick_transformer",
        "gated_deltanet",
        "gated_deltanet_k128",
        "hybrid",
        "delta_net",
        "mamba",
        "mamba_packed",
        "mamba2",
        "mamba3",
        "mamba3_mimo",
        "samba",
        "moba",
    ]
    result = subprocess.run(
        [sys.executable, str(script), *models], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counts = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert counts == [f"{model} 0" for model in models], result.stdout
