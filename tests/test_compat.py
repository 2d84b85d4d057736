"""The compatibility modules (qcompiler/compat): what they take from torch still exists and
behaves as qcompiler relies on, and qcompiler works without torch.ao's quantization.

A torch release that moves, renames or drops one of these names fails here first, naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from qcompiler.compat import torch_ao as ao

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("qcompiler", "passes", "backends", "tools")


def test_torch_ao_names_are_the_classes_torch_ships():
    # while torch ships torch.ao.quantization, every name is torch's class, not a stand-in
    import torch.ao.nn.quantized as aonnq
    import torch.ao.quantization as taq

    assert ao.AVAILABLE
    for name in ("QuantStub", "DeQuantStub", "QConfig", "QConfigMapping", "ObserverBase", "FakeQuantizeBase"):
        assert getattr(ao, name) is getattr(taq, name), f"torch.ao.quantization.{name} changed"
    assert ao.FloatFunctional is aonnq.FloatFunctional
    assert ao.STUB_TYPES == (taq.QuantStub, taq.DeQuantStub)
    # what the tracer patches: FloatFunctional's own methods (not inherited ones)
    for method in ("add", "mul", "cat", "add_scalar", "mul_scalar", "matmul"):
        assert method in ao.FloatFunctional.__dict__, f"FloatFunctional.{method} is no longer its own method"
    # what the translation reads off a torch.ao QConfig / QConfigMapping
    qc = taq.get_default_qconfig("qnnpack")
    assert ao.is_qconfig(qc) and not ao.is_qconfig({"activation": None})
    mapping = taq.QConfigMapping().set_global(qc).set_object_type(torch.nn.Conv2d, None)
    assert ao.is_qconfig_mapping(mapping) and not ao.is_qconfig_mapping(qc)
    for attr in ("global_qconfig", "object_type_qconfigs", "module_name_qconfigs",
                 "module_name_regex_qconfigs", "module_name_object_type_order_qconfigs"):
        assert hasattr(mapping, attr), f"QConfigMapping.{attr} is gone"
    observer = qc.activation()
    assert isinstance(observer, ao.ObserverBase)
    for attr in ("dtype", "qscheme", "quant_min", "quant_max", "reduce_range"):
        assert hasattr(observer, attr), f"torch.ao observers no longer have .{attr}"
    assert isinstance(taq.FakeQuantize(), ao.OBSERVER_TYPES)


def test_only_the_compat_package_imports_torch_ao():
    # the done criterion of issue 36: torch.ao is named in code only by qcompiler/compat
    out = subprocess.run(["grep", "-rlE", r"torch\.ao\.(quantization|nn)", *PACKAGE_DIRS, "--include=*.py"],
                         cwd=ROOT, capture_output=True, text=True)
    files = {f for f in out.stdout.split() if not f.startswith("qcompiler/pt2e/")}
    assert files == {"qcompiler/compat/__init__.py", "qcompiler/compat/torch_ao.py"}, files


_WITHOUT_TORCH_AO = textwrap.dedent("""
    import importlib.abc, sys, warnings
    import torch  # torch itself imports torch.ao.quantization; drop it after, as if it never shipped

    BLOCKED = ("torch.ao.quantization", "torch.ao.nn.quantized")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(BLOCKED):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    for name in [m for m in sys.modules if m.startswith(BLOCKED)]:
        del sys.modules[name]
    del torch.ao.quantization
    del torch.ao.nn.quantized
    sys.meta_path.insert(0, Block())
    try:
        import torch.ao.quantization
    except ImportError:
        pass
    else:
        raise SystemExit("the block did not hold")

    import qcompiler
    from qcompiler.compat import torch_ao as ao
    from qcompiler.quantization import DeQuantStub, QuantStub
    from qcompiler.zoo import hybrid

    assert not ao.AVAILABLE and ao.STUB_TYPES == () and ao.FloatFunctional is None
    assert not ao.is_qconfig(object()) and not ao.is_qconfig_mapping(object())
    assert hybrid.QuantStub is QuantStub and hybrid.DeQuantStub is DeQuantStub

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = QuantStub(), DeQuantStub()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            return self.dequant(self.relu(self.conv(self.quant(x))))

    torch.manual_seed(0)
    model = M().eval()
    data = [torch.randn(2, 3, 8, 8) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = qcompiler.compile(model, (data[0],), march="bayes", calib_data=data, progress=False)
    out, ref = cm(data[0]), model(data[0])
    err = (out - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err
    placements = [p["placement"] for p in cm.partitions]
    assert placements == ["bpu"], placements  # stubs to stubs: one BPU program, no CPU island
    print("OK", err, placements)
    assert not [m for m in sys.modules if m.startswith(BLOCKED)]
""")


def test_qcompiler_imports_and_compiles_without_torch_ao_quantization():
    # torch plans to delete torch.ao.quantization: with it blocked, the package imports, our stubs
    # stand in for torch's (the hybrid zoo model too), and a stubbed model compiles and runs
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH_AO], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("OK"), proc.stdout


def test_torch_private_names_still_behave_as_used():
    # each private torch name qcompiler keeps (qcompiler/compat/torch_private.py), as it is used
    from qcompiler.compat import torch_private as tp

    leaves, spec = tp.pytree.tree_flatten({"a": (torch.ones(1), [2, 3])})
    assert isinstance(spec, tp.TreeSpec) and len(leaves) == 3
    assert tp.pytree.tree_unflatten(leaves, spec)["a"][1] == [2, 3]
    assert tp.pytree.tree_leaves([1, (2,)]) == [1, 2]
    assert isinstance(torch.ops.aten.add.Tensor, tp.OpOverload)
    assert isinstance(torch.ops.higher_order.cond, tp.HigherOrderOperator)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(2)
        with tp.unset_fake_temporarily():
            real = torch.zeros(2)
    assert type(fake).__name__ == "FakeTensor" and type(real) is torch.Tensor
    assert tp.int_mm_exists()
    a = torch.randint(-128, 128, (17, 32), dtype=torch.int8)
    b = torch.randint(-128, 128, (32, 8), dtype=torch.int8)
    out = torch.empty(17, 8, dtype=torch.int32)
    tp.int_mm(a, b, out=out)
    assert torch.equal(out.long(), a.long() @ b.long())
    x = torch.tensor([-128, 0, 127], dtype=torch.int8)
    with warnings.catch_warnings():  # torch deprecates quantized tensors (docs/compatibility.md)
        warnings.simplefilter("ignore", UserWarning)
        q = tp.as_qint8(x)
    assert q.dtype == torch.qint8 and q.q_scale() == 1.0 and q.q_zero_point() == 0
    assert torch.equal(q.int_repr(), x)
    assert not tp.global_forward_hooks and not tp.global_forward_pre_hooks
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert len(tp.global_forward_hooks) == 1, "torch keeps global forward hooks elsewhere now"
    finally:
        handle.remove()
    assert not tp.is_functorch_wrapped_tensor(torch.ones(2))
    seen = []
    torch.vmap(lambda t: seen.append(tp.is_functorch_wrapped_tensor(t)) or t)(torch.ones(3, 2))
    assert seen == [True]


def test_only_the_compat_package_names_private_torch_modules():
    # imports and calls of torch's private modules and functions (a docstring may name them)
    pattern = (r"import torch\.utils\._pytree|from torch\.utils\._pytree import|from torch\.utils import _|from torch\._|torch\._ops\.|"
               r"torch\._int_mm\(|torch\._make_per_tensor|torch\.nn\.modules\.module import _|_C\._functorch")
    out = subprocess.run(["grep", "-rlE", pattern, *PACKAGE_DIRS, "--include=*.py"],
                         cwd=ROOT, capture_output=True, text=True)
    files = {f for f in out.stdout.split() if not f.startswith("qcompiler/pt2e/")}
    assert files == {"qcompiler/compat/torch_private.py"}, files


def test_the_simulators_int8_gemm_entry_reaches_torchs_int_mm():
    """``sim.gemm.int_mm`` is the kernels' one call of torch's int8 GEMM. It once called itself (its own
    name shadowed the compat import), so the self-test failed on every machine and the exact int8 GEMMs
    were silently off: where torch's ``_int_mm`` is exact for these shapes, the entry and the self-test
    must agree with it."""
    from qcompiler.backends.bpu.sim import gemm
    from qcompiler.compat import torch_private as tp

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (17, 32), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (32, 8), dtype=torch.int8, generator=g)
    out = torch.empty(17, 8, dtype=torch.int32)
    tp.int_mm(a, b, out=out)
    if not torch.equal(out.long(), a.long() @ b.long()):
        pytest.skip("torch._int_mm is not exact on this machine")
    got = torch.empty(17, 8, dtype=torch.int32)
    assert gemm.int_mm(a, b, got) is got and torch.equal(got, out)
    assert gemm._int8_self_test()
