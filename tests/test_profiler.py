"""ModelProfiler: per-layer statistics of a converted hybrid model, stack lines, tensorboard."""

import importlib.util
import warnings

import pytest
import torch

from qcompiler.errors import ConfigError
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.prepare import prepare_qat_fx
from qcompiler.tools.profiler import STATISTIC_FILE, ModelProfiler
from qcompiler.zoo.hybrid import _SeluModule

X = torch.rand(1, 3, 16, 16)
HD = {"module_name": ["conv1.conv", "conv3"], "module_type": [_SeluModule]}


@pytest.fixture
def converted(hybrid_model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat = prepare_qat_fx(hybrid_model, hybrid=True, hybrid_dict=HD, example_inputs=X)
    qat.eval()
    qat(X)
    return convert_fx(qat)


def test_statistics_of_converted_model(converted, tmp_path):
    ref = converted(X)
    with ModelProfiler(converted, str(tmp_path)) as p:
        out = converted(X)
    assert torch.equal(out, ref)
    assert not any(m._forward_hooks for m in converted.modules())  # hooks removed
    rows = [r for r in p.get_info_manager().records if r.mod_name == "conv0"]
    attrs = [r.attr for r in rows]
    assert attrs[0] == "input" and attrs[-1] == "output" and "weight" in attrs and "bias" in attrs
    o = rows[-1]
    assert o.shape == (1, 3, 16, 16) and o.dtype == "qint8"
    assert float(o.scale) == pytest.approx(converted.conv0.out_scale, rel=1e-6)
    text = p.get_info_manager().table(with_stack=True)
    assert (tmp_path / STATISTIC_FILE).read_text() == text
    line = next(x for x in text.splitlines() if "| conv0 " in x and "| output " in x)
    assert "torch.Size([1, 3, 16, 16])" in line and o.scale in line
    assert "hybrid.py:" in line  # the model's source line of the call
    only = p.get_info_manager().table(out_dir=str(tmp_path / "sub"), prefixes=("conv0",))
    assert "conv2" not in only and "conv0" in only


def test_fake_quant_model_reports_quantizer_scale(hybrid_model, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat = prepare_qat_fx(hybrid_model, hybrid=True, hybrid_dict=HD, example_inputs=X)
    qat.eval()
    qat(X)
    with ModelProfiler(qat, str(tmp_path)) as p:
        qat(X)
    out = [r for r in p.get_info_manager().records if r.mod_name == "conv0" and r.attr == "output"][0]
    assert out.dtype == "qint8" and float(out.scale) == pytest.approx(qat.conv0.activation_post_process.scale.item())


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_a_config_error(converted, tmp_path):
    with ModelProfiler(converted, str(tmp_path)) as p:
        converted(X)
    with pytest.raises(ConfigError, match="tensorboard is not installed: pip install qcompiler\\[tensorboard\\]"):
        p.get_info_manager().tensorboard()
