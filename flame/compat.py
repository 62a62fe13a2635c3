"""Every workaround for a torch / torchtitan / FLA quirk lives here.

:data:`SHIMS` lists them: for each, the upstream issue (or where the behaviour is documented when none is filed), the
release that fixes it, the function here that works around it, and a probe that reproduces the upstream behaviour
with the installed packages. tests/test_compat.py runs every probe: a probe that no longer reproduces means the
pinned versions (3rdparty/) no longer need that shim, and the test names the function to delete.

Where flame's behaviour deliberately differs from torchtitan's (the checkpoint manager's guarantees, the pipeline
loss normalised by the global token count: torchtitan#2972), that is flame's design, documented where it lives.

Call :func:`apply` once per process, after importing torch and before building meshes or models. Importing this module
imports no torch: ``import flame`` installs :func:`defer_torchtitan_import_compile` from here.
"""

import contextlib
import contextvars
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shim:
    name: str
    upstream: str
    """The upstream issue, or where the behaviour is documented when no issue is filed"""
    fixed_in: str | None
    """The first release without the behaviour (None: not fixed in any release)"""
    workaround: str
    """The function in this module that works around it"""
    applies: Callable[[], bool]
    """Whether this machine takes the workaround at all (a CPU-only one does not act where a GPU is visible)"""
    reproduces: Callable[[], bool]
    """True while the installed packages still behave this way (in a fresh process, in SHIMS' order: probes import
    and the first needs a process without the fake process group)"""


def torchtitan_job_config() -> type:
    """torchtitan's JobConfig class without running ``torchtitan/__init__.py``.

    That init imports torchtitan's quantization converters (~3 s on a 2-core machine) although the config
    schema needs none of it; the launcher's pre-flight check only parses options and must answer within
    seconds. When torchtitan is already imported (the trainer), the regular module is used. Only processes
    that never train take the shortcut: the bare package stays in sys.modules for their lifetime.
    """
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        bare = types.ModuleType("torchtitan")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = bare
    if "torchtitan.config" not in sys.modules and "torch" not in sys.modules:
        _import_job_config_without_torch()
    from torchtitan.config.job_config import JobConfig

    return JobConfig


class _TorchOnFirstUse(types.ModuleType):
    """Stands for torch in a module that imports it but uses it only later: the first attribute imports torch."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("torch"), name)


def _import_job_config_without_torch() -> None:
    """Imports ``torchtitan.config.job_config`` without torch (~1 s on a 2-core machine, ~5 s on a GPU host): the
    body of the torchtitan.config package imports torch for its dtype table and runs here at the first name taken
    from the package (``_LazyPackageLoader``); the module itself imports torch without using it, and gets a stand-in
    that imports torch at its first use."""
    package = "torchtitan.config"
    spec = importlib.util.find_spec(package)
    spec.loader = _LazyPackageLoader(spec.loader)
    sys.modules[package] = module = importlib.util.module_from_spec(spec)
    parent, _, child = package.rpartition(".")
    setattr(sys.modules[parent], child, module)
    spec.loader.exec_module(module)
    sys.modules["torch"] = stand_in = _TorchOnFirstUse("torch")
    try:
        importlib.import_module(f"{package}.job_config")
    finally:
        if sys.modules.get("torch") is stand_in:
            del sys.modules["torch"]


TORCHTITAN_COMPILING_MODULE = "torchtitan.models.attention"


class DeferredCompile:
    """``torch.compile(fn, **options)`` made at the first call instead of at construction."""

    def __init__(self, compile_fn: Callable, fn: Callable, options: dict):
        self.compile_fn, self.fn, self.options, self.compiled = compile_fn, fn, options, None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            self.compiled = self.compile_fn(self.fn, **self.options)
        return self.compiled(*args, **kwargs)


class _WrappingLoader(importlib.abc.Loader):
    """A module's own loader, with a subclass's ``exec_module`` around the execution of its body."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)


class _WrappingFinder(importlib.abc.MetaPathFinder):
    """Finds one module as Python's path finder does and gives it ``wrapper`` (a _WrappingLoader) around its loader."""

    def __init__(self, module_name: str, wrapper: type[_WrappingLoader]):
        self.module_name, self.wrapper = module_name, wrapper

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = self.wrapper(spec.loader)
        return spec


def _wrap_loading(module_name: str, wrapper: type[_WrappingLoader]) -> None:
    """Installs the finder of ``module_name``'s wrapped loader first on sys.meta_path, once per process."""
    if not any(
        isinstance(finder, _WrappingFinder) and finder.module_name == module_name for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _WrappingFinder(module_name, wrapper))


class _DeferCompileLoader(_WrappingLoader):
    """Runs a module with ``torch.compile`` answered by :class:`DeferredCompile` while its body executes."""

    def exec_module(self, module) -> None:
        import torch

        compile_fn = torch.compile
        torch.compile = lambda fn, **options: DeferredCompile(compile_fn, fn, options)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_fn


def defer_torchtitan_import_compile() -> None:
    """torchtitan.models.attention calls ``torch.compile(flex_attention, ...)`` in a class body, so every import of
    torchtitan (its __init__ imports it through the quantization converters and protocols) loads inductor, also in
    runs that never compile or use FlexAttention (docs/performance.md, "Start-up imports"). flame
    lets that one module's compile wrapper be made at its first call; installed by ``import flame``, before anything
    imports torchtitan."""
    _wrap_loading(TORCHTITAN_COMPILING_MODULE, _DeferCompileLoader)


TRANSFORMERS_SKLEARN_MODULE = "transformers.generation.candidate_generator"
TRANSFORMERS_LAZY_SKLEARN = "5.21.0"  # the first release that imports scikit-learn where it is used


def roc_curve_at_first_call(*args, **kwargs):
    """scikit-learn's ``roc_curve``, imported when assisted generation first adapts its confidence threshold."""
    from sklearn.metrics import roc_curve

    return roc_curve(*args, **kwargs)


class _LazySklearnLoader(_WrappingLoader):
    """Runs transformers' candidate generator with scikit-learn reported absent while its body executes, then gives
    the module its real ``is_sklearn_available`` and, where scikit-learn is installed, a ``roc_curve`` that imports
    it at its first call: what transformers 5.21 does."""

    def exec_module(self, module) -> None:
        import transformers.utils

        available = transformers.utils.is_sklearn_available
        transformers.utils.is_sklearn_available = lambda: False
        try:
            self.loader.exec_module(module)
        finally:
            transformers.utils.is_sklearn_available = available
        module.is_sklearn_available = available
        if available():
            module.roc_curve = roc_curve_at_first_call


def defer_transformers_sklearn_import() -> None:
    """transformers before 5.21 imports scikit-learn, where it is installed (lm-eval requires it), at the top of
    generation/candidate_generator.py, which AutoTokenizer and every model class load: 1.3 s of the rank's imports on
    this repository's 2-core machine, 2.9 s on an H200 host, for a ROC curve that only assisted generation's
    confidence threshold computes. flame's loader defers that import to its first call; installed by ``import
    flame``, before anything imports transformers' generation."""
    if _transformers_imports_sklearn_at_top():
        _wrap_loading(TRANSFORMERS_SKLEARN_MODULE, _LazySklearnLoader)


FLA_EXPORTING_PACKAGES = ("fla", "fla.ops", "fla.modules")


