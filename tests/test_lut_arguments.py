"""A table samples the function the call asked for: gelu's tanh form and elu's alpha reach the table
(before, the table of every gelu was the erf form and of every elu alpha=1: a wrong answer, no error)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.nn import quantized as qnn
from qcompiler.quantization import fixed_point as fp
from qcompiler.quantization.qconfig import get_default_calib_qconfig

CALIB = torch.linspace(-4, 4, 256).reshape(1, 4, 64)


class Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


CASES = {
    "gelu tanh module": (nn.GELU(approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "gelu tanh function": (lambda x: F.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "gelu erf": (nn.GELU(), F.gelu),
    "elu alpha module": (nn.ELU(alpha=0.5), lambda x: F.elu(x, alpha=0.5)),
    "elu alpha function": (lambda x: F.elu(x, 0.25), lambda x: F.elu(x, alpha=0.25)),
}


@pytest.mark.parametrize("case", CASES)
def test_the_table_is_of_the_call_s_own_function(case):
    call, fn = CASES[case]
    model = Call(call if isinstance(call, nn.Module) else call)
    if isinstance(call, nn.Module):
        model = nn.Sequential(call)
    qconfig = {"": get_default_calib_qconfig(dtype="qint16", observer="minmax")}
    cm = qcompiler.compile(model.eval(), (CALIB,), calib_data=[(CALIB,)], march="nash", qconfig_dict=qconfig,
                           progress=False)
    (lookup,) = [m for m in cm.converted.modules() if isinstance(m, qnn.QuantizedLookup)]
    want = fp.build_lut(fn, lookup.in_scale, lookup.out_scale, lookup.in_dtype, "qint16")
    assert torch.equal(lookup.table, want), case
    with torch.no_grad():
        err = (cm(CALIB) - fn(CALIB)).abs().max().item()
    assert err < 3 * lookup.out_scale, (case, err, lookup.out_scale)  # int16 in and out: a few LSB
