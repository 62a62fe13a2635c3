"""Every shim in flame.compat is still needed by the installed packages and by the pinned GPU stack: when an upstream
release fixes a behaviour, its probe stops reproducing and this test names the workaround to delete."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from flame import compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reproduced() -> dict[str, bool]:
    # One fresh process for all probes, in SHIMS' order (the first needs a process without the fake process group).
    probe = (
        "import json; from flame.compat import SHIMS; "
        "print(json.dumps({s.name: bool(s.reproduces()) for s in SHIMS if s.applies()}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shim", compat.SHIMS, ids=lambda shim: shim.name)
def test_upstream_still_behaves_as_the_shim_assumes(shim, reproduced):
    if shim.name not in reproduced:
        pytest.skip(
            f"{shim.workaround} does not act on this machine (it acts only with a GPU or only without one, or a fixed "
            "release is installed)"
        )
    assert reproduced[shim.name], (
        f"{shim.upstream} no longer reproduces with the installed packages (fixed in {shim.fixed_in or '?'}): "
        f"delete flame.compat's {shim.workaround} and its SHIMS entry"
    )


def test_each_workaround_exists():
    for shim in compat.SHIMS:
        name = shim.workaround.split(" ")[0]
        assert hasattr(compat, name) or importlib.util.find_spec(name) is not None, shim


def pinned(constraints: str, package: str) -> str:
    text = (ROOT / "3rdparty" / constraints).read_text()
    return re.search(rf"^{re.escape(package)}==(\S+)$", text, re.MULTILINE).group(1)


def test_gpu_stack_triton_is_one_fla_refuses_on_hopper():
    # The Hopper shim only acts on a GPU; its probe above checks FLA's guard, this checks the pinned GPU stack is in it.
    assert pinned("constraints-gpu.txt", "triton") in SpecifierSet(",".join(compat.HOPPER_DQKWG_TRITON)), (
        "the GPU stack's triton is outside FLA issue 640's range: delete flame.compat.serve_gated_dqkwg_on_hopper"
    )


def test_torchtitan_imports_without_loading_inductor_and_compiles_flex_attention_at_first_call():
    """``import flame`` defers the torch.compile in torchtitan.models.attention's class body: importing torchtitan
    loads no inductor, and the wrapper holds flex_attention and torchtitan's options until its first call."""
    probe = (
        "import sys, flame, torchtitan\n"
        "from torch.nn.attention.flex_attention import flex_attention\n"
        "from torchtitan.models.attention import FlexAttentionWrapper\n"
        "from flame.compat import DeferredCompile\n"
        "wrapper = FlexAttentionWrapper._compiled_flex_attn\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules\n"
        "assert isinstance(wrapper, DeferredCompile) and wrapper.fn is flex_attention\n"
        "assert wrapper.options['options']['max_autotune'] and wrapper.compiled is None\n"
        "import torch\n"
        "assert torch.compile is wrapper.compile_fn\n"  # restored after the module's body ran
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_torchtitan_s_job_config_loads_without_torch_and_the_package_completes_when_asked():
    """The pre-flight's JobConfig comes without torch; torchtitan.config's own names (its body, which imports torch)
    and the job_config module's ``torch`` still work when taken."""
    probe = (
        "import sys\n"
        "from flame.compat import torchtitan_job_config\n"
        "JobConfig = torchtitan_job_config()\n"
        "assert 'torch' not in sys.modules and JobConfig().training.steps > 0\n"
        "import torchtitan.config, torchtitan.config.job_config as job_config\n"
        "assert 'torch' not in sys.modules\n"
        "assert torchtitan.config.JobConfig is JobConfig\n"
        "import torch\n"
        "assert torchtitan.config.TORCH_DTYPE_MAP['bfloat16'] is torch.bfloat16\n"
        "assert job_config.torch.float32 is torch.float32\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_deferred_compile_compiles_once_at_the_first_call():
    calls = []

    def compile_fn(fn, **options):
        calls.append(options)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    deferred = compat.DeferredCompile(compile_fn, lambda x, y=0: x + y, {"mode": "default"})
    assert calls == []
    assert deferred(1, y=2) == ("compiled", 3) and deferred(4) == ("compiled", 4)
    assert calls == [{"mode": "default"}]


def test_gpu_stack_transformers_is_one_that_imports_sklearn_at_the_top():
    # The shim acts only below transformers 5.21 (the CPU stack has a later one); the GPU stack's still needs it.
    gpu_stack = compat._release(pinned("constraints-gpu.txt", "transformers"))
    assert gpu_stack < compat._release(compat.TRANSFORMERS_LAZY_SKLEARN), (
        "the GPU stack's transformers imports scikit-learn where it uses it: delete defer_transformers_sklearn_import"
    )


def test_a_module_written_as_transformers_5_17_s_candidate_generator_loads_without_sklearn(
    tmp_path, monkeypatch
):
    """transformers 5.17's module, its top as written there: under flame's loader it imports no scikit-learn (the
    import would fail here, as no package of that name exists), keeps transformers' own ``is_sklearn_available``
    and gets a ``roc_curve`` that imports scikit-learn at its first call."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_sklearn_available", lambda: True)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any import of it raises ImportError
    source = tmp_path / "candidate_generator.py"
    source.write_text(
        "from transformers.utils import is_sklearn_available\n"
        "\n"
        "if is_sklearn_available():\n"
        "    from sklearn.metrics import roc_curve\n"
        "SKLEARN_SEEN_AT_IMPORT = is_sklearn_available()\n"
    )
    spec = importlib.util.spec_from_file_location("candidate_generator_5_17", source)
    spec.loader = compat._LazySklearnLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SKLEARN_SEEN_AT_IMPORT is False
    assert module.is_sklearn_available() is True
    assert module.roc_curve is compat.roc_curve_at_first_call
    with pytest.raises(ImportError):
        module.roc_curve([0, 1], [0.2, 0.9])


def test_roc_curve_at_first_call_is_sklearns():
    metrics = pytest.importorskip("sklearn.metrics")
    labels, scores = [0, 1, 1, 0, 1], [0.1, 0.8, 0.65, 0.3, 0.4]
    got, expected = compat.roc_curve_at_first_call(labels, scores), metrics.roc_curve(labels, scores)
    assert all((a == b).all() for a, b in zip(got, expected, strict=True))


def test_transformers_release_numbers():
    assert compat._release("5.17.0") == (5, 17, 0) and compat._release("5.21.0.dev0") == (5, 21, 0)
    assert compat._release("6.0") == (6, 0, 0)


def test_flas_tilelang_attention_refuses_what_it_cannot_compile():
    """After the shim FLA's dispatch skips its TileLang attention (to its Triton kernel) for heads that are not
    multiples of 16 and for float32 inputs, and keeps it for 16-bit heads of multiples of 16."""
    import torch
    from fla.ops.attn.backends.tilelang import AttnTileLangBackend

    assert compat._fla_tilelang_attention_takes_what_it_cannot_compile()  # FLA 0.6.0's own verifiers
    compat.fla_tilelang_attention_takes_what_it_compiles()
    compat.fla_tilelang_attention_takes_what_it_compiles()  # idempotent: one wrapper
    backend = AttnTileLangBackend()
    cases = [(24, torch.bfloat16, False), (40, torch.float16, False), (64, torch.bfloat16, True)]
    cases += [(96, torch.float16, True), (64, torch.float32, False), (128, torch.float32, False)]
    for width, dtype, accepted in cases:
        q = torch.empty(2, 33, 3, width, device="meta", dtype=dtype)
        forward = backend.verify("parallel_attn_fwd", q=q, k=q, v=q, g_cumsum=None, sink_bias=None, scale=0.1)
        backward = backend.verify("parallel_attn_bwd", q, q, q, q, None, None, q)
        assert (forward[0], backward[0]) == (accepted, accepted), (width, dtype, forward, backward)
    wrapped = AttnTileLangBackend.parallel_attn_fwd_verifier
    assert not getattr(wrapped.__wrapped__, "flame_compiles", False)


def test_flas_functions_run_flames_pytorch_code_while_compiling():
    """After fla_functions_traced_under_compile, FLA's swish (also as ACT2FN['silu']) and its RMSNorm module trace
    under torch.compile into flame's PyTorch code with no graph break (on this CPU FLA's kernels cannot run at all);
    a second call changes nothing."""
    import torch
    from fla.modules import RMSNorm
    from fla.modules.activations import ACT2FN

    from flame.models.generic.model import FLA_FUNCTIONS_IN_PYTORCH
    from flame.ops.activations import swish
    from flame.ops.norm import residual_rms_norm_torch

    compat.fla_functions_traced_under_compile(FLA_FUNCTIONS_IN_PYTORCH)
    silu = ACT2FN["silu"]
    compat.fla_functions_traced_under_compile(FLA_FUNCTIONS_IN_PYTORCH)
    assert ACT2FN["silu"] is silu and ACT2FN["swish"] is silu and silu.flame_traced_under_compile
    norm = RMSNorm(13, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 7, 13)

    def block(x):
        return ACT2FN["silu"](norm(x))

    torch._dynamo.reset()
    out = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(
        out, swish(residual_rms_norm_torch(x, norm.weight, None, eps=1e-5)), rtol=0, atol=0
    )
    torch._dynamo.reset()


def test_flas_undecorated_ops_are_called_not_traced_by_compile():
    """After fla_ops_opaque_to_compile, every op of fla.ops.__all__ is marked torch.compiler.disable in each FLA
    module that holds it (FLA's layers call the name they imported), so dynamo calls it instead of tracing its
    Triton kernels; the ops FLA marks itself stay FLA's functions; a second call changes nothing."""
    import fla.layers.nsa
    import fla.layers.parallax
    import fla.layers.stickbreaking_attn
    import fla.ops
    import fla.ops.parallax

    compat.fla_ops_opaque_to_compile()  # earlier tests in this process may have called it already
    after = {name: getattr(fla.ops, name) for name in fla.ops.__all__}
    compat.fla_ops_opaque_to_compile()
    assert {name: getattr(fla.ops, name) for name in fla.ops.__all__} == after
    assert all(getattr(op, "_torchdynamo_disable", False) for op in after.values())
    flames = {name for name, op in after.items() if getattr(op, "flame_opaque_to_compile", False)}
    assert {"parallel_parallax", "parallel_nsa", "parallel_stickbreaking_attn"} <= flames
    assert 20 < len(after) - len(flames) < len(after)  # the ops FLA marks itself stay FLA's functions
    for layer_module, name in ((fla.layers.parallax, "parallel_parallax"), (fla.layers.nsa, "parallel_nsa"),
                               (fla.layers.stickbreaking_attn, "parallel_stickbreaking_attn")):  # fmt: skip
        assert getattr(layer_module, name) is after[name], name
    assert fla.ops.parallax.parallel_parallax is after["parallel_parallax"]


def test_fla_rotary_tables_trace_after_the_first_call():
    """FLA's RotaryEmbedding checks its cached tables with Tensor.is_inference(), which dynamo does not trace: after
    fla_rotary_tables_traced_under_compile, the call after the one that built the tables (a recompile: the tables'
    length is guarded) traces whole into flame's rotation, and a longer input rebuilds them."""
    import torch
    from fla.modules.rotary.ops import RotaryEmbedding

    from flame.models.generic.model import FLA_FUNCTIONS_IN_PYTORCH
    from flame.ops.rotary import rotary_embedding

    compat.fla_functions_traced_under_compile(FLA_FUNCTIONS_IN_PYTORCH)
    compat.fla_rotary_tables_traced_under_compile()
    compat.fla_rotary_tables_traced_under_compile()
    assert RotaryEmbedding._update_cos_sin_cache.flame_traced_under_compile
    rotary = RotaryEmbedding(8)
    compiled = torch.compile(rotary, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    for tokens in (11, 11, 5, 17):
        q, k = torch.randn(2, tokens, 3, 8), torch.randn(2, tokens, 1, 8)
        out_q, out_k = compiled(q, k)
        assert rotary._seq_len_cached == max(11, tokens)
        want = rotary_embedding(q, rotary._cos_cached, rotary._sin_cached)
        torch.testing.assert_close(out_q, want, rtol=0, atol=0)
    torch._dynamo.reset()


def test_hopper_dqkwg_ranks_flame_first_for_gated_calls(monkeypatch):
    """Where FLA refuses its gated chunk_bwd_dqkwg, flame's kernel serves every gated call (with and without w)
    ahead of FLA's TileLang kernel, and no ungated call or g_gamma call."""
    import fla.backends
    from fla.backends import TileLangBackend

    registry = fla.backends._load_operation_registry("common")
    monkeypatch.setattr(
        registry, "_backends", dict(registry._backends)
    )  # the test's registrations end with it
    monkeypatch.setattr(compat, "_hopper_backend_registered", False)
    monkeypatch.setattr(compat, "fla_refuses_gated_dqkwg_here", lambda: True)
    served = []
    compat.serve_gated_dqkwg_on_hopper(lambda *args, **kwargs: served.append(kwargs) or "flame")
    compat.serve_gated_dqkwg_on_hopper(lambda *args, **kwargs: "registered twice")  # idempotent

    ranked = [b.backend_type for b in registry._get_sorted_backends()]
    assert ranked.index("flame_hopper_dqkwg") < ranked.index(TileLangBackend.backend_type)
    flame_backend = registry._backends["flame_hopper_dqkwg"]

    def takes(**call) -> bool:
        return flame_backend.verify("chunk_bwd_dqkwg", q=1, k=1, v=1, **call)[0]

    assert takes(g=1, w=None) and takes(g=1, w=1)
    assert not takes(g=None, w=None) and not takes(g=1, g_gamma=1)
    assert flame_backend.get_implementation("chunk_bwd_dqkwg")(q=1, g=2) == "flame"
    assert served == [{"q": 1, "g": 2}]


def _write_exporting_packages(root: Path, name: str) -> None:
    """Packages written as FLA's are. The root: a version, a count of its body's runs, a body that imports its late
    subpackage ``layers``. ``layers``: its ``utils`` first, then a name from ``ops.cyclic``. ``ops`` (lazy as well):
    a body that imports its kernel and ``cyclic`` and makes an alias module. ``ops.cyclic``: a package whose
    submodule imports ``layers.utils`` while ``layers`` imports ``cyclic`` (FLA's fla.ops.deltaformer)."""
    package = root / name
    for folder in ("layers", "ops/cyclic"):
        (package / folder).mkdir(parents=True)
    files = {
        "__init__.py": "import builtins\n"
        "__version__ = '1.2.3'\n"
        "builtins.ROOT_RUNS = getattr(builtins, 'ROOT_RUNS', 0) + 1\n"
        f"import {name}.layers\n"
        "__all__ = ['layers']\n",
        "layers/__init__.py": f"from .utils import helper\nfrom {name}.ops.cyclic import cyclic_op\n",
        "layers/utils.py": "def helper():\n    return 'helper'\n",
        "ops/__init__.py": "import sys\n"
        "from .kernel import op\n"
        "from .cyclic import cyclic_op\n"
        "sys.modules[__name__ + '.alias'] = sys.modules[__name__ + '.kernel']\n"
        "__all__ = ['op', 'cyclic_op']\n",
        "ops/kernel.py": "def op():\n    return 'op'\n",
        "ops/cyclic/__init__.py": "from .impl import cyclic_op\n",
        "ops/cyclic/impl.py": f"from {name}.layers.utils import helper\n\ndef cyclic_op():\n    return helper()\n",
    }
    for path, text in files.items():
        (package / path).write_text(text)


@pytest.fixture
def lazy_package(tmp_path, monkeypatch):
    """The packages' name, with flame's finder for them (the root and ``ops`` lazy, ``layers`` late) installed."""
    import builtins

    name = "lazy_exporting_package"
    _write_exporting_packages(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(builtins, "ROOT_RUNS", 0, raising=False)
    finder = compat._LazyPackagesFinder((name, f"{name}.ops"), late=("layers",))
    sys.meta_path.insert(0, finder)
    yield name
    sys.meta_path.remove(finder)
    for package in (name, f"{name}.ops"):
        compat._LazyPackageLoader.unrun.pop(package, None)
    for module in [module for module in sys.modules if module.partition(".")[0] == name]:
        del sys.modules[module]


def _finder_of(name: str) -> "compat._LazyPackagesFinder":
    return next(f for f in sys.meta_path if isinstance(f, compat._LazyPackagesFinder) and f.root == name)


def test_a_lazy_package_s_submodule_imports_without_its_body(lazy_package):
    import builtins

    kernel = importlib.import_module(f"{lazy_package}.ops.kernel")
    assert kernel.op() == "op" and sys.modules[lazy_package].__version__ == "1.2.3"
    assert builtins.ROOT_RUNS == 0 and sorted(compat._LazyPackageLoader.unrun) == [
        lazy_package,
        f"{lazy_package}.ops",
    ]
    assert f"{lazy_package}.layers" not in sys.modules and not _finder_of(lazy_package).ended


def test_a_name_a_lazy_package_lacks_runs_its_body(lazy_package):
    import builtins

    importlib.import_module(f"{lazy_package}.ops.kernel")
    ops = sys.modules[f"{lazy_package}.ops"]
    assert ops.op() == "op" and ops.__all__ == ["op", "cyclic_op"]
    # Its body imported ops.cyclic, which imports layers: that ended the deferral and ran the root's body.
    assert (
        builtins.ROOT_RUNS == 1 and compat._LazyPackageLoader.unrun == {} and _finder_of(lazy_package).ended
    )
    assert not hasattr(ops, "missing") and builtins.ROOT_RUNS == 1


def test_a_module_only_a_lazy_body_makes_imports_after_running_it(lazy_package):
    alias = importlib.import_module(f"{lazy_package}.ops.alias")
    assert alias is sys.modules[f"{lazy_package}.ops.kernel"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{lazy_package}.ops.never_made")


@pytest.mark.parametrize("late", ["layers", "ops.cyclic"])
def test_importing_the_late_subpackage_or_a_package_that_imports_it_ends_the_deferral(lazy_package, late):
    """Imported alone, ``ops.cyclic`` would be partly run when its submodule imports ``layers``, which imports
    ``cyclic``'s name: the root's body runs first, so the modules load in the order its body loads them."""
    import builtins

    importlib.import_module(f"{lazy_package}.ops.kernel")
    module = importlib.import_module(f"{lazy_package}.{late}")
    assert module.cyclic_op() == "helper" and builtins.ROOT_RUNS == 1 and _finder_of(lazy_package).ended
    assert module.__spec__.origin.endswith("__init__.py")  # the module's own spec, not a stand-in's
    assert sys.modules[lazy_package].layers.helper() == "helper"


FLA_KERNELS_THEN = {
    # Each first import after the kernels' ends the deferral its own way: a package whose op imports fla.layers
    # (which imports the op), a name from a lazy package other than the root, a name from the root.
    "package importing the layers": "import fla.ops.deltaformer as m; assert m.deltaformer_attn\n",
    "name from fla.ops": "from fla.ops import chunk_gla; assert chunk_gla\n",
    "name from fla": "import fla; assert fla.layers.GatedLinearAttention\n",
}


def test_fla_kernels_import_without_fla_s_layers_and_models():
    """In a process with the deferral, the FLA modules a GatedDeltaNet rank imports leave FLA's packages unrun and
    transformers unimported; any import beyond them loads FLA as before, and ``import fla.models`` registers FLA's
    model types."""
    probe = (
        "import sys\n"
        "from flame.compat import defer_fla_package_imports, _LazyPackageLoader\n"
        "defer_fla_package_imports()\n"
        "import fla.ops.gated_delta_rule.chunk, fla.ops.common.gate, fla.ops.utils.index, fla.backends\n"
        "import fla.modules.norm.l2norm, fla.modules.norm.fused_norm_gate, fla.modules.fused_linear_cross_entropy\n"
        "import fla\n"
        "print(sorted(_LazyPackageLoader.unrun), fla.__version__, 'transformers' in sys.modules, 'fla.layers' in sys.modules)\n"
        "{then}"
        "import fla.models\n"
        "from transformers import AutoConfig\n"
        "print(type(AutoConfig.for_model('gla')).__name__)\n"
    )
    runs = {
        case: subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", probe.format(then=then)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case, then in FLA_KERNELS_THEN.items()
    }
    from importlib.metadata import version

    for case, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, (case, err[-2000:])
        assert out.split("\n")[-3:] == [
            f"['fla', 'fla.modules', 'fla.ops'] {version('fla-core')} False False",
            "GLAConfig",
            "",
        ], case


class _StandInGenerator:
    """The calls end_failed_capture makes on a CUDA generator."""

    def __init__(self):
        self.state = "capturing"

    def clone_state(self):
        return "copy"

    def graphsafe_set_state(self, state):
        self.state = state


@pytest.mark.parametrize(
    "allocator_error, raised",
    [
        (None, None),
        ("endAllocatePool: not currently recording to mempool_id", None),
        ("device lost", "device lost"),
    ],
)
def test_end_failed_capture_gives_the_generator_a_copy_and_ends_the_pools_allocation(
    monkeypatch, allocator_error, raised
):
    """The device's default generator gets a copy of its state, and the pool's allocation ends; a release that has
    ended it already ("not currently recording") is no error, any other allocator error is."""
    import torch

    generator, ended = _StandInGenerator(), []

    def end_allocate_to_pool(device, pool):
        ended.append((device, pool))
        if allocator_error:
            raise RuntimeError(allocator_error)

    monkeypatch.setattr(torch.cuda, "default_generators", (None, generator), raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)
    if raised:
        with pytest.raises(RuntimeError, match=raised):
            compat.end_failed_capture((0, 3))
    else:
        compat.end_failed_capture((0, 3))
    assert generator.state == "copy" and ended == [(1, (0, 3))]
