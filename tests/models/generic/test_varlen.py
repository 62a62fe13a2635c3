"""--training.varlen on the generic family: transformers' attention-only decoders (position ids) and FLA's listed
classes (cu_seqlens) keep packed documents apart (each document's logits equal those of the document run alone);
the others are refused before launch."""

from pathlib import Path

import pytest
import torch

from flame.config import parse_args
from flame.errors import ConfigError
from flame.models import build_model, model_args_from_dict, model_spec
from flame.models.generic.args import PACKED_DOCUMENT_MODEL_TYPES
from flame.parallelize.checks import check_family_support

SHAPE = {"vocab_size": 97, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
         "num_attention_heads": 3, "num_key_value_heads": 1}  # fmt: skip
# Head widths where the class's default is not hidden_size / heads, and sliding windows shorter than a document, so
# that the window and the document boundary both cut.
OVERRIDES = {
    "gemma3_text": {
        "head_dim": 8,
        "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "qwen3": {"head_dim": 8},
    "phi3": {"pad_token_id": 0},  # its default, 32000, is past this vocabulary
    "olmo3": {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
    "mistral": {"sliding_window": 3},
}
LENGTHS = [5, 1, 7]  # three documents in one row of 13 tokens


def model_of(model_type: str) -> torch.nn.Module:
    args, unknown = model_args_from_dict({"model_type": model_type, **SHAPE, **OVERRIDES.get(model_type, {})})
    assert unknown == [] and "varlen" in model_spec(args).supported(args)
    torch.manual_seed(0)
    model = build_model(args).double().eval()
    model.init_weights()
    return model


@pytest.mark.parametrize("model_type", sorted(PACKED_DOCUMENT_MODEL_TYPES))
def test_packed_documents_equal_the_documents_alone(model_type):
    model = model_of(model_type)
    tokens = torch.randint(
        0, SHAPE["vocab_size"], (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1)
    )
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, position_ids=position_ids)
        alone = torch.cat([model(doc) for doc in tokens.split(LENGTHS, dim=1)], dim=1)
        unpacked = model(tokens)  # the same row read as one document differs: the mask did cut
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    assert (unpacked[0, LENGTHS[0] :] - alone[0, LENGTHS[0] :]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "config", [{"model_type": "abc"}, {"model_type": "qwen3_next"}]
)  # FLA's class whose layers refuse cu_seqlens; transformers' hybrid with linear attention
def test_varlen_is_refused_where_documents_would_mix(config):
    args, _ = model_args_from_dict({"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, **config})
    job_config = parse_args(["--training.varlen", "--training.batch_size", "1"])
    with pytest.raises(ConfigError, match="do not support packed documents .*; train them without it"):
        check_family_support(job_config, args, {"tp": 1, "pp": 1, "cp": 1})


def test_flas_transformer_class_keeps_packed_documents_apart_with_cu_seqlens(monkeypatch):
    """FLA's classes of FLA_PACKED_DOCUMENT_MODEL_TYPES take cu_seqlens to their layers; FLA's transformer (its
    attention on flame's, its SwiGLU kernel replaced by the same function in PyTorch to run on the CPU), float64."""
    import fla.modules.mlp
    import torch.nn.functional as F

    from flame.models.generic.args import FLA_PACKED_DOCUMENT_MODEL_TYPES

    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda gate, up: F.silu(gate) * up)
    config = {"model_type": "transformer", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
              "num_heads": 2, "fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False}  # fmt: skip
    args, _ = model_args_from_dict(config, impl="fla")
    assert "transformer" in FLA_PACKED_DOCUMENT_MODEL_TYPES and "varlen" in model_spec(args).supported(args)
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    model = model.double().eval()
    tokens = torch.randint(0, 97, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, position_ids=position_ids, cu_seqlens=cu_seqlens)
        alone = torch.cat([model(doc) for doc in tokens.split(LENGTHS, dim=1)], dim=1)
        unpacked = model(tokens)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-12)
    assert (unpacked[0, LENGTHS[0] :] - alone[0, LENGTHS[0] :]).abs().max() > 1e-3


def test_the_gpu_survey_passes_flas_transformer_on_the_cpu(monkeypatch):
    """scripts/fla_varlen_survey.py's check (what tests/gpu/test_fla_varlen.py runs per listed family) on the one
    FLA class that runs on the CPU."""
    import sys

    import fla.modules.mlp
    import torch.nn.functional as F

    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda gate, up: F.silu(gate) * up)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "scripts"))
    import fla_varlen_survey

    unfused = {"fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False}  # FLA's PyTorch modules
    monkeypatch.setattr(fla_varlen_survey, "SHAPE", {**fla_varlen_survey.SHAPE, **unfused})
    difference = fla_varlen_survey.packed_difference("transformer", torch.device("cpu"))
    assert difference <= fla_varlen_survey.TOLERANCE[torch.float32]
    # bfloat16 (the survey's fallback for FLA kernels that refuse float32): documents still apart within its tolerance
    difference = fla_varlen_survey.packed_difference("transformer", torch.device("cpu"), torch.bfloat16)
    assert difference <= fla_varlen_survey.TOLERANCE[torch.bfloat16]
    assert fla_varlen_survey.main([]) == 2  # the survey itself needs a GPU
    del sys.modules["fla_varlen_survey"]


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "mamba3", "samba"])
def test_the_gpu_survey_passes_flas_mamba_families_on_the_cpu(model_type, monkeypatch):
    """scripts/fla_varlen_survey.py's check on FLA's classes whose sequence mixers are flame's (the Mamba layers;
    samba's attention on flame's attention), on the CPU, where FLA's norms and activations run as flame's PyTorch
    code as they do while torch.compile traces: the whole class keeps packed documents apart within the survey's
    float32 tolerance (a Mamba layer that ignores the boundaries differs at ~1e-1). Their GPU
    kernels' packed paths are checked under Triton's interpreter and on the GPU (tests/gpu)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "scripts"))
    import fla_varlen_survey

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    difference = fla_varlen_survey.packed_difference(model_type, torch.device("cpu"))
    assert difference <= fla_varlen_survey.TOLERANCE[torch.float32], f"{model_type}: {difference:.1e}"


def varlen_survey():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
    import fla_varlen_survey

    return fla_varlen_survey


def test_the_gpu_surveys_config_of_every_fla_family_is_accepted():
    """scripts/fla_varlen_survey.py builds each FLA family from one tiny config: each is accepted as it is read (a
    refused key would be the family's survey line instead of its verdict)."""
    from flame.models.generic.args import fla_model_types

    fla_varlen_survey = varlen_survey()

    for model_type in sorted(fla_model_types()):
        args, _ = model_args_from_dict(fla_varlen_survey.survey_config(model_type), impl="fla")
        assert args.model_type == model_type


@pytest.mark.skipif(torch.cuda.is_available(), reason="the family's process must find no GPU")
def test_a_survey_process_that_gives_no_verdict_is_its_familys_failure_line():
    """--processes: each family's line comes from its own process; one that stops without a verdict (here: no GPU) or
    runs past --timeout_s is a failure line naming the family."""
    survey = varlen_survey()
    line = survey.survey_in_a_process("gla", timeout_s=120, tune=True)
    assert line.startswith("gla: failed: exit 2: ") and "needs a CUDA GPU" in line, line
    assert survey.survey_in_a_process("gla", timeout_s=0.01) == "gla: failed: no verdict within 0.01 s"


def test_flas_linear_attention_layers_receive_cu_seqlens(monkeypatch):
    """FLA 0.6.0's linear_attn model does not hand cu_seqlens to its blocks (flame.compat's
    fla_linear_attn_hands_layers_cu_seqlens): built by flame, every layer receives the boundaries flame passes, and
    none without them. The layer itself is FLA's Triton kernel, checked on the GPU by the survey."""
    import fla.layers.linear_attn
    import fla.modules.mlp
    import torch.nn.functional as F

    received = []

    def recording_forward(self, hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        received.append(kwargs.get("cu_seqlens"))
        return hidden_states, None, past_key_values

    monkeypatch.setattr(fla.layers.linear_attn.LinearAttention, "forward", recording_forward)
    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda gate, up: F.silu(gate) * up)
    config = {"model_type": "linear_attn", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2,
              "num_heads": 2, "fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False}  # fmt: skip
    args, _ = model_args_from_dict(config)
    model = build_model(args)
    model.init_weights()
    tokens = torch.randint(0, 97, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    with torch.no_grad():
        model(tokens, cu_seqlens=cu_seqlens)
        model(tokens)
    assert len(received) == 4
    assert all(seen is cu_seqlens for seen in received[:2]) and received[2:] == [None, None]
