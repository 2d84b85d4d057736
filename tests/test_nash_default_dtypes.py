"""nash's per-op default output types (OpTable.default_dtypes): the accuracy criterion of issue 34 and
that user qconfigs and other marches are untouched."""

import contextlib
import io
import warnings

import pytest
import torch

import qcompiler
from benchmarks import architecture_zoo as hf
from qcompiler import zoo
from qcompiler.backends.bpu import op_table
from qcompiler.ir.meta import META_DTYPE_REASON, META_OP
from qcompiler.quantization import get_default_calib_qconfig, prepare_calibration_fx


def _compile(model, batches, march, **kw):
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcompiler.compile(model, batches[0], march=march, calib_data=batches, progress=False, **kw)


def _sqnr_pair(name):
    if name == "transformer_block":
        model = zoo.get("transformer_block").eval()
        batches = [(torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(i)),) for i in range(9)]
        x, calib = batches[8], batches[:8]
        call = lambda m: m(*x)  # noqa: E731
    else:
        case = hf.BY_NAME[name]
        model = case.model().eval()
        calib = [case.inputs(i) for i in range(8)]
        x = calib[0]
        call = lambda m: m(**x)  # noqa: E731
    with torch.no_grad():
        ref = call(model)
        return {march: hf.sqnr(ref, call(_compile(model, calib, march))) for march in ("bayes", "nash")}


@pytest.mark.parametrize("name", ["transformer_block", "BERT"])
def test_nash_default_within_1db_of_bayes(name):
    s = _sqnr_pair(name)
    assert s["nash"] >= s["bayes"] - 1.0, s


def _ln_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)).eval()


def _ln_dtype(march, qconfig_dict=None):
    x = (torch.randn(2, 8),)
    gm = prepare_calibration_fx(_ln_model(), qconfig_dict, hybrid=True, example_inputs=x, march=march)
    ln = [n for n in gm.graph.nodes if n.meta.get(META_OP) == "layer_norm"]
    assert len(ln) == 1
    return ln[0], gm.get_submodule("_1_activation_post_process").activation_post_process.dtype


def test_default_table_is_nash_only():
    assert op_table("bayes").default_dtypes == {} and op_table("bernoulli2").default_dtypes == {}
    for op, d in op_table("nash").default_dtypes.items():
        assert op_table("nash").rule(op).int16 and d.dtype == "qint16" and d.reason


def test_default_applies_on_nash_not_bayes_and_user_entry_wins():
    node, dtype = _ln_dtype("nash")
    assert str(dtype).endswith("qint16") and "nash default" in node.meta[META_DTYPE_REASON]
    node, dtype = _ln_dtype("bayes")
    assert str(dtype).endswith("qint8") and META_DTYPE_REASON not in node.meta
    user = {"": get_default_calib_qconfig(), "module_name": [("1", get_default_calib_qconfig())]}
    node, dtype = _ln_dtype("nash", user)
    assert str(dtype).endswith("qint8") and META_DTYPE_REASON not in node.meta
