"""Float8 linear layers through torchao, by torchtitan's converter (``--model.converters quantize.linear.float8``).

Float8 matmuls need torchao and a GPU of compute capability 8.9 or newer (H100/H200, L4, RTX 40xx); torchao's
emulation (``--quantize.linear.float8.emulate``, eager only) runs elsewhere for testing. Every nn.Linear whose
dimensions are multiples of 16 is converted, except names matching ``--quantize.linear.float8.filter_fqns``
(e.g. ``lm_head``). With tensorwise scaling and ``enable_fsdp_float8_all_gather`` +
``precompute_float8_dynamic_scale_for_fsdp``, the trainer must call ``post_optimizer_hook`` after each step.
"""

import importlib.util
from typing import TYPE_CHECKING

from flame.config.job_config import FLOAT8_CONVERTER as FLOAT8
from flame.errors import ConfigError

if TYPE_CHECKING:  # the converter checks import no torch: train.sh's pre-flight runs them without it
    from torch import nn

KNOWN_CONVERTERS = (FLOAT8,)


def float8_enabled(job_config) -> bool:
    return FLOAT8 in job_config.model.converters


def check_converters(job_config, on_gpu: bool | None = None) -> None:
    """One-line ConfigError for converters flame cannot apply here. ``on_gpu`` None: ask torch.cuda."""
    for name in job_config.model.converters:
        if name not in KNOWN_CONVERTERS:
            raise ConfigError(
                f"model.converters: '{name}' is not supported by flame; known: {', '.join(KNOWN_CONVERTERS)}"
            )
    if not float8_enabled(job_config):
        return
    float8 = job_config.quantize.linear.float8
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"model.converters {FLOAT8} needs torchao: pip install torchao")
    if float8.emulate:
        if job_config.compile.enable:
            raise ConfigError(
                "quantize.linear.float8.emulate works in eager mode only; drop --compile.enable"
            )
        return
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    if not on_gpu:
        raise ConfigError(
            f"model.converters {FLOAT8} needs a GPU of compute capability 8.9 or newer (H100/H200, L4, RTX 40xx); "
            "none here (quantize.linear.float8.emulate tests it without one)"
        )


def apply_float8(model: "nn.Module", job_config, parallel_dims):
    """Swap nn.Linear for torchao's Float8Linear in place (before tensor parallelism and FSDP); returns the
    converter (its ``post_optimizer_hook(model_parts)`` precomputes FSDP float8 scales), or None when off."""
    if not float8_enabled(job_config):
        return None
    check_converters(job_config)
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    converter = Float8LinearConverter(job_config, parallel_dims)
    converter.convert(model)
    return converter
