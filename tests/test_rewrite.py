"""The rewrite pass (passes/rewrite.py): each row before/after as golden code, bit-equal outputs,
a no-op rerun, the note in the placement reason, and the cases each row must decline."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_export_exact import assert_export_is_compiled  # noqa: E402

import qcompiler
from qcompiler.backends.bpu.op_info import op_info
from qcompiler.backends.bpu.program_check import ATTRS
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.errors import PassError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.dump import partition_table
from qcompiler.ir.meta import META_REASON, META_REWRITE
from qcompiler.march import March
from qcompiler.nn.fused import PaddedAvgPool2d
from qcompiler.passes import rewrite as rw
from qcompiler.passes.base import CompileContext
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.qtensor import QTensor

X = torch.rand(2, 3, 8, 8)


def _run(model, x=X, march=March.BAYES):
    gm = trace(copy.deepcopy(model).eval())  # the pipeline rewrites a copy; so does this test
    propagate_shapes(gm, (x,))
    ctx = CompileContext(march=march, example_inputs=(x,))
    return gm, ctx, rw.rewrite(gm, ctx)


def _body(gm) -> list[str]:
    return [line.strip() for line in gm.code.strip().splitlines()[1:] if line.strip()]


class PadConv(nn.Module):
    def __init__(self, pads=(2, 2, 1, 1), value=0.0, mode="constant", conv_padding=1):
        super().__init__()
        self.pads, self.value, self.mode = pads, value, mode
        self.conv = nn.Conv2d(3, 4, 3, padding=conv_padding)

    def forward(self, x):
        return self.conv(F.pad(x, self.pads, self.mode, self.value))


class PadPool(nn.Module):
    def __init__(self, pool: nn.Module, pads=(1, 1, 1, 1)):
        super().__init__()
        self.pool, self.pads = pool, pads

    def forward(self, x):
        return self.pool(F.pad(x, self.pads))


class Unsqueeze(nn.Module):
    def forward(self, x):
        return x[:, None] + x[:, :, None], x[..., None, :]


def test_zero_pad_folds_into_the_conv():
    model = PadConv()
    ref = model(X)
    gm, ctx, result = _run(model)
    assert result.modified
    assert _body(gm) == ["conv = self.conv(x);  x = None", "return conv"]
    assert gm.conv.padding == (2, 3) and model.conv.padding == (1, 1)
    # the same products, summed in another order by torch's conv kernel: float32 rounding only
    torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)
    assert not rw.rewrite(gm, ctx).modified  # a fixed point
    rw.verify_rewritten(gm, ctx)
    conv = next(n for n in gm.graph.nodes if n.name == "conv")
    assert conv.meta[META_REWRITE] == "F.pad with zeros folded into the padding of the conv / average pool after it"


def test_zero_pad_folds_into_an_average_pool_counting_padding():
    model = PadPool(nn.AvgPool2d(3, 1))
    ref = model(X)
    gm, _, result = _run(model)
    assert result.modified and gm.pool.padding == (1, 1)
    assert _body(gm) == ["pool = self.pool(x);  x = None", "return pool"]
    assert torch.equal(gm(X), ref)


def test_w_only_zero_pad_folds():
    model = PadConv(pads=(1, 1))  # 2-D pad list: W only
    ref = model(X)
    gm, _, result = _run(model)
    assert result.modified and gm.conv.padding == (1, 2) and gm.conv.padding_mode == "zeros"
    torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)


TF_SAME = (0, 1, 0, 1)  # TF-style "same" padding before a stride-2 layer: (left, right, top, bottom)


def test_asymmetric_zero_pad_folds_into_the_conv_golden():
    """Before / after: the pad goes; the conv holds the four sides (top, left, bottom, right) and pads
    with zeros by torch's own ``padding_mode`` path: F.pad then a conv without padding, the same float
    ops as the graph before, so bit for bit."""
    model = PadConv(pads=TF_SAME, conv_padding=0)
    ref = model(X)
    before = trace(copy.deepcopy(model))
    assert _body(before) == ["pad = torch.nn.functional.pad(x, (0, 1, 0, 1), mode = 'constant', value = 0.0);  x = None",
                             "conv = self.conv(pad);  pad = None", "return conv"]
    gm, ctx, result = _run(model)
    assert result.modified
    assert _body(gm) == ["conv = self.conv(x);  x = None", "return conv"]
    assert type(gm.conv) is nn.Conv2d and gm.conv.padding == (0, 0, 1, 1) and gm.conv.padding_mode == "constant"
    assert gm.conv._reversed_padding_repeated_twice == (0, 1, 0, 1)
    assert model.conv.padding == (0, 0) and model.conv.padding_mode == "zeros"  # the user's layer untouched
    assert torch.equal(gm(X), ref)
    assert not rw.rewrite(gm, ctx).modified
    rw.verify_rewritten(gm, ctx)
    conv = next(n for n in gm.graph.nodes if n.name == "conv")
    assert conv.meta[META_REWRITE] == "F.pad with zeros folded into the padding of the conv / average pool after it"


def test_asymmetric_zero_pad_adds_to_the_conv_padding():
    model = PadConv(pads=(1, 2, 0, 3), conv_padding=1)
    ref = model(X)
    gm, _, result = _run(model)
    assert result.modified and gm.conv.padding == (1, 2, 4, 3)
    torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)  # one pad instead of two: float32 rounding


def test_asymmetric_zero_pad_folds_into_an_average_pool_golden():
    model = PadPool(nn.AvgPool2d(2), pads=TF_SAME)
    ref = model(X)
    gm, _, result = _run(model)
    assert result.modified
    assert _body(gm) == ["pool = self.pool(x);  x = None", "return pool"]
    assert type(gm.pool) is PaddedAvgPool2d and gm.pool.padding == (0, 0, 1, 1)
    assert (gm.pool.kernel_size, gm.pool.stride, gm.pool.count_include_pad) == (2, 2, True)
    assert gm(X).shape == (2, 3, 4, 4) and torch.equal(gm(X), ref)


def test_a_second_pad_making_the_pool_symmetric_gives_a_plain_pool():
    class TwoPads(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = nn.AvgPool2d(3, 1)

        def forward(self, x):
            return self.pool(F.pad(F.pad(x, (1, 0, 1, 0)), (0, 1, 0, 1)))

    model = TwoPads()
    gm, _, result = _run(model)
    # the outer pad folds (four sides), then the inner one: the sides even out
    assert result.modified and type(gm.pool) is nn.AvgPool2d and gm.pool.padding == (1, 1)
    assert not any(n.op == "call_function" and n.target is F.pad for n in gm.graph.nodes)
    assert torch.equal(gm(X), model(X))


class TwoUsers(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, 2)

    def forward(self, x):
        p = F.pad(x, TF_SAME)
        return self.conv(p), p.sum()


class ChangedBetween(nn.Module):
    """The pad's input is changed in place between the pad and the conv: folded, the conv would read it
    changed (0.66 off the model, found by review)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3)

    def forward(self, x):
        a = x * 1.0
        p = F.pad(a, (1, 1, 1, 1))
        a.mul_(2.0)
        return self.conv(p) + a


