"""Run as a script by test_compile.py (its registrations stay in that process): the graph breaks dynamo finds in a
tiny flame model's forward on the CUDA branches of flame's op dispatch, without a GPU.

The input is a CPU tensor that claims is_cuda (tensor subclasses propagate through torch's ops), so each op's
dispatcher takes the path a GPU run takes: FlashQLA (installed here: serving K = V = 128 heads and refusing the
calls whose shapes it does not take), FLA's ops and flame's kernels, which under torch.compile are torch.library custom ops; on the CPU those run
their fake (shape-only) implementations. ``torch._dynamo.explain`` traces the forward: a graph break on that path
(a refusal logged from the compiled region would split every Gated DeltaNet block into five graphs on the GPU)
shows as a count above zero. Prints ``<model> <graph breaks>`` per model, then each break's reason.
"""

import json
import sys
import unittest.mock
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128}
MODELS = {
    "transformer": ("transformer_340M.json", {"num_heads": 4}),
    "softpick_transformer": ("softpick_transformer_340M.json", {"num_heads": 4}),
    "gated_deltanet": ("gated_deltanet_340M.json", {"num_heads": 2, "head_dim": 32}),
    # K = V = 128: FlashQLA serves these heads
    "gated_deltanet_k128": ("gated_deltanet_340M.json", {"num_heads": 2, "head_dim": 128, "expand_v": 1}),
    "hybrid": ("gated_deltanet_340M.json", {"num_heads": 2, "head_dim": 32,
                                            "attn": {"layers": [1], "num_heads": 4, "qk_norm": True}}),
    "delta_net": ("delta_net_340M.json", {"num_heads": 4}),
}  # fmt: skip
# FLA's classes whose blocks flame compiles (FLA_MODEL_TYPES_TRACED_WHOLE): their whole config.
FLA_MODELS = {
    "mamba": {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256},
    "mamba2": {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "head_dim": 32,
               "state_size": 16, "n_groups": 2},
    "mamba3": {"model_type": "mamba3", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "head_dim": 32,
               "state_size": 16, "n_groups": 2},
    "mamba3_mimo": {"model_type": "mamba3", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
                    "head_dim": 32, "state_size": 16, "n_groups": 2, "is_mimo": True, "mimo_rank": 2},
    "samba": {"model_type": "samba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
              "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 2048}},
    "moba": {"model_type": "moba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "num_heads": 4,
             "moba_chunk_size": 16, "moba_topk": 3},
}  # fmt: skip


class PretendCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda=True."""

    @property
    def is_cuda(self):
        return True


def take_the_cuda_paths() -> None:
    from flame.ops import dispatch, fla_library
    from flame.ops.attention import softpick_triton
    from flame.ops.gated_delta_rule import flash_qla
    from flame.ops.selective_scan import triton_kernel as scan
    from flame.ops.short_conv import triton_kernel

    for op in (fla_library.gated_delta_rule_fwd, fla_library.gated_delta_rule_bwd, fla_library.delta_rule_fwd,
               fla_library.delta_rule_bwd, triton_kernel.short_conv_fwd, triton_kernel.short_conv_bwd,
               softpick_triton.softpick_attention_fwd, softpick_triton.softpick_attention_bwd,
               flash_qla.gated_delta_rule_fwd, flash_qla.gated_delta_rule_bwd, scan.selective_scan_fwd,
               scan.selective_scan_bwd, fla_library.simple_gla_fwd, fla_library.simple_gla_bwd):  # fmt: skip
        op.register_kernel("cpu")(op._abstract_fn)
    for entry in dispatch._TABLE.values():
        entry.missing = {}  # every backend installed, FlashQLA included
    flash_qla.device_capability = lambda device: (9, 0)
    flash_qla.nvcc_found = lambda: True


# A name ending in PACKED: that model given one row of documents (cu_seqlens), as --training.varlen runs it.
PACKED = "_packed"
DOCUMENTS = [0, 30, 31, 80]


def graph_breaks(name: str) -> list[str]:
    from flame.models import build_model, model_args_from_dict

    packed = name.endswith(PACKED)
    name = name.removesuffix(PACKED)
    if name in FLA_MODELS:
        config = FLA_MODELS[name]
    else:
        path, overrides = MODELS[name]
        config = {**json.loads((REPO / "configs" / path).read_text()), **TINY, **overrides}
    args, _ = model_args_from_dict(config)
    torch.manual_seed(0)
    model = build_model(args).to(torch.bfloat16)
    tokens = torch.randint(0, TINY["vocab_size"], (1 if packed else 2, DOCUMENTS[-1])).as_subclass(
        PretendCuda
    )
    documents = {}
    if packed:
        documents["cu_seqlens"] = torch.tensor(DOCUMENTS, dtype=torch.int32).as_subclass(PretendCuda)
    if name in FLA_MODELS:
        # Traced as every compiled step after the first runs: FLA's modules holding what their first call caches
        # (the rotary tables). That call eager, with FLA's functions as flame's PyTorch code (no Triton here).
        with unittest.mock.patch.object(torch.compiler, "is_compiling", lambda: True), torch.no_grad():
            model(tokens, **documents)
    explained = torch._dynamo.explain(model)(tokens, **documents)
    return [str(reason.reason).splitlines()[0] for reason in explained.break_reasons]


if __name__ == "__main__":
    take_the_cuda_paths()
    for name in sys.argv[1:]:
        reasons = graph_breaks(name)
        print(name, len(reasons))
        for reason in reasons:
            print("  ", reason)