class _LazyPackageLoader(_WrappingLoader):
    """Makes a package whose ``__init__`` only imports and re-exports its submodules: its ``__path__`` is set, so any
    submodule imports at once, and its own body runs at the first attribute the package lacks (PEP 562's module
    ``__getattr__``), when it imports and exports everything as before. A package's ``__version__`` is taken from
    its source without running it."""

    unrun: dict[str, Callable[[], None]] = {}
    """The packages loaded lazily whose bodies have not run, by name: the function that runs the body"""

    def exec_module(self, module) -> None:
        from pkgutil import extend_path

        module.__path__ = extend_path(module.__path__, module.__name__)
        version = _assigned_literal(module.__spec__.origin, "__version__")
        if version is not None:
            module.__version__ = version
        name, unrun = module.__name__, _LazyPackageLoader.unrun

        def run_body() -> None:
            del unrun[name], module.__getattr__
            self.loader.exec_module(module)

        def run_body_for(attribute: str):
            run_body()
            return getattr(module, attribute)

        unrun[name] = run_body
        module.__getattr__ = run_body_for


class _LazyPackagesFinder(importlib.abc.MetaPathFinder):
    """Gives the lazy packages (the root package first) their loader, until the first import of a module of the
    root's ``late`` subpackages, or of a module or package whose source imports them. That import ends the deferral
    for the process: the root's body runs, if it has not, and imports everything it imports, as it does without
    this finder (FLA's ``fla`` imports ``fla.layers`` and ``fla.models`` before any op, and its circular imports
    rely on that: ``fla.ops.deltaformer.parallel`` imports ``fla.layers``, whose DeltaFormer layer imports the op).
    A submodule that only a lazy package's body makes (FLA's module aliases, such as ``fla.modules.l2norm``) runs
    that body first."""

    def __init__(self, packages: tuple[str, ...], late: tuple[str, ...]):
        self.packages, self.root, self.ended = packages, packages[0], False
        subpackages = "|".join(re.escape(subpackage) for subpackage in late)
        self.late = re.compile(
            rf"^\s*(?:from|import)\s+{re.escape(self.root)}\.(?:{subpackages})\b", re.MULTILINE
        )
        self.late_names = tuple(f"{self.root}.{subpackage}" for subpackage in late)

    def find_spec(self, name, path, target=None):
        if self.ended or name.partition(".")[0] != self.root:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if name in self.packages:
            if spec is not None and spec.loader is not None:
                spec.loader = _LazyPackageLoader(spec.loader)
            return spec
        if spec is not None and self._imports_late(name, spec):
            self.ended = True
            run_first = _LazyPackageLoader.unrun.get(self.root)
        elif spec is None:
            run_first = _LazyPackageLoader.unrun.get(name.rpartition(".")[0])
        else:
            return None
        if run_first is not None:
            run_first()
        # The bodies may have imported the module itself; if not, Python's finders import it.
        return (
            importlib.machinery.ModuleSpec(name, _Imported(sys.modules[name]))
            if name in sys.modules
            else None
        )

    def _imports_late(self, name: str, spec) -> bool:
        """Whether the module, or any module of the package, imports one of the late subpackages: a package is
        judged whole, since its body is partly run when a submodule's import reaches the late ones."""
        if name in self.late_names or name.startswith(tuple(late + "." for late in self.late_names)):
            return True
        if spec.submodule_search_locations:
            sources = [
                source for folder in spec.submodule_search_locations for source in Path(folder).rglob("*.py")
            ]
        elif isinstance(spec.origin, str) and spec.origin.endswith(".py"):
            sources = [Path(spec.origin)]
        else:
            return False
        return any(_source_matches(source, self.late) for source in sources)


@functools.cache
def _source_matches(source: Path, pattern: re.Pattern) -> bool:
    """Whether the source file matches ``pattern``; each file is read once per process, though a package's scan
    and its submodules' imports all ask."""
    return pattern.search(source.read_text(encoding="utf-8")) is not None


class _Imported(importlib.abc.Loader):
    """The loader of a module that already exists: the import returns it as it is (its own ``__spec__`` kept)."""

    def __init__(self, module: types.ModuleType):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec


def _assigned_literal(path: str, name: str):
    """The literal that the module source at ``path`` assigns to ``name`` at its top level, or None."""
    import ast

    with open(path, encoding="utf-8") as source:
        for node in ast.parse(source.read()).body:
            targets = [getattr(target, "id", None) for target in getattr(node, "targets", ())]
            if isinstance(node, ast.Assign) and targets == [name]:
                with contextlib.suppress(ValueError):
                    return ast.literal_eval(node.value)
    return None


def defer_fla_package_imports() -> None:
    """FLA's ``fla``, ``fla.ops`` and ``fla.modules`` import every layer, model and op of the library (and
    transformers, and TileLang where it is installed) when any one op is imported: a GatedDeltaNet rank on an H200
    loaded 480 of FLA's modules, 65 with this installed (docs/performance.md, "Start-up imports"). With it,
    those three packages run their bodies at the first name taken from them (``from fla.modules import RMSNorm``,
    ``fla.ops.chunk_gla``) instead of at the first submodule import; ``fla.__version__`` is there at once. A bare
    ``import fla`` then no longer registers FLA's model types with transformers: ``import fla.models`` does. The
    first import of FLA's layers or models (FLA's classes, through the generic family) ends the deferral: FLA then
    loads everything as it does without it, in its own order. Installed by the processes that train (the rank, the
    kernel prewarm), before they import FLA."""
    if not any(isinstance(finder, _LazyPackagesFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LazyPackagesFinder(FLA_EXPORTING_PACKAGES, late=("layers", "models")))


def _fla_package_imports_everything() -> bool:
    spec = importlib.util.find_spec("fla")
    with open(spec.origin) as init:
        return "_import_optional_public_module('fla.layers')" in init.read()


def _transformers_imports_sklearn_at_top() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return False
    return _release(installed) < _release(TRANSFORMERS_LAZY_SKLEARN)


def _release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as 5.17.0 or 5.21.0.dev0."""
    parts = [int(part) for part in re.findall(r"\d+", version)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def _transformers_candidate_generator_imports_sklearn() -> bool:
    with open(importlib.util.find_spec(TRANSFORMERS_SKLEARN_MODULE).origin) as source:
        return "\nif is_sklearn_available():\n    from sklearn.metrics import roc_curve" in source.read()


def _torchtitan_compiles_at_import() -> bool:
    with open(importlib.util.find_spec(TORCHTITAN_COMPILING_MODULE).origin) as source:
        return "ClassVar[Callable] = torch.compile(" in source.read()


def _torchtitan_config_imports_torch() -> bool:
    """torchtitan.config's package body imports torch, and its job_config module imports it at the top."""
    for name in ("torchtitan.config", "torchtitan.config.job_config"):
        with open(importlib.util.find_spec(name).origin) as source:
            if not re.search(r"^import torch$", source.read(), re.MULTILINE):
                return False
    return True


def _torchtitan_init_imports_quantization() -> bool:
    spec = importlib.util.find_spec("torchtitan")
    with open(spec.origin) as init:
        return "torchtitan.components.quantization" in init.read()


def apply() -> None:
    _register_fake_process_group()
    _use_cpu_when_no_accelerator()
    _profile_cpu_only_without_gpu()


def _register_fake_process_group() -> None:
    # torchtitan's ParallelDims.build_mesh() gives size-1 mesh dims the c10d backend "fake", which torch registers
    # only when this test-support module is imported ("Unknown c10d backend type FAKE" otherwise).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def _fake_backend_unknown() -> bool:
    import torch.distributed as dist

    if "torch.testing._internal.distributed.fake_pg" in sys.modules:
        raise RuntimeError("probe needs a process that has not imported fake_pg")
    try:
        dist.init_process_group(backend="fake", store=dist.HashStore(), rank=0, world_size=1)
    except (AssertionError, RuntimeError, ValueError) as error:
        return "FAKE" in str(error).upper()
    dist.destroy_process_group()
    return False


def fsdp_sum_reductions_on_gloo(fsdp_module, mesh) -> None:
    """Make an FSDP2 module reduce gradients with plain SUM when its mesh communicates over gloo."""
    # gloo has no ReduceOp.PREMUL_SUM, which FSDP2's averaging uses, and FSDP2 averaging on gloo silently sums.
    # Summing is what flame wants anyway: the trainer divides the loss by the global token count.
    import torch.distributed as dist

    if dist.get_backend(mesh.get_group(mesh.ndim - 1)) == "gloo":
        fsdp_module.set_force_sum_reduction_for_comms(True)


def _gloo_lacks_premul_sum() -> bool:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1), op=dist._make_nccl_premul_sum(2.0))
    except (RuntimeError, ValueError) as error:
        return "PREMUL_SUM" in str(error)
    finally:
        dist.destroy_process_group()
    return False


