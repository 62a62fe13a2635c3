"""--training.varlen on the generic family: transformers' attention-only decoders keep packed documents apart
(each document's logits equal those of the document run alone); the others are refused before launch."""

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
    "config", [{"model_type": "gla", "num_heads": 2}, {"model_type": "qwen3_next"}]
)  # FLA's class; transformers' hybrid with linear attention
def test_varlen_is_refused_where_documents_would_mix(config):
    args, _ = model_args_from_dict({"vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 2, **config})
    job_config = parse_args(["--training.varlen", "--training.batch_size", "1"])
    with pytest.raises(ConfigError, match="do not support packed documents"):
        check_family_support(job_config, args, {"tp": 1, "pp": 1, "cp": 1})
