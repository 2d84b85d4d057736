"""nash selection with constant indices (getitem with int / slice / None / ... entries, narrow, torch.export's
aten.slice):
placement beside bayes, the reasons for what stays on CPU, and the converted module == BPU simulator
== integer ONNX export in onnxruntime, bit for bit, over seeded random shapes and indices.

The codes move unchanged (the input's grid): int16 is compared module == simulator (the opset-11
export of an int16 graph is its float form)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.backends.bpu.sim.executor import BpuSimulator
from qcompiler.quantization.qconfig import get_default_calib_qconfig
from qcompiler.quantization.qtensor import QTensor

sys.path.insert(0, str(Path(__file__).parent))
from test_export_exact import assert_export_is_compiled  # noqa: E402
from test_nash_table import placed  # noqa: E402


class Select(nn.Module):
    """A linear, then ``pick(self, y)``; a constant index buffer for the tensor-index case."""

    def __init__(self, pick, features=8):
        super().__init__()
        self.lin, self.pick = nn.Linear(features, features), pick
        self.register_buffer("idx", torch.tensor([0, 2, 1]))

    def forward(self, x):
        return self.pick(self, self.lin(x))


X = torch.randn(2, 4, 8)


def where(model, x, march, op):
    """(placement, reason) of the last ``op`` node: the selection the model returns."""
    return [v for k, v in placed(model, x, march).items() if k.startswith(op)][-1]


@pytest.mark.parametrize("op, pick", [
    ("getitem", lambda s, y: y[:, 1:3]),
    ("getitem", lambda s, y: y[:, 1]),
    ("getitem", lambda s, y: y[..., ::2]),
    ("getitem", lambda s, y: y[:, -2:, 3:7]),
    ("narrow", lambda s, y: y.narrow(1, 1, 2)),
    ("narrow", lambda s, y: torch.narrow(y, -1, -3, 2)),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, 1, 0, 2 ** 63 - 1, 2)),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, -1, -3)),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, 0, 0, 2 ** 63 - 1)),  # the whole batch
])
def test_constant_selections_run_on_nash_not_on_bayes(op, pick):
    assert where(Select(pick), X, "nash", op) == ("bpu", f"{op} supported on nash")
    assert where(Select(pick), X, "bayes", op) == ("cpu", f"{op} is not supported on bayes")


@pytest.mark.parametrize("op, pick, reason", [
    ("getitem", lambda s, y: y[:, s.idx],
     "getitem: getitem with a tensor index (a buffer or a value computed in forward): the BPU takes constant "
     "int / slice indices on nash"),
    ("getitem", lambda s, y: y[:, y[0, 0, :4].argmax()],  # an index < 4, computed in forward
     "getitem: getitem with a tensor index (a buffer or a value computed in forward): the BPU takes constant "
     "int / slice indices on nash"),
    ("getitem", lambda s, y: y[1:],
     "getitem: getitem with index slice(1, None, None) indexes the batch (dim 0); the BPU keeps it whole on nash"),
    ("getitem", lambda s, y: y[0],
     "getitem: getitem with index 0 indexes the batch (dim 0); the BPU keeps it whole on nash"),
    ("getitem", lambda s, y: y[:, [0, 2]],
     "getitem: getitem with index (slice(None, None, None), [0, 2]): only ints, slices (step > 0), None and ... "
     "on nash"),
    ("narrow", lambda s, y: y.narrow(0, 0, 1), "narrow: narrow along the batch (dim 0); the BPU keeps it whole on nash"),
    ("narrow", lambda s, y: y.narrow(1, y.shape[1] - 2, 1),
     "narrow: narrow with dim / start / length computed at run time (the BPU takes constants) on nash"),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, 0, 1),
     "slice: slice along the batch (dim 0); the BPU keeps it whole on nash"),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, 0, 0, 2 ** 63 - 1, 2),
     "slice: slice along the batch (dim 0); the BPU keeps it whole on nash"),
    ("slice", lambda s, y: torch.ops.aten.slice.Tensor(y, 1, 0, y.shape[1] - 1),
     "slice: slice with dim / start / end / step computed at run time (the BPU takes constants) on nash"),
])
def test_what_stays_on_cpu_and_why(op, pick, reason):
    assert where(Select(pick), X, "nash", op) == ("cpu", reason)


def _deq(v):
    return v.dequantize() if isinstance(v, QTensor) else v


def _random_index(rng: random.Random, shape: tuple):
    """A constant index keeping dim 0: per later dim a full slice, an int, or a slice with a step; maybe an
    Ellipsis or a None."""
    entries = [slice(None)]
    for size in shape[1:]:
        r = rng.random()
        if r < 0.3:
            entries.append(rng.randrange(-size, size))
        elif r < 0.8:
            a = rng.randrange(-size, size)
            entries.append(slice(a, None if rng.random() < 0.3 else a + rng.randint(1, size), rng.choice([None, 1, 2])))
        else:
            entries.append(slice(None))
    if rng.random() < 0.3:
        entries = entries[:rng.randint(1, len(entries))] + [Ellipsis]
    return tuple(entries)


def _compile(model, x, dtype):
    torch.manual_seed(0)
    return qcompiler.compile(model.eval(), (x,), march="nash", calib_data=[(x,)], progress=False,
                             qconfig_dict={"": get_default_calib_qconfig(dtype=dtype)})


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("seed", range(10))
def test_module_simulator_and_onnx_agree_bit_for_bit(seed, dtype, tmp_path):
    rng = random.Random(seed)
    shape = (rng.randint(1, 3),) + tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) + (8,)
    if seed % 3 == 2:
        dim = rng.randrange(1, len(shape))
        start = rng.randrange(shape[dim])
        length = rng.randint(0, shape[dim] - start)
        model, kind = Select(lambda s, y: y.narrow(dim, start, length)), "narrow"
    else:
        idx = _random_index(rng, shape)
        model, kind = Select(lambda s, y: y[idx]), "getitem"
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    _agree_bit_for_bit(model, kind, x, dtype, tmp_path)


ATEN_SLICE = torch.ops.aten.slice.Tensor  # what torch.export makes of x[:, a:b:c] (Swin's patch merging)
END = 2 ** 63 - 1  # torch.export's end of x[a:]


@pytest.mark.parametrize("dtype", ["qint8", "qint16"])
@pytest.mark.parametrize("seed", range(6))
def test_aten_slices_agree_bit_for_bit(seed, dtype, tmp_path):
    rng = random.Random(100 + seed)
    shape = (rng.randint(1, 3),) + tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) + (8,)
    dim = rng.randrange(1, len(shape)) - (len(shape) if seed % 2 else 0)  # a negative dim on odd seeds
    size = shape[dim]
    start = rng.choice([None, rng.randrange(-size, size)])
    end = rng.choice([None, END, rng.randrange(-size, size + 2)])
    step = rng.choice([1, 2, 3])
    if len(torch.arange(size)[start:end:step]) == 0:
        start, end = 0, None  # keep one entry at least
    model = Select(lambda s, y: ATEN_SLICE(y, dim, start, end, step))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(model(x), model.lin(x)[(slice(None),) * (dim % len(shape)) + (slice(start, end, step),)])
    _agree_bit_for_bit(model, "slice", x, dtype, tmp_path)


def _agree_bit_for_bit(model, kind, x, dtype, tmp_path):
    assert where(model, x, "nash", kind)[0] == "bpu"
    cm = _compile(model, x, dtype)
    assert [s.kind for s in cm.runtime.steps] == ["bpu"]
    (program,) = cm.runtime.programs.values()
    kinds = [op.kind for op in program.ops]
    assert kinds == ["quantize", "linear", "getitem", "dequantize"]
    lin, sel = program.ops[1], program.ops[2]
    assert sel.attrs["out_scale"] == lin.attrs["out_scale"]  # the input's grid
    y = cm(x)
    with torch.no_grad():
        assert y.shape == model(x).shape
    for kernels in ("fast", "fixed_point"):
        (out,) = BpuSimulator(program, kernels=kernels).run({program.inputs[0].name: x}).values()
        assert torch.equal(_deq(out), _deq(y)), kernels
    if dtype == "qint8":
        assert_export_is_compiled(cm, (x,), tmp_path, min_points=1)
    # the same codes as the linear's, selected: the converted linear's output indexed in torch
    quant = next(n.target for n in cm.converted.graph.nodes if n.op == "call_module")  # the BPU entry
    h = cm.converted.get_submodule("lin")(cm.converted.get_submodule(quant)(x))
    assert torch.equal(_deq(y), model.pick(model, h.dequantize()))