class _CpuDeviceModule(types.SimpleNamespace):
    """The ``torch.cuda``-style calls torchtitan makes on its device module, answered for the CPU (its metrics' memory
    monitor included: the machine's memory as capacity, no allocator statistics)."""

    def __init__(self):
        super().__init__(
            set_device=lambda device: None,
            current_device=lambda: 0,
            synchronize=lambda *a: None,
            empty_cache=lambda: None,
            device_count=lambda: 1,
            get_device_name=lambda device=None: "CPU",
            get_device_properties=lambda device=None: types.SimpleNamespace(
                total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            ),
            memory_stats=lambda device=None: {},
            reset_peak_memory_stats=lambda device=None: None,
        )


def _use_cpu_when_no_accelerator() -> None:
    # torchtitan's tools/utils.get_device_info() falls back to "cuda" when torch finds no accelerator, so a CPU-only
    # run picks the NCCL backend and calls torch.cuda.set_device. Point its module-level device globals at the CPU
    # and gloo instead (its metrics' too, which torchtitan's own trainer uses: bench/torchtitan_anchor.py).
    if not _without_accelerator():
        return
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    cpu_module = _CpuDeviceModule()
    for module in (tools_utils, parallel_dims, dist_utils, metrics):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu_module


def end_failed_capture(pool: tuple[int, int]) -> None:
    """Put torch's CUDA state back as it was before a CUDA graph capture into ``pool`` that failed. torch 2.11's
    ``CUDAGraph.capture_end`` raises at ``cudaStreamEndCapture`` before it ends the capture's state: the device's
    default random generator stays capturing (every later random draw on the GPU raises "Offset increment outside
    graph capture encountered unexpectedly") and the caching allocator keeps the pool on its list of captures
    underway. The generator gets a copy of its state (its seed and offset, not capturing) and the pool's allocation
    ends."""
    import torch

    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    generator.graphsafe_set_state(generator.clone_state())
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    except RuntimeError as error:  # a release that ends the allocation itself when the capture fails
        if "not currently recording" not in str(error):
            raise


def _failed_capture_leaves_generator_capturing() -> bool:
    import torch

    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            torch.cuda.current_stream().query()  # refused in a capture
    except RuntimeError:
        pass
    try:
        torch.rand(1, device="cuda")
    except RuntimeError as error:
        end_failed_capture(pool)
        return "outside graph capture" in str(error)
    return False


def _always() -> bool:
    return True


def _without_accelerator() -> bool:
    import torch

    return not torch.accelerator.is_available()


def _with_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _without_gpu() -> bool:
    import torch

    return not (torch.cuda.is_available() or torch.xpu.is_available())


def _torchtitan_assumes_cuda() -> bool:
    import torchtitan.tools.utils as tools_utils

    found = tools_utils._get_available_device_type
    tools_utils._get_available_device_type = lambda: None
    try:
        return tools_utils.get_device_info()[0] == "cuda"
    finally:
        tools_utils._get_available_device_type = found


def _profile_cpu_only_without_gpu() -> None:
    import torch

    # torchtitan's tools/profiling.maybe_enable_profiling passes activities=[CPU, None] when neither CUDA nor XPU is
    # available, and torch.profiler.profile rejects the None ("Expected ProfilerActivity or dict"). Give that module
    # a torch whose profiler drops it.
    if not _without_gpu():
        return
    import torchtitan.tools.profiling as profiling

    class CpuProfile(torch.profiler.profile):
        def __init__(self, *args, activities=None, **kwargs):
            super().__init__(
                *args, activities=[a for a in activities or () if a is not None] or None, **kwargs
            )

    class TorchWithCpuProfiler(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    patched = TorchWithCpuProfiler("torch")
    patched.profiler = types.SimpleNamespace(
        profile=CpuProfile, schedule=torch.profiler.schedule, ProfilerActivity=torch.profiler.ProfilerActivity
    )
    profiling.torch = patched


def _profiler_rejects_none_activity() -> bool:
    import torch

    try:
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, None])
    except TypeError:
        return True
    return False


def serve_gated_dqkwg_on_hopper(kernel: Callable) -> None:
    """Register ``kernel`` (flame's Triton chunk_bwd_dqkwg) with FLA's 'common' backend registry where FLA refuses
    its own (idempotent), ahead of FLA's TileLang kernel (which FLA turns on by default on Hopper where tilelang and
    nvcc are there): on an H100 flame's takes 0.53 ms a call against TileLang's 0.66 at gated_deltanet_340M's heads,
    and a fresh machine's first step skips TileLang's nvcc compile
    (docs/performance.md, "flame's dq/dk/dw/dg kernel"). TileLang's serves the calls flame's refuses."""
    import torch

    global _hopper_backend_registered
    if _hopper_backend_registered or not fla_refuses_gated_dqkwg_here():
        return
    from fla.backends import BaseBackend, TileLangBackend, register

    @register("common")
    class FlameHopperBackend(BaseBackend):
        backend_type = "flame_hopper_dqkwg"
        priority = TileLangBackend.priority - 1  # ahead of FLA's TileLang backend and its Triton default

        def chunk_bwd_dqkwg_verifier(self, *args, g=None, g_gamma=None, **kwargs) -> tuple[bool, str | None]:
            if g is None or g_gamma is not None:
                return False, "flame's Hopper backward serves the gated case only"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            # The named range makes its share of a step visible in torch.profiler tables.
            with torch.profiler.record_function("flame_chunk_bwd_dqkwg"):
                return kernel(*args, **kwargs)

    _hopper_backend_registered = True


_hopper_backend_registered = False

# The Triton releases on which FLA refuses its gated chunk_bwd_dqkwg on Hopper (FLA's own guard).
HOPPER_DQKWG_TRITON = (">=3.4.0", "<3.7.1")


def fla_refuses_gated_dqkwg_here() -> bool:
    """True on the GPUs where FLA refuses its gated chunk_bwd_dqkwg (Hopper, Triton in HOPPER_DQKWG_TRITON)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _fla_guards_hopper_dqkwg() -> bool:
    spec = importlib.util.find_spec("fla.ops.common.chunk_o")
    with open(spec.origin) as source:
        return "see #640" in source.read()


def _fla_ops_disable_compile() -> bool:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return getattr(chunk_gated_delta_rule, "_torchdynamo_disable", False)


def _fla_globals_holding(value: object, package: str) -> list[tuple[types.ModuleType, str]]:
    """(module, attribute) of every imported module of ``package`` (a dotted FLA package) that holds ``value``:
    FLA's modules import its classes and functions by name, so a replacement has to reach each one."""
    return [
        (module, attribute)
        for name, module in list(sys.modules.items())
        if (name == package or name.startswith(package + ".")) and module is not None
        for attribute, held in list(vars(module).items())
        if held is value
    ]


