"""The generic family's initial weights after the trainer's meta-device build and ``materialize`` are those of
``AutoModelForCausalLM.from_config`` on the CPU (plain FLA / transformers), for every FLA 0.6.0 model type that
builds without flash-attn and transformers' llama, qwen3 and olmo2: where the class's values do not depend on the
seed, the same values exactly (float32 both sides, torch.equal); where they do, finite, not all zero, with the
class's mean and spread (bounds below)."""

import math
import warnings

import pytest
import torch

from flame.errors import ModelConfigError
from flame.models import build_model, model_args_from_dict
from flame.models.generic import initialization
from flame.train.model_parts import materialize
from tests.models.generic.helpers import CONFIGS
from tests.models.generic.test_fla_families import OVERRIDES, TINY, fla_model_types

# FLA's own transformer and samba build FLA's Attention layer, which imports flash_attn when it is built: the plain
# class, the reference here, cannot be built without it (flame builds them on its own attention).
FLA_TYPES = [t for t in fla_model_types() if t not in {"transformer", "samba"}]


def config_of(model_type: str) -> tuple[dict, str]:
    """The tiny config and the --model.impl that builds the class itself (FLA's, or transformers')."""
    if model_type in CONFIGS:
        return CONFIGS[model_type], "hf"
    return {"model_type": model_type, **TINY, **OVERRIDES.get(model_type, {})}, "fla"


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def plain(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """What a user of FLA / transformers gets: the class built on the CPU under the seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))
    return named_tensors(model)


def through_flame(config: dict, impl: str, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's path: built on the meta device, then materialize (to_empty, ties, init_weights)."""
    args, _ = model_args_from_dict(config, impl)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = build_model(args)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        materialize(model, "cpu")
    return named_tensors(model)


def mismatch(a0: torch.Tensor, a1: torch.Tensor, b: torch.Tensor) -> str | None:
    """How flame's value ``b`` fails the class's values ``a0``/``a1`` under two seeds, or None.

    Seed-dependent values: the mean within 4 standard errors of the two samples' difference (the class's spread
    from both seeds pooled), and from 64 elements on, the standard deviation within a factor exp(5 / sqrt(2n)) of
    the class's (about 5 standard errors of a sample standard deviation: 0.80-1.25 at 256 elements, 0.95-1.06 at
    4096). Smaller tensors (per-head vectors) are too few for a spread to mean anything."""
    if a0.shape != b.shape or a0.dtype != b.dtype:
        return f"shape/dtype {tuple(b.shape)} {b.dtype}, the class's {tuple(a0.shape)} {a0.dtype}"
    if torch.equal(a0, a1):
        return None if torch.equal(a0, b) else "differs from the class's seed-independent value"
    b, pooled = b.double().flatten(), torch.cat([a0.flatten(), a1.flatten()]).double()
    if not torch.isfinite(b).all():
        return "not finite"
    if not b.any():
        return "all zero"
    error = 4 * pooled.std() * math.sqrt(1 / b.numel() + 1 / pooled.numel())
    if abs(b.mean() - pooled.mean()) > error:
        return f"mean {b.mean():.4g}, the class's {pooled.mean():.4g} (+-{error:.2g})"
    if b.numel() >= 64:
        ratio, bound = (b.std() / a0.double().std()).item(), math.exp(5 / math.sqrt(2 * b.numel()))
        if not 1 / bound <= ratio <= bound:
            return f"std {b.std():.4g}, {ratio:.3f} x the class's (bounds {1 / bound:.3f}-{bound:.3f})"
    return None


def mismatches(model_type: str) -> dict[str, str]:
    config, impl = config_of(model_type)
    a0, a1, b = plain(config, 0), plain(config, 1), through_flame(config, impl, 0)
    # flame's attention in place of FLA's (no flash-attn) keeps no rotary table: it computes the angles as it goes.
    rotary_tables = {name for name in set(a0) - set(b) if name.endswith(".rotary.inv_freq")}
    assert set(b) == set(a0) - rotary_tables, (model_type, set(b) ^ set(a0))
    found = {name: mismatch(a0[name], a1[name], b[name]) for name in b}
    return {f"{model_type}: {name}": why for name, why in found.items() if why}


def test_generic_models_start_from_their_classes_initialization():
    assert len(FLA_TYPES) >= 37
    failed = {}
    for model_type in [*FLA_TYPES, *CONFIGS]:
        failed |= mismatches(model_type)
    assert failed == {}


@pytest.mark.parametrize("model_type", ["rwkv6", "mamba2", "llama"])
def test_initialization_is_drawn_from_the_random_state_at_materialize(model_type):
    """The same seed gives the same weights; the build draws nothing, so draws between it and materialize do
    not matter, and a different seed gives different weights."""
    config, impl = config_of(model_type)
    first = through_flame(config, impl, seed=3)
    args, _ = model_args_from_dict(config, impl)
    torch.manual_seed(11)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = build_model(args)
    torch.rand(5)
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        materialize(model, "cpu")
    again = named_tensors(model)
    assert all(torch.equal(first[name], again[name]) for name in first)
    other = through_flame(config, impl, seed=4)
    assert not all(torch.equal(first[name], other[name]) for name in first)


def test_large_tensors_take_their_layers_own_pass_again(monkeypatch):
    """Tensors too large to make again (the limit lowered to 1024 elements: every projection) get the pass of
    the layer whose constructor ran it (RWKV-7's attention and LoRAs, whose passes mark their modules, and its
    feed-forward, whose pass does not), and no pass a constructor did not run (Gated DeltaProduct's); the rest
    (llama's) their reset_parameters and the class's _init_weights."""
    monkeypatch.setattr(initialization, "CONSTRUCTED_NUMEL", 1024)
    failed = {}
    for model_type in ["rwkv7", "gated_deltaproduct", "llama"]:
        failed |= mismatches(model_type)
    assert failed == {}


def test_a_large_tensor_only_a_constructor_fills_is_refused(monkeypatch):
    """MesaNet's lambda_params (2048 elements here) come from its constructor alone: past the limit nothing
    would write them, and the build says which tensor instead of training from uninitialised memory."""
    monkeypatch.setattr(initialization, "CONSTRUCTED_NUMEL", 1024)
    config, impl = config_of("mesa_net")
    with pytest.raises(ModelConfigError, match=r"nothing initialises model\.layers\.0\.attn\.lambda_params"):
        through_flame(config, impl, 0)
