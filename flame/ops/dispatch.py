"""Which implementation serves a call of an op: one table for every op that has more than one.

Each op registers, once, its PyTorch implementation (any device; the reference every kernel is tested against) and
its CUDA backends by name, fastest first. A backend may declare what it needs installed (``requires``: modules that
must import) and which calls it does not take (``refuses``: given the call's arguments, the reason it cannot serve
them, or None), where the PyTorch implementation takes them: a dtype its kernel rejects, a width past its limit, a
flag it lacks.

A call on CUDA tensors runs the backend the job pinned (``pin``; for attention, ``--model.attention_backend``),
else the first backend that is installed and takes the call; when none does, the PyTorch implementation runs on the
same device. Each refusal is logged once per op, backend and reason (a compiled call's after the step, so that the
log adds no graph break); a backend that is not installed only where no other kernel serves the call. A backend
whose kernel fails to build in an eager call (an error of Triton, TileLang or TVM, or raised from one: a Triton
CompilationError, a config past the GPU's shared memory, nvcc failing under TileLang) is out for the rest of the
process, with one log line, and the call goes to the next backend that takes it. Under torch.compile the backend
is chosen while tracing, so a kernel that fails to build inside the compiled graph, or in the backward pass of an
eager call, raises out of the step; :func:`take_out_failed_backends` finds the backend in the error's traceback (its
``run`` or its ``code``) and takes it out, and the training step starts over without it (flame.train.step). The
environment variable ``FLAME_BACKENDS_OFF`` (``op:backend`` pairs, comma-separated) takes backends out from the
start. A call on any other device runs the PyTorch implementation. An op marked ``eager_only``
runs its PyTorch code under torch.compile too, where inductor fuses it with the code around it (a kernel call would
split the compiled graph).

Adding a backend is one entry in its op's ``register_op`` call.
"""

import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flame.errors import ConfigError, first_line

logger = logging.getLogger(__name__)
# Packages whose exceptions mean that a kernel did not build (its compiler, not the call's arguments), and those
# that raise plain errors for it too (TileLang: RuntimeError("Compilation Failed! ...") when nvcc fails).
KERNEL_COMPILERS = ("triton", "tilelang", "tvm", "tvm_ffi")
PLAIN_ERROR_COMPILERS = ("tilelang", "tvm", "tvm_ffi")


def not_traced(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)`` with torch._dynamo imported at the first call instead of here: the import
    costs ~1.7 s, which train.sh's pre-flight (it imports the ops and compiles nothing) would pay on every launch.
    This is torch's own lazy form of the decorator, which torch.optim and torch.utils.checkpoint use."""
    return torch._disable_dynamo(fn)


