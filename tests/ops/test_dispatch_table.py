"""flame/ops/dispatch.py: the one table that says which implementation serves an op's call."""

import pytest
import torch

import flame.ops.selective_scan  # noqa: F401 (registers its op)
import flame.ops.ssd  # noqa: F401 (registers its op)
from flame.errors import ConfigError
from flame.ops import attention, dispatch, gated_rms_norm, rms_norm, short_conv
from flame.ops.norm import rms_norm_torch
from flame.ops.short_conv import short_conv_group

OPS = ("attention", "chunk_gated_delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule", "rms_norm",
       "gated_rms_norm", "short_conv", "selective_scan", "ssd")  # fmt: skip


class PretendCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda=True."""

    @property
    def is_cuda(self):
        return True


@pytest.fixture
def scratch_op():
    """A throwaway op with two CUDA backends, removed from the table afterwards."""
    name = "scratch_op"
    entry = dispatch.register_op(
        name, lambda x: "torch", {"fast": lambda x: "fast", "slow": lambda x: "slow"}
    )
    yield entry
    del dispatch._TABLE[name]


def test_every_op_with_several_implementations_is_in_the_table():
    assert set(OPS) <= set(dispatch._TABLE)
    for op in OPS:
        assert dispatch.backend_names(op), op


def test_cpu_calls_run_the_pytorch_code_and_cuda_calls_the_first_backend(scratch_op):
    x = torch.zeros(2)
    assert scratch_op.implementation(x)(x) == "torch"
    assert scratch_op.implementation(x.as_subclass(PretendCuda))(x) == "fast"
    assert dispatch.pinned("scratch_op") == "fast"


def test_a_pinned_backend_serves_cuda_calls_until_unpinned(scratch_op):
    cuda = torch.zeros(2).as_subclass(PretendCuda)
    dispatch.pin("scratch_op", "slow")
    assert scratch_op.implementation(cuda)(cuda) == "slow"
    assert scratch_op.implementation(torch.zeros(2))(cuda) == "torch"  # pins are for CUDA calls only
    dispatch.pin("scratch_op", None)
    assert scratch_op.implementation(cuda)(cuda) == "fast"


def test_unknown_backends_and_ops_and_second_registrations_are_refused(scratch_op):
    with pytest.raises(
        ValueError, match=r"scratch_op backend must be one of \('fast', 'slow'\), got 'medium'"
    ):
        dispatch.pin("scratch_op", "medium")
    with pytest.raises(KeyError, match="no op 'no_such_op' in the dispatch table"):
        dispatch.pin("no_such_op", "fast")
    with pytest.raises(ValueError, match="registered already"):
        dispatch.register_op("scratch_op", lambda x: x, {"fast": lambda x: x})
    with pytest.raises(ValueError, match="needs at least one CUDA backend"):
        dispatch.register_op("empty_op", lambda x: x, {})


def test_eager_only_ops_run_the_pytorch_code_under_compile(monkeypatch):
    cuda = torch.zeros(2, 4).as_subclass(PretendCuda)
    assert dispatch._TABLE["rms_norm"].implementation(cuda) is not rms_norm_torch
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch._TABLE["rms_norm"].implementation(cuda) is rms_norm_torch
    conv = dispatch._TABLE["short_conv"].implementation(cuda, torch.randn(4, 3), None, "silu", None)
    assert conv.__name__ == "triton_short_conv"  # not eager-only


def test_dispatch_compiles_into_one_graph():
    """Looking up the table inside a compiled block adds no graph break: fullgraph compilation succeeds and gives
    the eager result."""

    def block(x, weight, conv_weight, gate):
        h = rms_norm(x, weight, 1e-6)
        h = short_conv(h, conv_weight, activation="silu")
        q = h.unflatten(-1, (2, 4))
        h = h + attention(q, q, q, impl="softmax").flatten(-2)
        return gated_rms_norm(h, gate, weight, 1e-6)

    torch.manual_seed(0)
    args = (torch.randn(2, 7, 8), torch.randn(8), torch.randn(8, 4), torch.randn(2, 7, 8))
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*args), block(*args), rtol=0, atol=0)


@pytest.fixture
def picky_op():
    """A throwaway op whose first backend refuses odd widths and whose second needs a module that is not there."""
    name = "picky_op"
    entry = dispatch.register_op(
        name,
        lambda x: "torch",
        {
            "even": dispatch.Backend(
                lambda x: "even", refuses=lambda x: "takes even widths" if x.shape[-1] % 2 else None
            ),
            "absent": dispatch.Backend(lambda x: "absent", requires=("flame_no_such_module",)),
            "any": lambda x: "any",
        },
    )
    yield entry
    del dispatch._TABLE[name]


def test_a_call_a_backend_refuses_goes_to_the_next_one_with_one_log_line(picky_op, caplog):
    even, odd = torch.zeros(4).as_subclass(PretendCuda), torch.zeros(3).as_subclass(PretendCuda)
    assert picky_op(even) == "even"
    assert caplog.records == []
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        assert [picky_op(odd) for _ in range(3)] == ["any"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "picky_op: the even backend takes even widths; the any implementation serves it"
    ]  # once for all three calls; an optional backend that is not installed is passed over without a word
    assert picky_op(torch.zeros(3)) == "torch"  # not CUDA: no backend is asked


def test_a_refused_backend_leaves_a_compiled_call_one_graph_with_one_log_line(monkeypatch, caplog):
    """A compiled call notes the refusal and the step logs it, once: a log call in the compiled region would break
    its graph at every call, five graphs per compiled Gated DeltaNet block where FlashQLA refuses the model's heads
    (docs/performance.md, "Compiled blocks stay one graph where a backend refuses a call")."""
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(dispatch, "_PASSED_OVER", set())
    name = "refused_under_compile"
    op = dispatch.register_op(
        name,
        lambda x: x * 2,
        {
            "even": dispatch.Backend(
                lambda x: x * 3, refuses=lambda x: "takes even widths" if x.shape[-1] % 2 else None
            ),
            "any": lambda x: x * 4,
        },
    )
    try:
        compiled = torch.compile(lambda x: op(x + 1) - 1, fullgraph=True, backend="eager")
        x = torch.ones(3).as_subclass(PretendCuda)
        with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
            results = [compiled(x) for _ in range(3)]
            assert caplog.messages == []  # the compiled calls only note it
            dispatch.log_passed_over_calls()  # the step's call
            dispatch.log_passed_over_calls()
        for result in results:
            torch.testing.assert_close(
                result.as_subclass(torch.Tensor), torch.full((3,), 7.0), rtol=0, atol=0
            )
        assert caplog.messages == [
            f"{name}: the even backend takes even widths; the any implementation serves it"
        ]
    finally:
        del dispatch._TABLE[name]


def test_a_pinned_backend_that_refuses_a_call_leaves_it_to_the_pytorch_code(picky_op, caplog):
    dispatch.pin("picky_op", "even")
    try:
        with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
            assert picky_op(torch.zeros(3).as_subclass(PretendCuda)) == "torch"
        assert [r.getMessage() for r in caplog.records] == [
            "picky_op: the even backend takes even widths; the pytorch implementation serves it"
        ]
        dispatch.pin("picky_op", "absent")
        with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
            assert picky_op(torch.zeros(4).as_subclass(PretendCuda)) == "torch"
        assert caplog.messages[-1] == (
            "picky_op: the absent backend needs flame_no_such_module, which is not installed; "
            "the pytorch implementation serves it"
        )
    finally:
        dispatch.pin("picky_op", None)


def test_fla_refuses_float_delta_rule_chunks_and_the_pytorch_code_serves_them_on_the_device(
    monkeypatch, caplog
):
    """FLA's chunk kernel asserts half precision (upstream flame issue 30): a float32 call on CUDA runs flame's
    PyTorch chunk code there instead; a bfloat16 one still reaches FLA (test_dispatch.py)."""
    import fla.ops.delta_rule

    from flame.ops import chunk_delta_rule

    monkeypatch.setattr(
        fla.ops.delta_rule, "chunk_delta_rule", lambda *a, **k: pytest.fail("FLA must not run")
    )
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 37, 2, 8, generator=generator) for _ in range(3))
    beta = torch.rand(1, 37, 2, generator=generator)
    expected, _ = chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        actual, _ = chunk_delta_rule(
            *(x.as_subclass(PretendCuda) for x in (q, k, v, beta)), use_qk_l2norm_in_kernel=True
        )
    torch.testing.assert_close(actual.as_subclass(torch.Tensor), expected, rtol=0, atol=0)
    assert "chunk_delta_rule: the fla backend takes bfloat16 and float16 inputs, not float32" in caplog.text


def test_short_convolutions_wider_than_the_kernel_run_the_pytorch_code(monkeypatch):
    from flame.ops.short_conv import triton_kernel

    monkeypatch.setattr(
        triton_kernel, "short_conv_group_triton", lambda *a, **k: pytest.fail("the kernel must not run")
    )
    x, weight = torch.randn(2, 11, 6), torch.randn(6, triton_kernel.MAX_WIDTH + 1)
    actual = short_conv(x.as_subclass(PretendCuda), weight, activation="silu")
    torch.testing.assert_close(
        actual.as_subclass(torch.Tensor), short_conv(x, weight, activation="silu"), rtol=0, atol=0
    )
    together = short_conv_group([(x.as_subclass(PretendCuda), weight, None, "silu")] * 2)
    expected = short_conv(x, weight, activation="silu")
    torch.testing.assert_close(
        [y.as_subclass(torch.Tensor) for y in together], [expected] * 2, rtol=0, atol=0
    )


def test_where_no_kernel_is_installed_the_pytorch_code_serves_cuda_calls_with_one_log_line(caplog):
    entry = dispatch.register_op(
        "kernelless_op",
        lambda x: "torch",
        {"absent": dispatch.Backend(lambda x: "absent", requires=("flame_no_such_module",))},
    )
    try:
        assert dispatch.pinned("kernelless_op") == "pytorch"
        with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
            assert [entry(torch.zeros(2).as_subclass(PretendCuda)) for _ in range(2)] == ["torch", "torch"]
        assert caplog.messages == [
            "kernelless_op: the absent backend needs flame_no_such_module, which is not installed; "
            "the pytorch implementation serves it"
        ]
    finally:
        del dispatch._TABLE["kernelless_op"]


@pytest.fixture
def fragile_op():
    """A throwaway op whose first backend's kernel does not build (Triton's error for a config past the GPU's shared
    memory), counting its calls."""
    from triton.runtime.errors import OutOfResources

    calls = []

    def unbuildable(x):
        calls.append(x)
        raise OutOfResources(232448, 166912, "shared memory")

    entry = dispatch.register_op(
        "fragile_op", lambda x: "torch", {"triton": unbuildable, "any": lambda x: "any"}
    )
    entry.calls = calls
    yield entry
    del dispatch._TABLE["fragile_op"]


def test_a_backend_whose_kernel_fails_to_build_is_out_and_the_call_goes_on_with_one_log_line(
    fragile_op, caplog
):
    cuda = torch.zeros(2).as_subclass(PretendCuda)
    with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
        assert [fragile_op(cuda) for _ in range(3)] == ["any"] * 3
    assert len(fragile_op.calls) == 1  # tried once in this process
    assert caplog.messages == [
        "fragile_op: the triton backend failed to build its kernel (OutOfResources: out of resource: shared "
        "memory, Required: 232448, Hardware limit: 166912. Reducing block sizes or `num_stages` may help.); the any "
        "implementation serves it"
    ]
    assert dispatch.pinned("fragile_op") == "triton"  # the first installed backend, whatever its calls do
    dispatch.pin("fragile_op", "triton")
    try:
        assert fragile_op(cuda) == "torch"  # pinned and out: the PyTorch code
    finally:
        dispatch.pin("fragile_op", None)


def test_an_error_raised_from_a_compiler_error_counts_and_any_other_error_is_raised():
    from triton.compiler.errors import CompilationError

    def wrapped(x):
        try:
            raise CompilationError(None, None, "unsupported layout")
        except CompilationError as error:
            raise RuntimeError("kernel build failed") from error

    def mistaken(x):
        raise ValueError("q and k differ in their last dimension")

    # TileLang raises a plain RuntimeError from its own code when nvcc fails (tilelang/jit/adapter/libgen.py).
    tilelang_code = {"__name__": "tilelang.jit.adapter.libgen"}
    exec("def build(x):\n    raise RuntimeError('Compilation Failed! nvcc exited with 1')", tilelang_code)

    entry = dispatch.register_op(
        "wrapped_op",
        lambda x: "torch",
        {"triton": wrapped, "tilelang": tilelang_code["build"], "bad": mistaken},
    )
    cuda = torch.zeros(2).as_subclass(PretendCuda)
    try:
        with pytest.raises(ValueError, match="differ in their last dimension"):
            entry(cuda)  # the first two backends are out; the third one's own error is the caller's to see
        assert entry.failed == {
            "triton": "failed to build its kernel (RuntimeError: kernel build failed)",
            "tilelang": "failed to build its kernel (RuntimeError: Compilation Failed! nvcc exited with 1)",
        }
        assert entry(torch.zeros(2)) == "torch"
    finally:
        del dispatch._TABLE["wrapped_op"]


@pytest.mark.parametrize("mark", ["flame", "torch", "none"])
def test_a_function_marked_constant_runs_once_while_tracing(mark):
    """constant_to_compiler marks a function as torch.compiler.assume_constant_result does: dynamo calls it while
    tracing and keeps the result, so a compiled caller does not call it again; unmarked, every call runs it."""
    calls = []

    def fact():
        calls.append(1)
        return 3

    marked = {"flame": dispatch.constant_to_compiler, "torch": torch.compiler.assume_constant_result}
    fact = marked.get(mark, lambda fn: fn)(fact)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * fact(), backend="eager")
    for _ in range(3):
        torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert len(calls) == (1 if mark != "none" else 3)


def raised_in(module: str, call: str) -> BaseException:
    """The error that ``call`` raises, run in KERNEL_CODE as the code of a module named ``module``."""
    namespace = {"__name__": module}
    exec(KERNEL_CODE, namespace)
    try:
        eval(call, namespace)
    except Exception as error:
        return error
    raise AssertionError(f"{call} raised nothing")


KERNEL_CODE = """
from triton.runtime.errors import OutOfResources