@contextlib.contextmanager
def fla_layers_on_flame(replacements: dict[str, tuple[str, str | None]]) -> Iterator[None]:
    """While FLA's model classes are built inside this context, the FLA layers named in ``replacements``
    ("module.Class" -> ("flame.module.Class", fast-path attribute)) whose module's fast-path attribute is missing or
    empty (flash-attn's ``flash_attn_func``, mamba_ssm's ``is_fast_path_available``), or is None, are built as flame's
    class of the same parameters instead (the generic family passes FLA_LAYER_REPLACEMENTS); where the fast path
    imports, FLA's own layers are built. Every ``fla.models`` module that holds the layer class under any name sees
    the replacement until the context exits, so FLA's classes built outside it (an export loaded by transformers) are
    FLA's own."""
    swapped = []
    try:
        for qualified_name, (replacement_name, fast_path) in replacements.items():
            module_name, class_name = qualified_name.rsplit(".", 1)
            layer_module = sys.modules.get(module_name)
            # Not imported: no FLA model class is registered that could build it (fla.models imports every layer).
            if layer_module is None or (fast_path is not None and getattr(layer_module, fast_path, None)):
                continue
            replacement_module, replacement_class = replacement_name.rsplit(".", 1)
            replacement = getattr(importlib.import_module(replacement_module), replacement_class)
            fla_class = getattr(layer_module, class_name)
            for module, attribute in _fla_globals_holding(fla_class, "fla.models"):
                setattr(module, attribute, replacement)
                swapped.append((module, attribute, fla_class))
        yield
    finally:
        for module, attribute, fla_class in swapped:
            setattr(module, attribute, fla_class)


def fla_deltaformer_on_flame(attention_op: Callable) -> None:
    """Where flash-attn is not importable, FLA's DeltaFormer layer calls ``attention_op`` (flame's
    ``deltaformer_attention``: FLA's op with its last step on flame's attention) in place of FLA's
    ``deltaformer_attn``, which raises there at the first forward. FLA's layer modules are patched for the process,
    so FLA's own DeltaFormer class (an export loaded by transformers) runs on it too; where flash-attn imports,
    nothing changes."""
    _fla_op_on_flame("fla.ops.deltaformer.parallel", "flash_attn_func", "deltaformer_attn", attention_op)


def _fla_op_on_flame(op_module_name: str, flash_attn_name: str, op_name: str, replacement: Callable) -> None:
    """Where FLA's op module holds no flash-attn function ``flash_attn_name`` (flash-attn is not importable),
    every FLA layer module that holds its op ``op_name`` holds ``replacement`` instead, for the process."""
    op_module = sys.modules.get(op_module_name)
    if op_module is None or getattr(op_module, flash_attn_name, None) is not None:
        return
    for module, attribute in _fla_globals_holding(getattr(op_module, op_name), "fla.layers"):
        setattr(module, attribute, replacement)


def _fla_deltaformer_needs_flash_attn() -> bool:
    return _sources_contain(
        ("fla.ops.deltaformer.parallel",), "if flash_attn_func is None:", "flash_attn_func(q, k, u"
    )


# FLA 0.6.0's modules that call flash-attn's functions for causal (sliding-window) attention and have no other
# path: rodimus' sliding-window shared-key attention, NativeSparseAttention's sliding-window branch, MoBA's padded
# and decoding paths, multi-head latent attention (which also refuses to be built while the name is None).
FLA_FLASH_ATTN_CALLERS = ("fla.layers.rodimus", "fla.ops.nsa.parallel", "fla.layers.moba", "fla.layers.mla")


def fla_flash_attn_calls_on_flame(functions: dict[str, Callable]) -> None:
    """Where flash-attn is not importable, the modules of FLA_FLASH_ATTN_CALLERS call ``functions`` (flame's
    ``flash_attn_func`` and ``flash_attn_varlen_func``, on flame's attention) in place of flash-attn's, which they
    hold as None or not at all; for the process, as fla_deltaformer_on_flame. Where flash-attn imports, nothing changes."""
    for module_name in FLA_FLASH_ATTN_CALLERS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, function in functions.items():
            # None, or not bound at all: rodimus binds no flash_attn_varlen_func without flash-attn.
            if getattr(module, name, None) is None:
                setattr(module, name, function)


# The name under which transformers' Gated DeltaNet modules hold their hooked chunk op.
TRANSFORMERS_GATED_DELTA_RULE = "torch_chunk_gated_delta_rule"