def constant_to_compiler(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (~4 s cold on a GPU host, paid
    by the pre-flight at every launch): torch's decorator imports dynamo only to set this mark, which dynamo reads
    when it traces a call of ``fn`` (tests/ops/test_dispatch.py checks that the two mark a function alike)."""
    fn._dynamo_marked_constant = True
    return fn


@dataclass(frozen=True)
class Backend:
    """A CUDA implementation of an op, called with the op's arguments."""

    run: Callable
    refuses: Callable[..., str | None] | None = None
    """Called with the op's arguments: why this backend cannot serve the call (one phrase), or None when it can"""
    requires: tuple[str, ...] = ()
    """Top-level modules that must be importable for the backend to run at all"""
    code: tuple[str, ...] = ()
    """Where the backend's kernels launch without ``run`` on the stack: prefixes of the ``module.function`` names of
    the code a compiled graph calls (the backend's custom ops) or an autograd Function's backward runs"""

    def runs_in(self, frame: str) -> bool:
        """Whether the code named ``frame`` (``module.qualified_name``) is this backend's."""
        own = f"{getattr(self.run, '__module__', '')}.{getattr(self.run, '__qualname__', '')}"
        return frame == own or frame.startswith(self.code)


@dataclass
class Op:
    name: str
    torch_impl: Callable
    cuda_backends: Mapping[str, Backend]  # fastest first
    eager_only: bool = False
    missing: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per backend, the required modules this process cannot import (looked up once, at registration)"""
    pinned: str | None = field(default=None, init=False)
    failed: dict[str, str] = field(default_factory=dict, init=False)
    """Per backend out for this process (its kernel failed to build, or FLAME_BACKENDS_OFF names it), why"""

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        """Run the call ``(x, *args, **kwargs)`` on what serves it; the main input ``x`` decides the device."""
        while True:
            name, run = self.choose(x, *args, **kwargs)
            if name == "pytorch" or torch.compiler.is_compiling():
                return run(x, *args, **kwargs)
            try:
                return run(x, *args, **kwargs)
            except Exception as error:
                if not kernel_build_failure(error):
                    raise
                self.failed[name] = (
                    f"failed to build its kernel ({type(error).__name__}: {first_line(error)})"
                )

    def implementation(self, x: torch.Tensor, *args, **kwargs) -> Callable:
        """What serves a call whose main input is ``x`` (and whose other arguments are ``args``/``kwargs``, which
        the backends' ``refuses`` read)."""
        return self.choose(x, *args, **kwargs)[1]

    def choose(self, x: torch.Tensor, *args, **kwargs) -> tuple[str, Callable]:
        """The name ("pytorch" for the PyTorch implementation) and function of what serves the call."""
        if not self.runs_kernels_for(x) or (self.eager_only and torch.compiler.is_compiling()):
            return "pytorch", self.torch_impl
        refused, absent = [], []
        for name in [self.pinned] if self.pinned else self.cuda_backends:
            backend = self.cuda_backends[name]
            if name in self.missing:
                absent.append((name, f"needs {', '.join(self.missing[name])}, which is not installed"))
            elif name in self.failed:
                refused.append((name, self.failed[name]))
            elif backend.refuses is None or (reason := backend.refuses(x, *args, **kwargs)) is None:
                if refused:  # an optional package left out is no news while another kernel serves the call
                    self._log_passed_over(refused, name)
                return name, backend.run
            else:
                refused.append((name, reason))
        self._log_passed_over(refused + absent, "pytorch")
        return "pytorch", self.torch_impl

    @staticmethod
    def runs_kernels_for(x: torch.Tensor) -> bool:
        """Whether a call whose main input is ``x`` goes to the backends (CUDA tensors) or to the PyTorch code."""
        return x.is_cuda

    def _log_passed_over(self, passed_over: list[tuple[str, str]], server: str) -> None:
        for backend, reason in passed_over:
            _PASSED_OVER.add((self.name, backend, reason, server))
        if not torch.compiler.is_compiling():
            log_passed_over_calls()


# (op, backend, reason, server) of each call a backend passed over, and those logged. A compiled region only adds to
# the first: dynamo replays the add after the region, where a log call would break its graph at every call
# (docs/performance.md, "Compiled blocks stay one graph where a backend refuses a call").
_PASSED_OVER: set[tuple[str, str, str, str]] = set()
_LOGGED: set[tuple[str, str, str, str]] = set()


def log_passed_over_calls() -> None:
    """One warning for each op, backend, reason and server a call was passed over for that no warning named yet:
    at the call itself when eager, after the step (flame.train.step) for a compiled one."""
    for op, backend, reason, server in sorted(_PASSED_OVER - _LOGGED):
        logger.warning(f"{op}: the {backend} backend {reason}; the {server} implementation serves it")
    _LOGGED.update(_PASSED_OVER)


def kernel_build_failure(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a kernel compiler's: of a class of KERNEL_COMPILERS, or
    raised in the code of PLAIN_ERROR_COMPILERS."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(cls.__module__.split(".")[0] in KERNEL_COMPILERS for cls in type(error).__mro__):
            return True
        frame = error.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        if frame is not None and package_of(frame.tb_frame.f_globals) in PLAIN_ERROR_COMPILERS:
            return True
        error = error.__cause__ or error.__context__
    return False


def package_of(module_globals: dict) -> str:
    return str(module_globals.get("__name__", "")).split(".")[0]


def take_out_failed_backends(error: BaseException) -> list[tuple[str, str]]:
    """Where ``error`` is a kernel build failure raised in a backend's code, that backend is out for the rest of the
    process, as an eager call's is (its calls go on to the next backend, with the one log line); returns the (op,
    backend) pairs taken out, none where the error is not such a failure. The innermost frame of the traceback that
    some backend claims (``Backend.run``, ``Backend.code``) names it; several backends that share the code are all
    taken out."""
    if not kernel_build_failure(error):
        return []
    for frame in _frames_innermost_first(error):
        owners = [
            (op, name)
            for op in _TABLE.values()
            for name, backend in op.cuda_backends.items()
            if name not in op.failed and backend.runs_in(frame)
        ]
        if owners:
            for op, name in owners:
                op.failed[name] = f"failed to build its kernel ({type(error).__name__}: {first_line(error)})"
            return [(op.name, name) for op, name in owners]
    return []


def why_out(op: str, backend: str) -> str:
    """One line: why ``backend`` of ``op`` serves no call of this process."""
    return f"{op}: the {backend} backend {_lookup(op).failed[backend]}"


def _frames_innermost_first(error: BaseException) -> list[str]:
    """``module.qualified_name`` of each frame of ``error``'s traceback and of the errors it was raised from, the
    first raised error's innermost frame first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    frames = []
    for raised in reversed(chain):
        names = []
        traceback = raised.__traceback__
        while traceback is not None:
            code = traceback.tb_frame.f_code
            names.append(f"{traceback.tb_frame.f_globals.get('__name__', '')}.{code.co_qualname}")
            traceback = traceback.tb_next
        frames.extend(reversed(names))
    return frames


# FLAME_BACKENDS_OFF: "op:backend" pairs, comma-separated, of backends no call of this process runs.
BACKENDS_OFF_VARIABLE = "FLAME_BACKENDS_OFF"


def _backends_off() -> list[tuple[str, str]]:
    pairs = filter(None, (pair.strip() for pair in os.environ.get(BACKENDS_OFF_VARIABLE, "").split(",")))
    return [tuple(pair.partition(":")[::2]) for pair in pairs]


def check_backends_off() -> None:
    """Raise ConfigError where FLAME_BACKENDS_OFF names no op of the table or no backend of its op (called once the
    ops are registered: flame.train.kernels)."""
    for op, backend in _backends_off():
        if op not in _TABLE:
            raise ConfigError(
                f"{BACKENDS_OFF_VARIABLE}: no op {op!r} has backends; those that do: {', '.join(sorted(_TABLE))}"
            )
        if backend not in _TABLE[op].cuda_backends:
            raise ConfigError(
                f"{BACKENDS_OFF_VARIABLE}: {op} has no backend {backend!r}; its backends: "
                f"{', '.join(_TABLE[op].cuda_backends)}"
            )


_TABLE: dict[str, Op] = {}


def register_op(
    name: str,
    torch_impl: Callable,
    cuda_backends: Mapping[str, Callable | Backend],
    *,
    eager_only: bool = False,
) -> Op:
    """Enter an op in the table (at the import of the module that defines it); returns its entry. A backend given as
    a plain function takes every call and needs nothing installed."""
    if name in _TABLE:
        raise ValueError(f"op {name!r} is registered already")
    if not cuda_backends:
        raise ValueError(f"op {name!r} needs at least one CUDA backend")
    backends = {
        key: value if isinstance(value, Backend) else Backend(value) for key, value in cuda_backends.items()
    }
    missing = {
        key: missing
        for key, backend in backends.items()
        if (missing := tuple(m for m in backend.requires if importlib.util.find_spec(m) is None))
    }
    entry = Op(name, torch_impl, backends, eager_only, missing)
    entry.failed.update(
        {backend: f"is turned off ({BACKENDS_OFF_VARIABLE})" for op, backend in _backends_off() if op == name}
    )
    _TABLE[name] = entry
    return entry


def backend_names(op: str) -> tuple[str, ...]:
    return tuple(_lookup(op).cuda_backends)


def pin(op: str, backend: str | None) -> None:
    """Serve ``op``'s CUDA calls with ``backend`` from now on in this process (the PyTorch implementation where it
    refuses a call); None restores the default."""
    entry = _lookup(op)
    if backend is not None and backend not in entry.cuda_backends:
        raise ValueError(f"{op} backend must be one of {backend_names(op)}, got {backend!r}")
    entry.pinned = backend


def pinned(op: str) -> str:
    """The backend that serves ``op``'s CUDA calls now, unless it refuses one: the pinned one, else the first that
    is installed ("pytorch" where none is)."""
    entry = _lookup(op)
    return entry.pinned or next((n for n in entry.cuda_backends if n not in entry.missing), "pytorch")


def _lookup(op: str) -> Op:
    if op not in _TABLE:
        raise KeyError(f"no op {op!r} in the dispatch table; registered: {', '.join(sorted(_TABLE))}")
    return _TABLE[op]
