"""The generic family's initialisation after ``to_empty``: the values ``AutoModelForCausalLM.from_config`` gives on a
real device, for a model built on the meta device.

A class's initial values come from two places: its constructor (FLA's layers set decay curves, token-shift mixes and
constants there, some through their own ``_initialize_weights`` pass, which also marks modules
``_is_hf_initialized`` so that the model's ``_init_weights`` leaves them alone) and transformers' ``init_weights``
(the class's ``_init_weights`` over every unmarked module, then the ties). On the meta device the constructor's
values are lost, so before ``init_weights``:

1. the constructor runs again on the meta device with the tensors it makes of at most ``CONSTRUCTED_NUMEL``
   elements made for real on the CPU (per-channel and per-head vectors, small tables), and their values and its
   marks are copied into the model (a DTensor takes its own block);
2. a layer whose constructor ran its own pass and holds larger tensors is made whole on the CPU, its modules'
   ``reset_parameters`` and its passes run there, and it is copied in;
3. other modules holding larger tensors run their ``reset_parameters`` (torch's constructors do), and
   ``init_weights`` gives the rest the class's initialisation.

Every draw happens at this point, from the random state here (the meta build draws nothing), in the same order in
every process. A floating-point tensor that no step wrote is refused: it would train from uninitialised memory."""

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from flame.errors import ModelConfigError
from flame.models.layers.sharding import local_tensor

# Tensors a constructor creates with at most this many elements are made for real when it runs again (4 MiB in
# float32): every per-channel or per-layer table of FLA 0.6.0's classes, while a large model's projections and
# embeddings stay on the meta device.
CONSTRUCTED_NUMEL = 1 << 20

INITIALIZED = "_is_hf_initialized"  # transformers' mark: initialised, skip


class SmallTensorsOnCPU(TorchFunctionMode):
    """Inside ``torch.device("meta")``: a factory call (torch.ones, torch.empty, ...) that names no device and makes
    a tensor of 1 to ``CONSTRUCTED_NUMEL`` elements makes it on the CPU instead. Empty tensors stay on the meta
    device: transformers finds the device context by making one (``torch.tensor([])``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if (
            func in _device_constructors()
            and kwargs.get("device") is None
            and isinstance(result, torch.Tensor)
            and result.is_meta
            and 0 < result.numel() <= CONSTRUCTED_NUMEL
        ):
            result = func(*args, **{**kwargs, "device": "cpu"})
        return result


def construct_small_tensors(model: nn.Module) -> nn.Module:
    """The model's class built again from its config, on the meta device but for its small tensors."""
    with torch.device("meta"), SmallTensorsOnCPU():
        return model.built_again()


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(recurse=False)),
        **{name: b for name, b in module.named_buffers(recurse=False) if b is not None},
    }