def transformers_gated_delta_rule_on_flame(op: Callable) -> None:
    """transformers' Gated DeltaNet layers (qwen3_next, qwen3_5, olmo_hybrid, ...) call their module's
    ``torch_chunk_gated_delta_rule``, which transformers hooks to FLA's op wherever fla imports. In every imported
    transformers model module that has it, calls under torch.compile and calls with tensors off the GPU go to ``op``
    (flame's ``chunk_gated_delta_rule`` with transformers' arguments) for the process; eager GPU calls stay on the hook.
    Compiled, the hook ran transformers' PyTorch reference: an H200 profile of a compiled olmo_hybrid step
    (docs/models.md) held ~3,500 small matmuls per step and no FLA kernel, at 44.6 GiB against 17.3 GiB eager.
    Off the GPU it hands CPU tensors to FLA's Triton kernels, which need a GPU. flame's op compiles into the block's
    graph (flame.ops.fla_library) and runs its PyTorch implementation on the CPU."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        hook = getattr(module, TRANSFORMERS_GATED_DELTA_RULE, None)
        if hook is not None and not getattr(hook, "flame_routes", False):
            setattr(module, TRANSFORMERS_GATED_DELTA_RULE, _compiled_and_cpu_calls_on(op, hook))


def _compiled_and_cpu_calls_on(op: Callable, hook: Callable) -> Callable:
    import torch

    @functools.wraps(hook)
    def gated_delta_rule(query, *args, **kwargs):
        if torch.compiler.is_compiling() or query.device.type != "cuda":
            return op(query, *args, **kwargs)
        return hook(query, *args, **kwargs)

    gated_delta_rule.flame_routes = True
    return gated_delta_rule


def transformers_grouped_mm_in_the_autocast_dtype() -> None:
    """transformers' mixture-of-experts layers multiply by their experts' weights with ``grouped_mm``, which autocast
    does not cast (pytorch issue 174763, which transformers' ``_grouped_mm`` cites): with float32 parameters under
    bfloat16 autocast (flame's step) an eager call multiplies in float32, and under torch.compile, where transformers
    takes grouped_mm for bfloat16 weights only, a call runs transformers' fallback (a Python loop of one matmul per
    expert, whose backward inductor fails to compile: an H200 profile of compiled qwen3_next fell back to eager for
    it, docs/models.md). After this call (idempotent, for the process) a call under autocast on its weights' device
    casts the input and the weights to autocast's dtype first, as autocast does for a matmul; outside autocast
    nothing changes."""
    import torch

    module = importlib.import_module("transformers.integrations.moe")
    grouped_mm = module._grouped_mm
    if getattr(grouped_mm, "flame_autocast", False):
        return

    @functools.wraps(grouped_mm)
    def in_the_autocast_dtype(input, weight, offs):
        device = weight.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            input, weight = input.to(dtype), weight.to(dtype)
        return grouped_mm(input, weight, offs)

    in_the_autocast_dtype.flame_autocast = True
    module._grouped_mm = in_the_autocast_dtype


def _transformers_grouped_mm_skips_autocast() -> bool:
    from transformers.integrations import moe

    return not getattr(moe._grouped_mm, "flame_autocast", False) and _sources_contain(
        ("transformers.integrations.moe",),
        "torch.nn.functional.grouped_mm and torch._grouped_mm are not autocast-enabled",
        "return torch.nn.functional.grouped_mm(input.to(weight.dtype), weight, offs=offs)",
    )


def _transformers_hooks_gated_delta_rule_to_fla() -> bool:
    import inspect

    from transformers.models.olmo_hybrid import modeling_olmo_hybrid

    hook = getattr(modeling_olmo_hybrid, TRANSFORMERS_GATED_DELTA_RULE)
    if getattr(hook, "flame_routes", False):
        hook = hook.__wrapped__
    implementation = inspect.getclosurevars(hook).nonlocals.get("implementation")
    return getattr(implementation, "__module__", "").startswith("fla.")


def _sources_contain(module_names: tuple[str, ...], *texts: str) -> bool:
    """Whether each module's source file holds every one of ``texts``."""
    for module_name in module_names:
        with open(importlib.util.find_spec(module_name).origin) as source:
            text = source.read()
        if not all(needle in text for needle in texts):
            return False
    return True


def fla_moba_on_flame(moba_op: Callable) -> None:
    """Where flash-attn is not importable, FLA's MoBA layer calls ``moba_op`` (flame's ``parallel_moba``, one masked
    attention per document) in place of FLA's, which raises there at the first forward; for the process, as
    fla_deltaformer_on_flame. Where flash-attn imports, nothing changes.

    FLA's layer passes the op the larger of its rows' length and its ``max_position_embeddings`` as ``max_seqlen``
    (a bound, which flash-attn takes). flame's op attends rows of one length in one call, without reading
    ``cu_seqlens`` (which a compiled block or a CUDA graph cannot), only where ``max_seqlen`` is that length, so
    the layers built after this call keep no ``max_position_embeddings``: they pass their rows' length, and size the
    rotary table they cache by the longest input instead (the same cos and sin values)."""
    _fla_op_on_flame("fla.ops.moba.parallel", "flash_attn_varlen_func", "parallel_moba", moba_op)
    layer_module = sys.modules.get("fla.layers.moba")
    if layer_module is None or layer_module.parallel_moba is not moba_op:
        return
    init = layer_module.MoBA.__init__
    if getattr(init, "flame_rows_length", False):
        return

    @functools.wraps(init)
    def rows_length(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.max_position_embeddings = None

    rows_length.flame_rows_length = True
    layer_module.MoBA.__init__ = rows_length


def _fla_moba_needs_flash_attn() -> bool:
    return _sources_contain(("fla.ops.moba.parallel",), "`parallel_moba` requires `flash-attn`")


# FLA 0.6.0's modules that compute the attention backward's delta with fla.ops.attn.parallel's function.
FLA_ATTENTION_DELTA_MODULES = (
    "fla.ops.attn.parallel",
    "fla.ops.nsa.parallel",
    "fla.ops.nsa.compression",
    "fla.ops.path_attn.parallel",
)


def fla_attention_delta_on_flame(delta_op: Callable) -> None:
    """FLA 0.6.0's parallel attention backwards (softmax attention, NSA, PaTH; its TileLang attention too) compute
    delta = rowsum(o * do) with ``parallel_attn_bwd_preprocess``, which launches one program per row: 0.63 ms a call
    at NSA's 64 heads x 8 x 2048 rows on an H200. After this call (idempotent, for the process) every FLA module
    that holds the function calls ``delta_op`` (flame's ``attention_delta``: the same sums, rows in tiles) instead."""
    # Imported first, so that every module holding FLA's function is among those _fla_globals_holding finds.
    modules = [importlib.import_module(name) for name in FLA_ATTENTION_DELTA_MODULES]
    original = modules[0].parallel_attn_bwd_preprocess
    if getattr(original, "flame_attention_delta", False):
        return

    def attention_delta(o, do):
        return delta_op(o, do)

    attention_delta.flame_attention_delta = True
    for module, attribute in _fla_globals_holding(original, "fla.ops"):
        setattr(module, attribute, functools.wraps(original)(attention_delta))


def fla_functions_traced_under_compile(torch_versions: Mapping[str, Callable]) -> None:
    """FLA 0.6.0's norms and activations (``rms_norm``, ``swish``, ``swiglu`` ...: "module.function" keys) run
    Triton kernels inside autograd Functions that dynamo does not trace, so each call in a compiled block is a graph
    break. After this call (idempotent, for the process) every FLA module holding one of them, and FLA's ``ACT2FN``,
    hold a function that runs its PyTorch version (the value: the same arguments and results, which inductor fuses
    with the code around it) while torch.compile traces, and FLA's kernel otherwise."""
    import torch

    activations = importlib.import_module("fla.modules.activations.ops").ACT2FN
    for dotted, torch_version in torch_versions.items():
        module_name, name = dotted.rsplit(".", 1)
        original = getattr(importlib.import_module(module_name), name)
        if getattr(original, "flame_traced_under_compile", False):
            continue

        @functools.wraps(original)
        def traced(*args, _original=original, _torch_version=torch_version, **kwargs):
            if torch.compiler.is_compiling():
                return _torch_version(*args, **kwargs)
            return _original(*args, **kwargs)

        traced.flame_traced_under_compile = True
        for holder, attribute in _fla_globals_holding(original, "fla"):
            setattr(holder, attribute, traced)
        for key, held in list(activations.items()):
            if held is original:
                activations[key] = traced


def fla_ops_opaque_to_compile() -> None:
    """FLA 0.6.0 marks 31 of the 60 ops of ``fla.ops.__all__`` ``torch.compiler.disable``: a compiled block calls
    their Triton kernels as its eager run does. Into the others (``parallel_parallax``, ``parallel_nsa``,
    ``parallel_stickbreaking_attn``, ``parallel_wall_attn``, the fused recurrent forms ...) dynamo traces, and
    inductor compiles their autograd Functions' Triton kernels again: parallax's and NSA's failed to compile (their
    blocks' CUDA graphs then captured them uncompiled) and stick-breaking attention's loss was NaN (H200, torch 2.11).
    After this call (idempotent, for the process) every FLA module holding one of the others holds it marked too, so
    inductor compiles the code around FLA's op and the op runs FLA's kernels unchanged."""
    import torch

    ops = importlib.import_module("fla.ops")
    for name in ops.__all__:
        op = getattr(ops, name)
        if getattr(op, "_torchdynamo_disable", False):
            continue
        opaque = torch.compiler.disable(op)
        opaque.flame_opaque_to_compile = True
        for holder, attribute in _fla_globals_holding(op, "fla"):
            setattr(holder, attribute, opaque)


def _fla_ops_traced_by_compile() -> bool:
    modules = ("fla.ops.parallax.parallel", "fla.ops.nsa.parallel", "fla.ops.stickbreaking_attn.parallel")
    return not any(_sources_contain((module,), "torch.compiler.disable") for module in modules)


def fla_rotary_tables_traced_under_compile() -> None:
    """FLA 0.6.0's RotaryEmbedding rebuilds its cached cos/sin tables when they are too short, on another device or
    dtype, or inference tensors while training: ``Tensor.is_inference()``, which dynamo does not trace, so a
    compiled block holding FLA's rotary breaks its graph at every call once the tables exist. After this call
    (idempotent, for the process) the tables are rebuilt, while torch.compile traces, under the other conditions
    only (flame makes no inference-mode tensors: its evaluation runs under no_grad); eagerly, as FLA does."""
    import torch
    from fla.modules.rotary.ops import RotaryEmbedding

    update = RotaryEmbedding._update_cos_sin_cache
    if getattr(update, "flame_traced_under_compile", False):
        return

    @functools.wraps(update)
    def traced(self, seqlen, device=None, dtype=None):
        if torch.compiler.is_compiling() and not (
            seqlen > self._seq_len_cached
            or self._cos_cached is None
            or self._cos_cached.device != device
            or self._cos_cached.dtype != dtype
        ):
            return
        update(self, seqlen, device=device, dtype=dtype)

    traced.flame_traced_under_compile = True
    RotaryEmbedding._update_cos_sin_cache = traced


def _fla_rotary_tables_checked_by_is_inference() -> bool:
    return _sources_contain(("fla.modules.rotary.ops",), "self._cos_cached.is_inference()")


def _fla_functions_opaque_to_compile() -> bool:
    return _sources_contain(
        ("fla.modules.norm.layernorm",), "return LayerNormFunction.apply(x, weight, bias"
    ) and _sources_contain(("fla.modules.activations.ops",), "swish = SwishFunction.apply")


def _fla_attention_delta_one_program_per_row() -> bool:
    return _sources_contain(
        ("fla.ops.attn.parallel",), "parallel_attn_bwd_kernel_preprocess[(delta.numel(),)]("
    )


def fla_rodimus_blocks_follow_the_model() -> None:
    """FLA 0.6.0's RodimusBlock takes ``block_residual_in_fp32`` from the config's ``residual_in_fp32`` (True by
    default) where RodimusModel takes the config's ``block_residual_in_fp32`` (False by default): with the default
    config every block after the first asserts a residual the model never passes, and the first returns a tuple the
    model adds as a tensor. Blocks built after this call take the config's ``block_residual_in_fp32``, as the model
    does; for the process, so FLA's own class (an export loaded by transformers) builds consistent blocks too."""
    from fla.models.rodimus.modeling_rodimus import RodimusBlock

    init = RodimusBlock.__init__
    if getattr(init, "flame_follows_the_model", False):
        return

    @functools.wraps(init)
    def follow_the_model(self, config, layer_idx):
        init(self, config, layer_idx)
        self.block_residual_in_fp32 = config.block_residual_in_fp32

    follow_the_model.flame_follows_the_model = True
    RodimusBlock.__init__ = follow_the_model


# The packed documents' boundaries while FLA's LinearAttentionForCausalLM runs (its model does not hand them on).
_linear_attn_cu_seqlens: contextvars.ContextVar = contextvars.ContextVar(
    "linear_attn_cu_seqlens", default=None
)


def fla_linear_attn_hands_layers_cu_seqlens() -> None:
    """FLA 0.6.0's LinearAttentionForCausalLM takes ``cu_seqlens`` among its keyword arguments but calls its model
    without them, and LinearAttentionModel calls its blocks without them, so its layers, which take them, scan packed
    documents as one sequence (H200 survey, 2026-12-02: 7.6e-2 of the logits' scale). For the process: the causal
    LM's forward keeps its ``cu_seqlens`` while it runs and each block called without them receives them."""
    from fla.models.linear_attn import modeling_linear_attn as modeling

    lm_forward = modeling.LinearAttentionForCausalLM.forward
    if getattr(lm_forward, "flame_hands_cu_seqlens", False):
        return
    block_forward = modeling.LinearAttentionBlock.forward

    @functools.wraps(lm_forward)
    def keeps_cu_seqlens(self, *args, **kwargs):
        token = _linear_attn_cu_seqlens.set(kwargs.get("cu_seqlens"))
        try:
            return lm_forward(self, *args, **kwargs)
        finally:
            _linear_attn_cu_seqlens.reset(token)

    @functools.wraps(block_forward)
    def receives_cu_seqlens(self, *args, **kwargs):
        cu_seqlens = _linear_attn_cu_seqlens.get()
        if cu_seqlens is not None and kwargs.get("cu_seqlens") is None:
            kwargs["cu_seqlens"] = cu_seqlens
        return block_forward(self, *args, **kwargs)

    keeps_cu_seqlens.flame_hands_cu_seqlens = True
    modeling.LinearAttentionForCausalLM.forward = keeps_cu_seqlens
    modeling.LinearAttentionBlock.forward = receives_cu_seqlens


def _fla_linear_attn_model_drops_cu_seqlens() -> bool:
    import inspect

    from fla.models.linear_attn.modeling_linear_attn import LinearAttentionModel

    return "kwargs" not in inspect.signature(LinearAttentionModel.forward).parameters


# TileLang's attention kernels tile a head's channels in blocks of 16: FLA 0.6.0's parallel_attn (its
# fla/ops/attn/backends/tilelang/parallel.py, BK = ceil(K / 16) * 16) copies a head of another width into a larger
# shared tile, which TileLang refuses to compile ("Shared tile and global tile shape mismatch: 32 != 24").
TILELANG_ATTENTION_HEAD_MULTIPLE = 16
# Its forward copies the float32 scores into a probabilities fragment of the inputs' dtype for the second GEMM; in
# float32 the two fragments' layouts conflict and TileLang refuses the kernel ("Layout infer conflict between b_s and
# b_p in T.Parallel loop", H200, 2026-12-02: every float32 call of scripts/fla_varlen_survey.py that reached it).
TILELANG_ATTENTION_DTYPES = ("float16", "bfloat16")


def fla_tilelang_attention_takes_what_it_compiles() -> None:
    """FLA 0.6.0 turns its TileLang attention backend on by default on Hopper and accepts every head width and
    float32 for it, so a forgetting transformer with 24-channel heads (FLA's default 32 heads at hidden 768), or any
    float32 call, stops in TileLang's compiler where FLA's Triton kernel serves it. After this call (idempotent, for
    the process) the backend's verifiers refuse heads whose key or value width is not a multiple of 16 and inputs
    that are not 16-bit, and FLA's dispatch falls back to its Triton kernel with its one log line."""
    from fla.ops.attn.backends.tilelang import AttnTileLangBackend

    for name in ("parallel_attn_fwd_verifier", "parallel_attn_bwd_verifier"):
        verifier = getattr(AttnTileLangBackend, name)
        if getattr(verifier, "flame_compiles", False):
            continue

        def takes_what_it_compiles(self, q, k, v, *args, _verifier=verifier, **kwargs):
            widths = (q.shape[-1], v.shape[-1])
            if any(width % TILELANG_ATTENTION_HEAD_MULTIPLE for width in widths):
                return False, (
                    f"TileLang's attention takes head widths that are multiples of {TILELANG_ATTENTION_HEAD_MULTIPLE}, "
                    f"not {widths[0]} (keys) and {widths[1]} (values); fall back to Triton"
                )
            if str(q.dtype).removeprefix("torch.") not in TILELANG_ATTENTION_DTYPES:
                return (
                    False,
                    f"TileLang's attention compiles for 16-bit inputs, not {q.dtype}; fall back to Triton",
                )
            return _verifier(self, q, k, v, *args, **kwargs)

        takes_what_it_compiles.flame_compiles = True
        setattr(AttnTileLangBackend, name, functools.wraps(verifier)(takes_what_it_compiles))


def _fla_tilelang_attention_takes_what_it_cannot_compile() -> bool:
    import torch
    from fla.ops.attn.backends.tilelang import AttnTileLangBackend

    verifier = AttnTileLangBackend.parallel_attn_fwd_verifier
    verifier = getattr(verifier, "__wrapped__", verifier)  # FLA's own, where flame's wraps it in this process
    narrow = torch.empty(1, 64, 2, 24, device="meta", dtype=torch.bfloat16)
    wide = torch.empty(1, 64, 2, 64, device="meta", dtype=torch.float32)
    return any(verifier(AttnTileLangBackend(), q, q, q, None, None, 0.1)[0] for q in (narrow, wide))


def fla_log_linear_scales_in_the_inputs_dtype() -> None:
    """FLA 0.6.0's LogLinearMamba2 layer passes its level scales in its parameter's dtype (``softplus(L * dl)
    .to(L.dtype)``) to a forward kernel that multiplies them into a bf16 tile and then takes that tile and the bf16
    values in one ``tl.dot``: with float32 parameters under bf16 autocast (flame's one-GPU step, any mixed-precision
    loop) the kernel does not compile (Triton: "at 177:18", both operands must have one dtype). After this call
    (idempotent, for the process) the layer's module passes the scales in the queries' dtype, as a bf16 model passes
    them; autograd casts their gradient back."""
    module = importlib.import_module("fla.layers.log_linear_mamba2")
    op = module.chunk_log_linear_attn
    if getattr(op, "flame_scales_cast", False):
        return

    def scales_in_the_inputs_dtype(q, k, v, g, level_scales, *args, **kwargs):
        return op(q, k, v, g, level_scales.to(q.dtype), *args, **kwargs)

    scales_in_the_inputs_dtype.flame_scales_cast = True
    module.chunk_log_linear_attn = functools.wraps(op)(scales_in_the_inputs_dtype)


def fla_log_linear_masks_built_once() -> None:
    """FLA 0.6.0's log-linear attention builds its level lookup table and level masks (functions of the chunk size
    and the device only) on the host at every call, per layer, forward and backward, and copies them to the GPU: a
    host-bound step, and blocks that cannot be captured as CUDA graphs (a host-to-GPU copy during capture). After
    this call (idempotent, for the process) each is built once per chunk size and device and reused; FLA's op only
    reads them."""
    chunk = importlib.import_module("fla.ops.log_linear_attn.chunk")
    for name in ("level_lut", "masks"):
        function = getattr(chunk, name)
        if not hasattr(function, "cache_info"):
            setattr(chunk, name, functools.lru_cache(maxsize=None)(function))


def _fla_log_linear_builds_masks_per_call() -> bool:
    from fla.ops.log_linear_attn import chunk

    built_per_call = not hasattr(chunk.level_lut, "cache_info") and not hasattr(chunk.masks, "cache_info")
    return built_per_call and _sources_contain(
        ("fla.ops.log_linear_attn.chunk",),
        "ctx.llut = level_lut(BT, v.device)",
        "mask = masks(chunk_size, v.device)",
    )


def _fla_log_linear_passes_scales_in_the_parameters_dtype() -> bool:
    return _sources_contain(
        ("fla.layers.log_linear_mamba2",), 'rearrange(L, "h ell -> 1 1 h ell") * dl).to(L.dtype)'
    ) and _sources_contain(
        ("fla.ops.log_linear_attn.chunk",), "b_s = (tl.dot(b_q, b_k) * b_s).to(b_q.dtype) * b_h"
    )


def _fla_rodimus_block_reads_residual_in_fp32() -> bool:
    return _sources_contain(
        ("fla.models.rodimus.modeling_rodimus",), "self.block_residual_in_fp32 = config.residual_in_fp32"
    )


def _fla_flash_attn_callers_need_flash_attn() -> bool:
    return _sources_contain(FLA_FLASH_ATTN_CALLERS, "from flash_attn import", "flash_attn_func(")


# FLA 0.6.0's layer modules that call flash-attn: each refuses to build or run when it is not importable.
FLA_FLASH_ATTN_MODULES = ("fla.layers.attn", "fla.layers.bitattn")


def _fla_mamba2_scan_materialises_pairs() -> bool:
    import inspect

    from fla.layers.mamba2 import Mamba2

    return "G_intermediate" in inspect.getsource(Mamba2.torch_forward)


def contiguous_gradient() -> type:
    """An autograd Function whose ``apply(x)`` is ``x`` itself, with its gradient made contiguous on the way back.
    AOTAutograd traces a backward with the strides PyTorch's meta functions give, and ``softplus_backward``'s meta
    gives a contiguous result where the kernel keeps the layout of the gradient it receives: the traced backward then
    views a tensor whose real strides do not allow it (``--compile.backend aot_eager``, pytorch/pytorch#120035). The
    Gated DeltaNet gate's gradient arrives transposed from the PyTorch chunked rule, so its softplus gets a contiguous
    one (flame.ops.gated_delta_rule.gate)."""
    import torch

    class ContiguousGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    return ContiguousGradient


def _softplus_backward_meta_strides_differ() -> bool:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad, x = torch.randn(2, 3, 5).transpose(1, 2), torch.randn(2, 5, 3)
    real = torch.ops.aten.softplus_backward(grad, x, 1, 20).stride()
    with FakeTensorMode() as mode:
        fake = torch.ops.aten.softplus_backward(mode.from_tensor(grad), mode.from_tensor(x), 1, 20).stride()
    return real != fake


def _fla_attention_needs_flash_attn() -> bool:
    return _sources_contain(
        FLA_FLASH_ATTN_MODULES, "from flash_attn import", "Please install Flash Attention"
    )


SHIMS = (
    Shim(
        name="fake_process_group",
        applies=_always,
        upstream="pytorch/torchtitan#2236, #2275",
        fixed_in=None,
        workaround="_register_fake_process_group",
        reproduces=_fake_backend_unknown,
    ),
    Shim(
        name="torchtitan_job_config",
        applies=_always,
        upstream="not filed: torchtitan 0.2.2's __init__.py imports its quantization converters",
        fixed_in=None,
        workaround="torchtitan_job_config",
        reproduces=_torchtitan_init_imports_quantization,
    ),
    Shim(
        name="torchtitan_config_imports_torch",
        applies=_always,
        upstream="not filed: torchtitan 0.2.2's config/__init__.py imports torch for TORCH_DTYPE_MAP and "
        "config/job_config.py imports torch without using it",
        fixed_in=None,
        workaround="_import_job_config_without_torch",
        reproduces=_torchtitan_config_imports_torch,
    ),
    Shim(
        name="torchtitan_import_compile",
        applies=_always,
        upstream="not filed: torchtitan 0.2.2's models/attention.py compiles flex_attention in a class body at import",
        fixed_in=None,
        workaround="defer_torchtitan_import_compile",
        reproduces=_torchtitan_compiles_at_import,
    ),
    Shim(
        name="transformers_sklearn_import",
        applies=_transformers_imports_sklearn_at_top,
        upstream="not filed: transformers' generation/candidate_generator.py imports scikit-learn at its top",
        fixed_in=f"transformers {TRANSFORMERS_LAZY_SKLEARN}",
        workaround="defer_transformers_sklearn_import",
        reproduces=_transformers_candidate_generator_imports_sklearn,
    ),
    Shim(
        name="fla_package_imports",
        applies=_always,
        upstream="not filed: FLA 0.6.0's fla/__init__.py imports fla.layers and fla.models, fla/ops/__init__.py every op",
        fixed_in=None,
        workaround="defer_fla_package_imports",
        reproduces=_fla_package_imports_everything,
    ),
    Shim(
        name="fsdp_gloo_premul_sum",
        applies=_always,
        upstream="pytorch/pytorch#162338",
        fixed_in=None,
        workaround="fsdp_sum_reductions_on_gloo",
        reproduces=_gloo_lacks_premul_sum,
    ),
    Shim(
        name="torchtitan_cpu_device",
        applies=_without_accelerator,
        upstream="not filed: torchtitan 0.2.2 tools/utils.get_device_info() falls back to cuda",
        fixed_in=None,
        workaround="_use_cpu_when_no_accelerator",
        reproduces=_torchtitan_assumes_cuda,
    ),
    Shim(
        name="torchtitan_cpu_profiler",
        applies=_without_gpu,
        upstream="not filed: torchtitan 0.2.2 tools/profiling passes a None activity without a GPU",
        fixed_in=None,
        workaround="_profile_cpu_only_without_gpu",
        reproduces=_profiler_rejects_none_activity,
    ),
    Shim(
        name="fla_hopper_dqkwg",
        applies=_always,
        upstream="fla-org/flash-linear-attention#640 (Triton miscompiles tl.trans of a wgmma accumulator)",
        fixed_in="triton 3.7.1",
        workaround="serve_gated_dqkwg_on_hopper",
        reproduces=_fla_guards_hopper_dqkwg,
    ),
    Shim(
        name="fla_compiler_disable",
        applies=_always,
        upstream="not filed: FLA 0.6.0 wraps its public ops in torch.compiler.disable",
        fixed_in=None,
        workaround="flame.ops.fla_library (FLA's gated delta rule as torch.library custom ops)",
        reproduces=_fla_ops_disable_compile,
    ),
    Shim(
        name="fla_deltaformer_flash_attn",
        applies=_always,
        upstream="not filed: FLA 0.6.0's deltaformer_attn runs its last softmax attention only on flash-attn",
        fixed_in=None,
        workaround="fla_deltaformer_on_flame",
        reproduces=_fla_deltaformer_needs_flash_attn,
    ),
    Shim(
        name="fla_windowed_attention_flash_attn",
        applies=_always,
        upstream="not filed: FLA 0.6.0's rodimus, NSA, MoBA and MLA layers call flash-attn's functions, no other path",
        fixed_in=None,
        workaround="fla_flash_attn_calls_on_flame",
        reproduces=_fla_flash_attn_callers_need_flash_attn,
    ),
    Shim(
        name="fla_rodimus_block_residual",
        applies=_always,
        upstream="not filed: FLA 0.6.0's RodimusBlock reads block_residual_in_fp32 from residual_in_fp32, "
        "so rodimus' default config fails at its second block",
        fixed_in=None,
        workaround="fla_rodimus_blocks_follow_the_model",
        reproduces=_fla_rodimus_block_reads_residual_in_fp32,
    ),
    Shim(
        name="fla_linear_attn_cu_seqlens",
        applies=_always,
        upstream="not filed: FLA 0.6.0's LinearAttentionForCausalLM and LinearAttentionModel do not hand cu_seqlens "
        "to their blocks, so packed documents see each other",
        fixed_in=None,
        workaround="fla_linear_attn_hands_layers_cu_seqlens",
        reproduces=_fla_linear_attn_model_drops_cu_seqlens,
    ),
    Shim(
        name="fla_tilelang_attention_inputs",
        applies=_always,
        upstream="not filed: FLA 0.6.0's TileLang parallel_attn (on by default on Hopper) accepts head widths (not "
        "multiples of 16) and float32 inputs its kernel cannot compile",
        fixed_in=None,
        workaround="fla_tilelang_attention_takes_what_it_compiles",
        reproduces=_fla_tilelang_attention_takes_what_it_cannot_compile,
    ),
    Shim(
        name="fla_log_linear_scales_dtype",
        applies=_always,
        upstream="not filed: FLA 0.6.0's LogLinearMamba2 passes float32 level scales (its parameter's dtype) to a "
        "forward kernel that compiles only with them in the inputs' dtype",
        fixed_in=None,
        workaround="fla_log_linear_scales_in_the_inputs_dtype",
        reproduces=_fla_log_linear_passes_scales_in_the_parameters_dtype,
    ),
    Shim(
        name="fla_log_linear_masks_per_call",
        applies=_always,
        upstream="not filed: FLA 0.6.0's log-linear attention builds its level masks on the host and copies them "
        "to the GPU at every call",
        fixed_in=None,
        workaround="fla_log_linear_masks_built_once",
        reproduces=_fla_log_linear_builds_masks_per_call,
    ),
    Shim(
        name="fla_moba_flash_attn",
        applies=_always,
        upstream="not filed: FLA 0.6.0's parallel_moba runs only on flash-attn",
        fixed_in=None,
        workaround="fla_moba_on_flame",
        reproduces=_fla_moba_needs_flash_attn,
    ),
    Shim(
        name="fla_attention_delta_per_row",
        applies=_always,
        upstream="not filed: FLA 0.6.0's parallel_attn_bwd_preprocess launches one program per row of the output",
        fixed_in=None,
        workaround="fla_attention_delta_on_flame",
        reproduces=_fla_attention_delta_one_program_per_row,
    ),
    Shim(
        name="fla_functions_opaque_to_compile",
        applies=_always,
        upstream="not filed: FLA 0.6.0's norms and activations run Triton in autograd Functions dynamo does not trace",
        fixed_in=None,
        workaround="fla_functions_traced_under_compile",
        reproduces=_fla_functions_opaque_to_compile,
    ),
    Shim(
        name="fla_ops_traced_by_compile",
        applies=_always,
        upstream="not filed: FLA 0.6.0 marks 31 of its 60 public ops torch.compiler.disable; dynamo traces into the "
        "others' Triton kernels, which inductor failed to compile (parallax, NSA) or ran to a NaN loss "
        "(stick-breaking attention)",
        fixed_in=None,
        workaround="fla_ops_opaque_to_compile",
        reproduces=_fla_ops_traced_by_compile,
    ),
    Shim(
        name="fla_rotary_tables_is_inference",
        applies=_always,
        upstream="not filed: dynamo (torch 2.11, 2.13) does not trace Tensor.is_inference(), which FLA 0.6.0's "
        "RotaryEmbedding calls before each rotation",
        fixed_in=None,
        workaround="fla_rotary_tables_traced_under_compile",
        reproduces=_fla_rotary_tables_checked_by_is_inference,
    ),
    Shim(
        name="fla_attention_flash_attn",
        applies=_always,
        upstream="not filed: FLA 0.6.0's Attention and BitAttention run only on flash-attn (no SDPA path)",
        fixed_in=None,
        workaround="fla_layers_on_flame",
        reproduces=_fla_attention_needs_flash_attn,
    ),
    Shim(
        name="fla_mamba2_scan_without_mamba_ssm",
        applies=_always,
        upstream="not filed: FLA 0.6.0's Mamba2 without mamba_ssm scans with a state-sized product per token pair",
        fixed_in=None,
        workaround="fla_layers_on_flame (flame.models.layers.fla_mamba2 on flame.ops.ssd)",
        reproduces=_fla_mamba2_scan_materialises_pairs,
    ),
    Shim(
        name="transformers_gated_delta_rule_hook",
        applies=_always,
        upstream="not filed: transformers (5.17-5.24) hooks its Gated DeltaNet layers' chunk op to FLA's wherever "
        "fla imports, for CPU tensors too, and a compiled block ran its PyTorch reference on an H200",
        fixed_in=None,
        workaround="transformers_gated_delta_rule_on_flame",
        reproduces=_transformers_hooks_gated_delta_rule_to_fla,
    ),
    Shim(
        name="transformers_grouped_mm_autocast",
        applies=_always,
        upstream="pytorch/pytorch#174763 (grouped_mm is not autocast-enabled; transformers 5.17-5.24 cast the input "
        "to the weights' dtype and, compiled, take a per-expert loop for weights other than bfloat16)",
        fixed_in=None,
        workaround="transformers_grouped_mm_in_the_autocast_dtype",
        reproduces=_transformers_grouped_mm_skips_autocast,
    ),
    Shim(
        name="softplus_backward_meta_strides",
        applies=_always,
        upstream="pytorch/pytorch#120035 (aot_eager: a traced backward's view fails on real strides; here "
        "softplus_backward's meta strides differ from its kernel's)",
        fixed_in=None,
        workaround="contiguous_gradient",
        reproduces=_softplus_backward_meta_strides_differ,
    ),
    # Last: its probe makes a capture fail (and then puts the CUDA state back).
    Shim(
        name="failed_capture_generator",
        applies=_with_cuda,
        upstream="pytorch/pytorch#172390 (a CUDA graph capture's random-generator state is per generator, not per "
        "capture; pytorch/pytorch#176752 makes it per capture and ends it when the capture fails)",
        fixed_in=None,
        workaround="end_failed_capture",
        reproduces=_failed_capture_leaves_generator_capturing,
    ),
)