@pytest.mark.parametrize("model", [
    PadConv(value=0.5),  # not zeros
    PadConv(pads=TF_SAME, value=0.5),
    PadConv(mode="reflect"),
    PadConv(pads=TF_SAME, mode="reflect"),
    PadConv(pads=(1, 2, 1, 1), mode="replicate"),
    PadPool(nn.MaxPool2d(3, 1)),  # max pool pads with -inf, not zeros
    PadPool(nn.MaxPool2d(2), pads=TF_SAME),
    PadPool(nn.AvgPool2d(3, 1, count_include_pad=False, padding=1)),  # the zeros would not be counted
    PadPool(nn.AvgPool2d(2, count_include_pad=False), pads=TF_SAME),
    PadPool(nn.AvgPool2d(2, ceil_mode=True), pads=TF_SAME),
    PadPool(nn.AvgPool2d(3, 1, padding=1)),  # 2 > kernel // 2: torch refuses such a pool
    PadPool(nn.AvgPool2d(2), pads=(0, 2, 0, 0)),  # one side over kernel // 2
    TwoUsers(),  # the padded value is read elsewhere too
    ChangedBetween(),  # the pad's input changes in place before the conv reads the pad
], ids=["nonzero", "nonzero-asymmetric", "reflect", "reflect-asymmetric", "replicate-asymmetric", "max-pool",
        "max-pool-asymmetric", "not-counted", "not-counted-asymmetric", "ceil-mode", "over-half-kernel",
        "one-side-over-half-kernel", "two-users", "changed-in-place-between"])