def launch():
    raise OutOfResources(232448, 166912, "shared memory")

def fwd_op():
    launch()

def fwd_kernel():
    raise OutOfResources(232448, 166912, "shared memory")

def mistaken_op():
    raise ValueError("q and k differ in their last dimension")

def custom_op_wrapper():
    try:
        fwd_op()
    except Exception as error:
        raise RuntimeError("the custom op failed") from error
"""


@pytest.fixture
def claimed_ops():
    """Two throwaway ops whose backends claim code of the module ``flame_test_kernels``: one its functions whose
    names start with ``fwd_``, the other the whole module."""
    entries = [
        dispatch.register_op(
            "claiming_op",
            lambda x: "torch",
            {
                "kernel": dispatch.Backend(lambda x: "kernel", code=("flame_test_kernels.fwd_",)),
                "other": lambda x: "other",
            },
        ),
        dispatch.register_op(
            "sharing_op",
            lambda x: "torch",
            {"kernel": dispatch.Backend(lambda x: "kernel", code=("flame_test_kernels.",))},
        ),
    ]
    yield entries
    for entry in entries:
        del dispatch._TABLE[entry.name]


def test_a_kernel_build_failure_takes_out_the_backends_that_claim_its_innermost_claimed_frame(claimed_ops):
    """fwd_op calls launch, which raises: launch, the innermost frame, is sharing_op's code only. Taken out, a
    backend serves no more calls, and the same error then names the next claimed frame's backend (fwd_op's)."""
    claiming, sharing = claimed_ops
    error = raised_in("flame_test_kernels", "fwd_op()")
    assert dispatch.take_out_failed_backends(error) == [("sharing_op", "kernel")]
    assert claiming.failed == {}
    assert dispatch.why_out("sharing_op", "kernel") == (
        "sharing_op: the kernel backend failed to build its kernel (OutOfResources: out of resource: shared memory, "
        "Required: 232448, Hardware limit: 166912. Reducing block sizes or `num_stages` may help.)"
    )
    assert dispatch.take_out_failed_backends(error) == [("claiming_op", "kernel")]
    cuda = torch.zeros(2).as_subclass(PretendCuda)
    assert (claiming(cuda), sharing(cuda)) == ("other", "torch")


def test_a_failure_in_code_two_backends_claim_takes_out_both(claimed_ops):
    error = raised_in("flame_test_kernels", "fwd_kernel()")
    assert dispatch.take_out_failed_backends(error) == [("claiming_op", "kernel"), ("sharing_op", "kernel")]


def test_a_build_failure_raised_from_another_error_is_traced_through_the_first_errors_frames(claimed_ops):
    """Torch raises a custom op's or a compiled graph's error again from its own code: the frames of the error
    raised first count, innermost first; the line names the error the step saw."""
    error = raised_in("flame_test_kernels", "custom_op_wrapper()")
    assert dispatch.take_out_failed_backends(error) == [("sharing_op", "kernel")]
    assert dispatch.why_out("sharing_op", "kernel") == (
        "sharing_op: the kernel backend failed to build its kernel (RuntimeError: the custom op failed)"
    )


def test_errors_that_are_not_build_failures_or_that_no_backend_claims_take_nothing_out(claimed_ops):
    assert dispatch.take_out_failed_backends(raised_in("flame_test_kernels", "mistaken_op()")) == []
    assert dispatch.take_out_failed_backends(raised_in("flame_test_elsewhere", "fwd_op()")) == []
    assert [entry.failed for entry in claimed_ops] == [{}, {}]


def test_flame_backends_off_takes_backends_out_from_the_start(monkeypatch, caplog):
    monkeypatch.setenv("FLAME_BACKENDS_OFF", " attention:reference , switched_op:fast,switched_op:slow")
    entry = dispatch.register_op(
        "switched_op", lambda x: "torch", {"fast": lambda x: "fast", "slow": lambda x: "slow"}
    )
    try:
        dispatch.check_backends_off()
        with caplog.at_level("WARNING", logger="flame.ops.dispatch"):
            assert entry(torch.zeros(2).as_subclass(PretendCuda)) == "torch"
    finally:
        del dispatch._TABLE["switched_op"]
    assert caplog.messages == [
        f"switched_op: the {name} backend is turned off (FLAME_BACKENDS_OFF); the pytorch implementation serves it"
        for name in ("fast", "slow")
    ]


@pytest.mark.parametrize(
    "value, message",
    [
        ("short_conv:trtion", "FLAME_BACKENDS_OFF: short_conv has no backend 'trtion'; its backends: triton"),
        ("short_conv", "FLAME_BACKENDS_OFF: short_conv has no backend ''; its backends: triton"),
        (
            "shortconv:triton",
            "FLAME_BACKENDS_OFF: no op 'shortconv' has backends; those that do: attention, ",
        ),
    ],
)
def test_flame_backends_off_naming_no_backend_is_refused(monkeypatch, value, message):
    monkeypatch.setenv("FLAME_BACKENDS_OFF", value)
    with pytest.raises(ConfigError) as raised:
        dispatch.check_backends_off()
    assert str(raised.value).startswith(message)


def test_the_code_each_backend_claims_exists():
    """Each prefix in a backend's ``code`` names a module (ending in ".") or a module's functions by the start of
    their names: a renamed module or function would leave a failing kernel unclaimed, and the step would stop
    instead of going on without it. Prefixes in packages not installed here (FlashQLA's) are passed over."""
    import importlib
    import inspect

    checked = 0
    for entry in dispatch._TABLE.values():
        for name, backend in entry.cuda_backends.items():
            for prefix in backend.code:
                if prefix.endswith("."):
                    module_name, start = prefix[:-1], ""
                else:
                    module_name, _, start = prefix.rpartition(".")
                if importlib.util.find_spec(module_name.split(".")[0]) is None:
                    continue
                module = importlib.import_module(module_name)
                functions = [n for n, _ in inspect.getmembers(module, callable) if n.startswith(start)]
                assert functions, f"{entry.name}:{name} claims {prefix}, which names no function"
                checked += 1
    assert checked >= 15
