"""--training.varlen on FLA's classes: every family flame accepts it for (FLA_PACKED_DOCUMENT_MODEL_TYPES) keeps
packed documents apart on the GPU, with FLA's Triton kernels: one row of three documents given cu_seqlens equals
each document run alone (scripts/fla_varlen_survey.py's check: relative difference at most 1e-4 in float32 without TF32,
2e-2 in bfloat16 for the families whose kernels assert half precision)."""

import sys
from pathlib import Path

import pytest
import torch

from flame.models.generic.args import FLA_PACKED_DOCUMENT_MODEL_TYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fla_varlen_survey  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("model_type", sorted(FLA_PACKED_DOCUMENT_MODEL_TYPES))
def test_packed_documents_equal_the_documents_alone(model_type, exact_float32):
    from flame.train.kernels import prepare_gpu_kernels

    prepare_gpu_kernels(torch.device("cuda"))
    difference, dtype = fla_varlen_survey.family_difference(model_type, torch.device("cuda"))
    assert difference <= fla_varlen_survey.TOLERANCE[dtype], f"{model_type} in {dtype}: {difference:.1e}"