def test_pad_rows_decline(model):
    ref = model(X)
    gm, _, result = _run(model)
    assert not result.modified
    assert any(n.op == "call_function" and n.target is F.pad for n in gm.graph.nodes)
    out = gm(X)
    assert all(torch.equal(a, b) for a, b in zip(out, ref)) if isinstance(ref, tuple) else torch.equal(out, ref)


@settings(max_examples=60, deadline=None)
@given(pads=st.tuples(*[st.integers(0, 3)] * 4), k=st.integers(1, 5), stride=st.integers(1, 3),
       conv_padding=st.integers(0, 2), pool=st.booleans())
def test_the_fold_computes_the_same_floats(pads, k, stride, conv_padding, pool):
    """Any zero pad (l, r, t, b) before a conv / counting average pool: the rewritten graph's floats are the
    original's (bit for bit, or within float32 rounding where torch's padded conv sums in another order)."""
    torch.manual_seed(0)
    if pool:
        model = PadPool(nn.AvgPool2d(k, stride), pads=pads)
    else:
        model = PadConv(pads=pads, conv_padding=conv_padding)
        model.conv = nn.Conv2d(3, 4, k, stride, conv_padding)
    ref = model(X)
    gm, _, result = _run(model)
    l, r, t, b = pads
    assert result.modified == (not pool or max(l, r, t, b) <= k // 2)
    # exact: a pool; a conv left alone; a four-sided conv that had no padding (F.pad then an unpadded
    # conv, as before); a symmetric fold is torch's padded conv kernel, which may sum in another order
    if pool or not result.modified or (conv_padding == 0 and gm.conv.padding_mode == "constant"):
        assert torch.equal(gm(X), ref)
    else:
        torch.testing.assert_close(gm(X), ref, atol=1e-6, rtol=1e-6)


def test_a_shared_conv_keeps_its_padding():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            return self.conv(F.pad(x, (1, 1, 1, 1)))[:, :, 1:-1, 1:-1] + self.conv(x)

    model = Shared()
    gm, _, result = _run(model)
    assert not result.modified
    assert torch.equal(gm(X), model(X))


@pytest.mark.parametrize("pads", [(2, 2, 1, 1), TF_SAME], ids=["symmetric", "asymmetric"])
def test_the_march_must_accept_the_new_padding(monkeypatch, pads):
    seen = []

    class Refusing:
        def check(self, info):
            seen.append(info.attrs["padding"])
            return False, "padding too large"

    monkeypatch.setattr(rw, "op_table", lambda march: Refusing())
    gm, _, result = _run(PadConv(pads=pads))
    assert not result.modified and gm.conv.padding == (1, 1)
    assert seen[0] == ((2, 3) if pads[0] == 2 else (1, 1, 2, 2))  # the march judged the new padding


def test_index_none_becomes_unsqueeze():
    model = Unsqueeze()
    ref = model(X)
    gm, ctx, result = _run(model)
    assert result.modified
    assert _body(gm) == ["unsqueeze = x.unsqueeze(1)", "unsqueeze_1 = x.unsqueeze(2)",
                         "add = unsqueeze + unsqueeze_1;  unsqueeze = unsqueeze_1 = None",
                         "unsqueeze_2 = x.unsqueeze(3);  x = None", "return (add, unsqueeze_2)"]
    assert all(torch.equal(a, b) for a, b in zip(gm(X), ref))
    assert not rw.rewrite(gm, ctx).modified


@pytest.mark.parametrize("index", [(slice(None), 0), (slice(1, None), None), (slice(None, None, 2), None), (0,)],
                         ids=["int", "partial-slice", "step", "no-none"])
def test_index_rows_decline(index):
    class Index(nn.Module):
        def forward(self, x):
            return x[index]

    model = Index()
    gm, _, result = _run(model)
    assert not result.modified
    assert torch.equal(gm(X), model(X))


def test_the_placement_reason_shows_the_rewrite():
    gm = qcompiler.partition(PadConv().eval(), (X,), march="bayes")
    conv = next(n for n in gm.graph.nodes if n.name == "conv")
    assert conv.meta[META_REASON] == ("conv2d supported on bayes (F.pad with zeros folded into the padding of the "
                                      "conv / average pool after it)")
    assert not any(n.op == "call_function" and n.target is F.pad for n in gm.graph.nodes)


def test_rewritten_models_compile_bit_exact_with_their_converted_model():
    torch.manual_seed(0)
    cm = qcompiler.compile(PadConv().eval(), (X,), march="bayes", progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]  # the pad no longer splits the graph
    assert [s.kind for s in qcompiler.compile(PadConv(value=0.5).eval(), (X,), march="bayes",
                                              progress=False).runtime.steps] != ["bpu"]
    assert torch.equal(cm(X), cm.converted(X))


def test_the_verifier_names_a_row_that_still_matches():
    gm = trace(PadConv().eval())
    propagate_shapes(gm, (X,))
    with pytest.raises(PassError, match=r"rewrite: row 'pad_into_layer' still matches node 'pad'"):
        rw.verify_rewritten(gm, CompileContext(march=March.BAYES, example_inputs=(X,)))


def test_each_unsqueeze_step_has_its_shape_for_the_emitter():
    """x[:, :, None, None] becomes two unsqueezes; both carry their shapes, so the CPU island is ONNX."""

    class TwoNones(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 2, 1)

        def forward(self, x):
            return self.conv(x.flatten(2))[:, :, None, None, :].sigmoid()

    gm, _, result = _run(TwoNones())
    shapes = [n.meta["qc_tensor"].shape for n in gm.graph.nodes if n.op == "call_method" and n.target == "unsqueeze"]
    assert result.modified and shapes == [(2, 2, 1, 64), (2, 2, 1, 1, 64)]
    cm = qcompiler.compile(TwoNones().eval(), (X,), march="bernoulli2", progress=False)
    assert cm.torch_islands() == {}
    torch.testing.assert_close(cm(X), cm.converted(X), atol=1e-6, rtol=1e-6)  # onnxruntime vs torch floats


# ------------------------------------------------------------------ four-sided padding end to end


class SamePadded(nn.Module):
    """TF-style "same" padding before stride-2 layers (/tmp/d/pad.py of the issue), with a BN to fuse."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, 2), nn.BatchNorm2d(8)
        self.c2, self.p = nn.Conv2d(8, 8, 3, 1), nn.AvgPool2d(2)

    def forward(self, x):
        x = self.bn(self.c1(F.pad(x, TF_SAME))).relu()
        x = self.c2(F.pad(x, (1, 1, 1, 1))).relu()
        return self.p(F.pad(x, TF_SAME))


def _deq(v):
    return v.dequantize() if isinstance(v, QTensor) else v


@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_same_padded_model_is_one_bpu_partition_bit_exact_everywhere(march, tmp_path):
    """One BPU partition (was 2 BPU + 2 CPU); the program holds the four sides; the simulator (fast and
    fixed-point kernels), the converted model, the ONNX export and a saved-and-loaded artifact agree bit for bit."""
    torch.manual_seed(0)
    model = SamePadded().eval()
    x = torch.rand(1, 3, 32, 32)
    cm = qcompiler.compile(model, (x,), march=march, calib_data=[(torch.rand(2, 3, 32, 32),)], progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    (program,) = cm.runtime.programs.values()
    # conv + BN + relu fused into one op that pads four sides; the symmetric pad keeps its pair
    assert [(op.kind, op.attrs.get("padding"), op.attrs.get("act")) for op in program.ops] == [
        ("quantize", None, None), ("conv2d", [0, 0, 1, 1], "relu"), ("conv2d", [1, 1], "relu"),
        ("avg_pool2d", [0, 0, 1, 1], None), ("dequantize", None, None)]
    assert cm.converted.get_submodule("c1").geometry["padding"] == (0, 0, 1, 1)
    y = cm(x)
    assert torch.equal(_deq(y), _deq(cm.converted(x)))
    sim_in = {program.inputs[0].name: x}
    outs = [BpuSimulator(program, kernels=k).run(sim_in) for k in ("fast", "fixed_point")]
    assert all(torch.equal(_deq(a), _deq(b)) for a, b in zip(outs[0].values(), outs[1].values()))
    assert_export_is_compiled(cm, (x,), tmp_path, min_points=3)
    cm.save(tmp_path / "m.qc")
    assert torch.equal(_deq(qcompiler.load(tmp_path / "m.qc")(x)), _deq(y))
    out = next(n for n in cm.converted.graph.nodes if n.op == "output").args[0]
    lsb = cm.converted.get_submodule(out.args[0].target).out_scale
    assert (_deq(y) - model(x)).abs().max() < 4 * lsb  # and it still computes the float model


def test_the_placement_dump_shows_the_asymmetric_fold(tmp_path):
    gm = qcompiler.partition(PadConv(pads=TF_SAME).eval(), (X,), march="bernoulli2")
    (row,) = [r for r in partition_table(gm) if r["node"] == "conv"]
    assert row["placement"] == "bpu"
    assert row["reason"] == ("conv2d supported on bernoulli2 (F.pad with zeros folded into the padding of the "
                             "conv / average pool after it)")


def test_placement_reads_the_largest_of_four_sides():
    """bayes allows pool padding <= 256 (MARCH_OPS.md): a four-sided padding is judged by its largest side."""

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = PaddedAvgPool2d(2, padding=(0, 0, 1, 300))

        def forward(self, x):
            return self.pool(x)

    x = torch.rand(1, 1, 4, 4)
    gm = trace(Pool())
    propagate_shapes(gm, (x,))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    info = op_info(node, "avg_pool2d", dict(gm.named_modules()))
    assert info.attrs["padding"] == (0, 0, 1, 300)
    ok, why = rw.op_table(March.BAYES).check(info)
    assert not ok and "pool padding 300 > 256" in why


def test_qat_layers_pad_four_sides_and_compile(tmp_path):
    """prepare_qat_fx folds the pad too: the observed conv pads four sides (torch's _conv_forward), trains,
    and converts to what the compiled model computes."""
    torch.manual_seed(0)
    model = SamePadded()
    x = torch.rand(2, 3, 16, 16)
    qat = qcompiler.prepare_qat_fx(model, example_inputs=(x,), march="bayes")
    assert not any(n.op == "call_function" and n.target is F.pad for n in qat.graph.nodes)
    layer = qat.get_submodule("c1")
    base = layer.op if hasattr(layer, "op") else layer
    assert base.padding == (0, 0, 1, 1) and base.padding_mode == "constant"
    qat.train()
    opt = torch.optim.SGD(qat.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        qat(x).pow(2).mean().backward()
        opt.step()
    set_state(qat, "validation")
    qat.eval()
    cm = qcompiler.compile(qat, (x,), mode="qat", progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    assert torch.equal(_deq(cm(x)), _deq(qcompiler.convert_fx(qat)(x)))


def test_four_sided_layers_forced_to_the_cpu_are_onnx_islands(tmp_path):
    """hybrid_dict keeps the folded conv and pool on the CPU: onnxruntime runs them (Conv / AveragePool
    with four-sided pads), no torch island, the same values as the converted graph's torch layers."""
    torch.manual_seed(0)
    x = torch.rand(1, 3, 32, 32)
    cm = qcompiler.compile(SamePadded().eval(), (x,), march="bayes", hybrid_dict={"module_name": ["c1", "p"]},
                           progress=False)
    assert [s.kind for s in cm.runtime.steps] == ["cpu", "bpu", "cpu"] and cm.torch_islands() == {}
    assert isinstance(cm.converted.get_submodule("p"), PaddedAvgPool2d)
    y = cm(x)
    torch.testing.assert_close(y, cm.converted(x), atol=1e-7, rtol=1e-6)  # onnxruntime vs torch floats
    cm.save(tmp_path / "m.qc")
    assert torch.equal(qcompiler.load(tmp_path / "m.qc")(x), y)


@pytest.mark.parametrize("kind,padding", [("conv2d", [0, 0, 1]), ("conv2d", [0, 0, 1, -1]), ("avg_pool2d", [1]),
                                          ("max_pool2d", [0, 0, 1, 1]), ("conv_transpose2d", [0, 0, 1, 1])])
def test_an_artifact_with_a_malformed_padding_is_refused(kind, padding):
    """The artifact check (ArtifactError at load) takes four sides only where a folded pad puts them
    (conv2d, avg_pool2d), as two or four ints >= 0."""
    assert ATTRS[kind]["padding"](padding) is not None
    assert ATTRS[kind]["padding"]([1, 2]) is None


@pytest.mark.parametrize("kind", ["conv2d", "avg_pool2d"])
def test_four_sides_are_a_well_formed_padding(kind):
    assert ATTRS[kind]["padding"]([0, 0, 1, 1]) is None


@settings(max_examples=40, deadline=None)
@given(pads=st.tuples(*[st.integers(0, 3)] * 4), k=st.integers(1, 4), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_four_sided_fixed_point_kernels_equal_torch_on_the_zero_padded_codes(pads, k, stride, dilation, seed):
    """fixed_point.int_conv2d / int_avg_pool2d with (t, l, b, r): torch (float64, exact on these integers)
    on the codes explicitly zero-padded, then unpadded."""
    g = torch.Generator().manual_seed(seed)
    t, l, b, r = pads
    q = torch.randint(-128, 128, (2, 3, 9, 8), generator=g, dtype=torch.int8)  # fits k=4 at dilation 2
    w = torch.randint(-128, 128, (4, 3, k, k), generator=g, dtype=torch.int8)
    padded = F.pad(q.double(), (l, r, t, b))
    want = F.conv2d(padded, w.double(), None, stride, 0, dilation).to(torch.int64)
    assert torch.equal(fp.int_conv2d(q, w, None, stride, pads, dilation), want)
    if max(t, b) <= k // 2 and max(l, r) <= k // 2:
        sums = F.avg_pool2d(padded, k, stride, 0, divisor_override=1).to(torch.int64)
        got = fp.int_avg_pool2d(q, k, stride, pads, in_scale=1.0, out_scale=1.0, out_dtype="qint16")
        assert torch.equal(got, fp.requantize(sums, *fp.requant_params(1.0 / (k * k)), "qint16"))


# ------------------------------------------------------------------ conv padding="same" / "valid"


@pytest.mark.parametrize("padding, kernel, dilation, want", [
    ("same", 3, 1, [1, 1]), ("same", 4, 1, [1, 1, 2, 2]), ("same", 3, 2, [2, 2]), ("same", (2, 3), 1, [0, 1, 1, 1]),
    ("valid", 3, 1, [0, 0]),
])
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_string_conv_padding_becomes_numbers_and_compiles_exactly(padding, kernel, dilation, want, march, tmp_path):
    """nn.Conv2d(padding="same" / "valid") compiles (it failed in convert with a raw ValueError): the
    padding torch computes, odd totals at the bottom / right, bit-exact through simulator and export."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, kernel, padding=padding, dilation=dilation), nn.ReLU()).eval()
    x = torch.rand(2, 3, 12, 12)
    cm = qcompiler.compile(model, (x,), march=march, calib_data=[(torch.rand(2, 3, 12, 12),)], progress=False)
    (program,) = cm.runtime.programs.values()
    assert [op.attrs.get("padding") for op in program.ops if op.kind == "conv2d"] == [want]
    y = cm(x)
    assert y.shape == model(x).shape
    assert torch.equal(_deq(y), _deq(cm.converted(x)))
    assert_export_is_compiled(cm, (x,), tmp_path, min_points=1)
    gm = qcompiler.partition(model, (x,), march=march)
    (row,) = [r for r in partition_table(gm) if r["node"] == "_0"]
    assert row["placement"] == "bpu" and 'padding="same" / "valid" written as the numbers' in row["reason"]


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 8, 3, padding="same", padding_mode="circular"),  # not zeros: no numeric zero padding
    nn.Conv2d(3, 8, 3, padding=1),  # already numbers
    nn.Conv1d(3, 8, 3, padding="same"),  # not a conv2d
])
def test_the_string_padding_row_declines(conv):
    gm = torch.fx.symbolic_trace(nn.Sequential(conv))
    (row,) = [r for r in rw.REWRITES if r.name == "conv_padding_as_numbers"]
    (node,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert row.match(node, gm, None) is None


# ------------------------------------------------------------------ reshapes to sizes read from tensors


class FlattenBySize(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        y = torch.relu(self.c(x))
        return self.fc(y.view(y.size(0), -1))


class SqueezeExcite(nn.Module):
    """The squeeze-and-excitation block as MobileNetV3 / EfficientNet code writes it."""

    def __init__(self):
        super().__init__()
        self.c, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        x = torch.relu(self.c(x))
        b, c, _, _ = x.size()
        y = self.pool(x).view(b, c)
        y = torch.sigmoid(self.fc2(torch.relu(self.fc1(y)))).view(b, c, 1, 1)
        return x * y


def test_a_reshape_to_sizes_becomes_numbers_with_the_batch_as_minus_one_golden():
    gm, _, result = _run(FlattenBySize(), torch.rand(2, 3, 6, 6))
    assert result.modified
    assert _body(gm) == ["c = self.c(x);  x = None", "relu = torch.relu(c);  c = None",
                         "view = relu.view(-1, 288);  relu = None", "fc = self.fc(view);  view = None",
                         "return fc"], _body(gm)
    assert [n.meta.get(META_REWRITE) for n in gm.graph.nodes if n.target == "view"] == [
        "reshape to sizes read from tensors written as numbers, the batch as -1"]


@pytest.mark.parametrize("model", [FlattenBySize, SqueezeExcite])
@pytest.mark.parametrize("march", ["bayes", "bernoulli2"])
def test_models_reshaping_to_their_sizes_compile_and_take_other_batches(model, march, tmp_path):
    """``x.view(x.size(0), -1)`` and the SE block's ``view(b, c)`` failed to compile ("node 'size' ...
    in BPU partition: no BPU op kind"); now they compile, and another batch size gives the converted
    model's outputs bit for bit."""
    torch.manual_seed(0)
    m = model().eval()
    x = torch.rand(2, 3, 6, 6)
    cm = qcompiler.compile(m, (x,), march=march, calib_data=[(torch.rand(2, 3, 6, 6),)], progress=False)
    assert not any(n.op == "call_method" and n.target == "size" for n in cm.converted.graph.nodes)
    for batch in (2, 5):
        xb = torch.rand(batch, 3, 6, 6)
        y = cm(xb)
        assert y.shape == m(xb).shape and torch.equal(_deq(y), _deq(cm.converted(xb)))
    assert_export_is_compiled(cm, (x,), tmp_path, min_points=1)


class SizeMayBeTheBatch(nn.Module):
    def forward(self, x):  # x: (N, N, 4): a size read of dim 1 equals the batch in the example
        y = torch.relu(x)
        return y.view(y.size(1), -1)


def test_a_size_read_that_equals_the_batch_is_not_made_a_number():
    gm = trace(SizeMayBeTheBatch())
    propagate_shapes(gm, (torch.rand(3, 3, 4),))
    (row,) = [r for r in rw.REWRITES if r.name == "reshape_sizes_as_numbers"]
    (view,) = [n for n in gm.graph.nodes if n.target == "view"]
    assert row.match(view, gm, None) is None


class SizeArithmetic(nn.Module):
    def __init__(self, batch_in_arithmetic: bool):
        super().__init__()
        self.batch_in_arithmetic = batch_in_arithmetic

    def forward(self, x):
        y = torch.relu(x)
        if self.batch_in_arithmetic:  # the batch size times 2: changes with the batch, stays as it is
            return y.reshape(y.size(0) * 2, -1)
        b, c, h, w = y.size()
        return y.view(b, c, h * w)  # h * w does not change with the batch: a number


@pytest.mark.parametrize("batch_in_arithmetic, want", [(False, [-1, 4, 30]), (True, None)])
def test_sizes_in_arithmetic_become_numbers_only_without_the_batch(batch_in_arithmetic, want):
    gm = trace(SizeArithmetic(batch_in_arithmetic))
    propagate_shapes(gm, (torch.rand(2, 4, 5, 6),))
    (row,) = [r for r in rw.REWRITES if r.name == "reshape_sizes_as_numbers"]
    (node,) = [n for n in gm.graph.nodes if n.target in ("view", "reshape")]
    assert row.match(node, gm, None) == want
