"""treadle.dispatch: the dispatch rule (DESIGN.md "Dispatch rule") case by case, with the compiled
extension and Triton's presence simulated, on a throwaway op registered only for the test."""
import warnings

import pytest
import torch

from treadle import _extension, dispatch

OP = "test_dispatch_dummy"


@pytest.fixture
def env(monkeypatch):
    """A dummy op (cpu: cpp; gpu: cuda then triton), with every kernel present and Triton importable;
    tests switch pieces off through the returned dict."""
    have = {"CPU": True, "CUDA": True, "triton": True}
    monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, ("cpp",), ("cuda", "triton")))
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: op == OP and have[key])
    monkeypatch.setattr(_extension, "status", lambda: "treadle._C is not importable (simulated)")
    monkeypatch.setattr(dispatch, "triton_available", lambda: have["triton"])
    monkeypatch.delenv("TREADLE_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(dispatch, "_warned", set())
    dispatch._choose.cache_clear()
    yield have
    dispatch._choose.cache_clear()


def choose(device, backend=None):
    dispatch._choose.cache_clear()  # the tests change the environment between calls
    return dispatch.choose(OP, device, backend)


def test_register_and_registered_copy():
    spec = dispatch.register("test_dispatch_reg", cpu=["cpp"], gpu=["triton"])
    try:
        assert spec == dispatch.OpSpec("test_dispatch_reg", ("cpp",), ("triton",))
        assert isinstance(spec.cpu, tuple) and isinstance(spec.gpu, tuple)
        reg = dispatch.registered()
        assert reg["test_dispatch_reg"] is spec
        reg.pop("test_dispatch_reg")  # a copy: the registry keeps it
        assert "test_dispatch_reg" in dispatch.registered()
        default = dispatch.register("test_dispatch_reg", )
        assert default.cpu == ("cpp",) and default.gpu == ("triton",)
    finally:
        dispatch._REGISTRY.pop("test_dispatch_reg", None)


def test_unknown_op():
    with pytest.raises(KeyError, match="unknown treadle op 'no_such_op'; registered: \\["):
        dispatch.choose("no_such_op", "cpu")


def test_cpu_prefers_cpp_without_the_interpreter(env):
    assert choose("cpu") == ("cpp", "C++ kernel from treadle._C")
    assert choose(torch.device("cpu")) == ("cpp", "C++ kernel from treadle._C")


def test_cpu_uses_triton_under_the_interpreter(env, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose("cpu") == ("triton", "TRITON_INTERPRET=1 forces the Triton kernel on CPU tensors")
    env["triton"] = False
    assert choose("cpu") == ("cpp", "C++ kernel from treadle._C")


def test_cpu_falls_back_to_the_reference_saying_why(env):
    env["CPU"] = False
    assert choose("cpu") == ("reference", "treadle._C is not importable (simulated)")


def test_op_without_cpp_on_cpu(env, monkeypatch):
    monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, (), ("triton",)))
    assert choose("cpu") == ("reference", "no kernel for cpu tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # a GPU-only Triton kernel still runs under the interpreter
    assert choose("cpu")[0] == "triton"


def test_cuda_order_of_preference(env):
    assert choose("cuda") == ("cuda", "cuda kernel for CUDA tensors")
    assert choose(torch.device("cuda", 0)) == ("cuda", "cuda kernel for CUDA tensors")
    env["CUDA"] = False
    assert choose("cuda") == ("triton", "triton kernel for CUDA tensors")
    env["triton"] = False
    name, reason = choose("cuda")
    assert name == "reference"
    assert reason == ("no GPU kernel available (cuda: treadle._C was built without CUDA kernels (needs nvcc and a "
                      "CUDA build of torch); triton: triton is not installed)")


def test_other_devices_get_the_reference(env):
    assert choose("mps") == ("reference", "no kernel for mps tensors")
    # meta tensors hold no values: the reference only gives shapes (not a fallback: resolve() does not warn)
    assert choose("meta") == ("reference", "meta tensors hold no values: the reference gives the result's shape, "
                                           "dtype and device")


def test_requested_backend(env):
    assert choose("cpu", "reference") == ("reference", "requested")
    assert choose("cpu", "cpp") == ("cpp", "requested")
    assert choose("cuda", "triton") == ("triton", "requested")
    assert choose("cuda", "cuda") == ("cuda", "requested")


def test_env_backend(env, monkeypatch):
    monkeypatch.setenv("TREADLE_BACKEND", "reference")
    assert choose("cpu") == ("reference", "TREADLE_BACKEND")
    assert choose("cpu", "cpp") == ("cpp", "requested")  # the argument wins over the environment
    monkeypatch.setenv("TREADLE_BACKEND", "")
    assert choose("cpu") == ("cpp", "C++ kernel from treadle._C")


@pytest.mark.parametrize("device,backend,why", [
    ("cuda", "cpp", f"the C++ backend of {OP} runs on CPU tensors only"),
    ("cpu", "cuda", f"{OP} has no CUDA kernel for cpu tensors"),
    ("cpu", "triton", "Triton runs on CPU tensors only under TRITON_INTERPRET=1"),
    ("meta", "triton", "Triton kernels take CPU (interpreter) or CUDA tensors, not meta"),
    ("cpu", "tpu", "unknown backend 'tpu'; expected one of ('reference', 'cpp', 'cuda', 'triton')"),
])
def test_requested_backend_that_cannot_run(env, device, backend, why):
    with pytest.raises(dispatch.BackendUnavailableError) as info:
        choose(device, backend)
    assert str(info.value) == f"backend {backend!r} cannot run {OP} on {device}: {why}"


def test_requested_backend_missing_pieces(env, monkeypatch):
    env["CPU"] = False
    with pytest.raises(dispatch.BackendUnavailableError, match=r"cpp' cannot run .* on cpu: treadle\._C is not "
                                                               r"importable \(simulated\)$"):
        choose("cpu", "cpp")
    env["CUDA"] = False
    with pytest.raises(dispatch.BackendUnavailableError, match="built without CUDA kernels"):
        choose("cuda", "cuda")
    env["triton"] = False
    with pytest.raises(dispatch.BackendUnavailableError, match="triton' cannot run .* on cuda: triton is not installed$"):
        choose("cuda", "triton")
    monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, ("cpp",), ()))
    with pytest.raises(dispatch.BackendUnavailableError, match=f"{OP} has no Triton kernel$"):
        choose("cuda", "triton")
    with pytest.raises(dispatch.BackendUnavailableError, match=f"{OP} has no CUDA kernel for cuda tensors$"):
        choose("cuda", "cuda")
    with pytest.raises(dispatch.BackendUnavailableError, match=f"the C\\+\\+ backend of {OP} runs on CPU tensors only$"):
        choose("cuda", "cpp")
    monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, (), ("triton",)))
    with pytest.raises(dispatch.BackendUnavailableError, match=f"{OP} has no C\\+\\+ kernel$"):
        choose("cpu", "cpp")