@torch.no_grad()
def set_full_value(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full value into a parameter or buffer; a DTensor (FSDP) takes its own block of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = value.to(device=tensor.device, dtype=tensor.dtype)
    if isinstance(tensor, DTensor):
        value = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.copy_(value)


# Attributes by which torch.compile and activation checkpointing wrap a block: not part of the class's names.
WRAPPED = ("_orig_mod", "_checkpoint_wrapped_module")


def class_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's modules by the class's own names: a wrapped block's name is the block's, its module the one
    inside the wrappers."""
    found = {}
    for name, module in model.named_modules():  # a wrapper comes before what it wraps
        found[".".join(part for part in name.split(".") if part not in WRAPPED)] = module
    return found


def joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def enclosing(name: str) -> list[str]:
    """The module's name and its ancestors' names, innermost first ("" is the model)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def own_initializer(module: nn.Module) -> bool:
    """Whether the module's class has a layer's ``_initialize_weights`` (not transformers' model-level one), the
    pass FLA's layer constructors run over their submodules with ``self.apply``."""
    from transformers import PreTrainedModel

    return not isinstance(module, PreTrainedModel) and callable(getattr(module, "_initialize_weights", None))


# Layers whose constructor runs their own ``_initialize_weights`` pass but marks no module with it, so the mark cannot
# show that it ran (class -> where).
UNMARKED_PASSES = {
    "fla.models.rwkv7.modeling_rwkv7.RWKV7FeedForward": "fla/models/rwkv7/modeling_rwkv7.py, RWKV7FeedForward",
}


def ran_own_pass(constructed: nn.Module) -> bool:
    """Whether the layer's constructor ran its ``_initialize_weights`` pass: FLA's passes mark each module they
    visit, the layer last; a few mark nothing (UNMARKED_PASSES)."""
    cls = type(constructed)
    return (
        getattr(constructed, INITIALIZED, False) or f"{cls.__module__}.{cls.__qualname__}" in UNMARKED_PASSES
    )


@torch.no_grad()
def rerun_own_pass(layer: nn.Module) -> None:
    """Make the constructed layer's meta tensors real on the CPU (NaN until written), then run what its
    constructor ran: each module's reset_parameters, then the own passes, innermost layers first with every mark
    under the layer cleared (an inner layer's pass marks its modules; an outer one's leaves marked modules
    alone)."""
    for module in layer.modules():
        module.__dict__.pop(INITIALIZED, None)
        made = False
        for name, tensor in tensors(module).items():
            if tensor.is_meta:
                value = torch.full_like(
                    tensor, float("nan") if tensor.is_floating_point() else 0, device="cpu"
                )
                if isinstance(tensor, nn.Parameter):
                    setattr(module, name, nn.Parameter(value, requires_grad=tensor.requires_grad))
                else:
                    module._buffers[name] = value
                made = True
        if made and callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    passes = [(name, m) for name, m in layer.named_modules() if own_initializer(m)]
    for _, module in sorted(passes, key=lambda p: -len(enclosing(p[0]))):  # stable: the layer's order
        module.apply(module._initialize_weights)


@torch.no_grad()
def initialize_as_constructed(model: nn.Module) -> list[str]:
    """Give the materialised ``model`` its constructor's values and marks, for ``init_weights`` to follow; returns
    the names of the floating-point tensors left to later steps (filled with NaN until they write them)."""
    constructed = dict(construct_small_tensors(model).named_modules())
    unbuilt: dict[str, list[str]] = {}  # module name -> its tensors the constructor left on the meta device
    left = []
    modules = class_modules(model)
    for name, module in modules.items():
        twin = constructed[name]
        module.__dict__.pop(INITIALIZED, None)
        if getattr(twin, INITIALIZED, False):
            module._is_hf_initialized = True
        twins = tensors(twin)
        for tensor_name, tensor in tensors(module).items():
            tensor.__dict__.pop(INITIALIZED, None)
            value = twins[tensor_name]
            if getattr(value, INITIALIZED, False):
                setattr(tensor, INITIALIZED, True)
            if value.is_meta:
                unbuilt.setdefault(name, []).append(tensor_name)
                if tensor.is_floating_point():
                    # check_initialized refuses it unless a later step writes it
                    local_tensor(tensor).fill_(float("nan"))
                    left.append(f"{name}.{tensor_name}" if name else tensor_name)
            else:
                set_full_value(tensor, value)
    # Large tensors of a layer whose constructor ran its own pass (``self.apply(self._initialize_weights)``) take
    # that pass again. It runs on the layer's twin, made whole on the CPU (the pass writes through ``.data`` and
    # runs ops a sharded DTensor lacks), and the twin's tensors and marks are then copied into the layer.
    owners = set()
    for name in unbuilt:
        owner = next((o for o in enclosing(name) if own_initializer(modules[o])), None)
        if owner is not None and ran_own_pass(constructed[owner]):
            owners.add(owner)
    outermost = [o for o in modules if o in owners and not any(e in owners for e in enclosing(o)[1:])]
    for owner in outermost:
        rerun_own_pass(constructed[owner])
        for name, twin in constructed[owner].named_modules():  # a layer's insides are not wrapped
            module = modules[joined(owner, name)]
            module.__dict__.pop(INITIALIZED, None)
            if getattr(twin, INITIALIZED, False):
                module._is_hf_initialized = True
            twins = tensors(twin)
            for tensor_name, tensor in tensors(module).items():
                set_full_value(tensor, twins[tensor_name])
    rerun = {joined(o, n) for o in outermost for n in class_modules(modules[o])}
    for name in unbuilt:  # torch's convention: a module's constructor calls its reset_parameters
        if name not in rerun and callable(getattr(modules[name], "reset_parameters", None)):
            modules[name].reset_parameters()
    return left


@torch.no_grad()
def check_initialized(model: nn.Module, names: list[str]) -> None:
    """Refuse a tensor of ``names`` that still holds the NaN initialize_as_constructed left in it."""
    named = {
        joined(m, t): v for m, module in class_modules(model).items() for t, v in tensors(module).items()
    }
    for name in names:
        if local_tensor(named[name]).isnan().any():
            raise ModelConfigError(
                f"{type(model).__name__}: nothing initialises {name} after the model is built on the meta device "
                "(its constructor fills it and it is too large to make again); initialise it in the class's "
                "_init_weights"
            )