def test_triton_in_cpu_spec_only(env, monkeypatch):
    monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, ("triton",), ()))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose("cpu", "triton") == ("triton", "requested")
    assert choose("cpu")[0] == "triton"


def test_resolve_warns_once_per_op_on_a_fallback(env):
    env["CPU"] = False
    dispatch._choose.cache_clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert dispatch.resolve(OP, "cpu") == "reference"
        assert dispatch.resolve(OP, "cpu") == "reference"
    msgs = [str(x.message) for x in w]
    assert msgs == [f"treadle: {OP} falls back to the PyTorch reference: treadle._C is not importable (simulated)"]
    assert w[0].category is UserWarning


def test_resolve_does_not_warn_when_nothing_is_lost(env, monkeypatch):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert dispatch.resolve(OP, "cpu") == "cpp"
        assert dispatch.resolve(OP, "cpu", "reference") == "reference"  # asked for: no warning
        monkeypatch.setitem(dispatch._REGISTRY, OP, dispatch.OpSpec(OP, (), ()))  # reference-only op
        dispatch._choose.cache_clear()
        assert dispatch.resolve(OP, "cpu") == "reference"
    assert [str(x.message) for x in w] == []


def test_table_lists_every_op_on_both_devices(env):
    env["CUDA"] = False
    t = dispatch.table()
    assert list(t) == sorted(t)
    assert t[OP] == {"cpu": {"backend": "cpp", "reason": "C++ kernel from treadle._C"},
                     "cuda": {"backend": "triton", "reason": "triton kernel for CUDA tensors"}}


def test_cache_follows_the_environment(env, monkeypatch):
    """choose() caches per (op, device, request, environment): changing TRITON_INTERPRET or
    TREADLE_BACKEND between calls changes the answer with no cache clearing."""
    assert dispatch.choose(OP, "cpu")[0] == "cpp"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.choose(OP, "cpu")[0] == "triton"
    monkeypatch.setenv("TREADLE_BACKEND", "reference")
    assert dispatch.choose(OP, "cpu") == ("reference", "TREADLE_BACKEND")
    monkeypatch.delenv("TREADLE_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.choose(OP, "cpu")[0] == "cpp"


def test_kernels_are_looked_up_for_this_op(env, monkeypatch):
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: op != OP)  # every op but ours has kernels
    assert choose("cpu")[0] == "reference"
    assert choose("cuda")[0] == "triton"


def test_triton_interpret_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.triton_interpret() is True
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # only "1" counts
    assert dispatch.triton_interpret() is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert dispatch.triton_interpret() is False
