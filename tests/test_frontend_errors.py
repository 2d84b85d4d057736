"""Bad input to qcompiler.partition: typed errors naming the fault, and the model untouched."""

import pytest
import torch
import torch.nn as nn
from conftest import assert_untouched, snapshot
from test_tracer import WithGate

import qcompiler
from qcompiler.errors import ConfigError, QCompilerWarning, TraceError

X = torch.rand(1, 3, 16, 16)


def check(model, exc, match, **kwargs):
    snap = snapshot(model)
    args = kwargs.pop("args", (X,))
    with pytest.raises(exc, match=match):
        qcompiler.partition(model, *args, **kwargs)
    assert_untouched(model, snap)


def test_unknown_march(hybrid_model):
    check(hybrid_model, ConfigError, r"unknown march 'bayse'; allowed: bernoulli2, bayes, nash\. Did you mean 'bayes'\?", march="bayse")
    with pytest.raises(ConfigError, match="unknown march"):
        qcompiler.set_march("x3")


def test_hybrid_dict_unknown_key(hybrid_model):
    check(hybrid_model, ConfigError, r"hybrid_dict: unknown key 'module_names'; allowed keys: module_type, module_name",
          hybrid_dict={"module_names": ["conv3"]})


def test_hybrid_dict_module_name_not_in_model_suggests_close_names(hybrid_model):
    check(hybrid_model, ConfigError, r"module 'conv1.cnv' is not in the model HybridModel\. Did you mean 'conv1.conv'",
          hybrid_dict={"module_name": ["conv1.cnv"]})


def test_hybrid_dict_bad_types(hybrid_model):
    check(hybrid_model, ConfigError, r"hybrid_dict\['module_name'\] must be a list", hybrid_dict={"module_name": "conv3"})
    check(hybrid_model, ConfigError, r"cannot import module type 'torch.nn.Conv9d'", hybrid_dict={"module_type": ["torch.nn.Conv9d"]})
    check(hybrid_model, ConfigError, r"not an nn.Module subclass", hybrid_dict={"module_type": [int]})


def test_hybrid_dict_module_type_matching_nothing_is_a_warning(hybrid_model):
    with pytest.warns(QCompilerWarning, match="no module of type LSTM in HybridModel"):
        qcompiler.partition(hybrid_model, X, hybrid_dict={"module_type": [nn.LSTM]})


def test_example_inputs_that_do_not_fit(hybrid_model):
    check(hybrid_model, ConfigError, r"node 'conv0' \(module 'conv0' \(Conv2d\)\) failed on inputs \(f32\[1,4,16,16\]\)",
          args=(torch.rand(1, 4, 16, 16),))
    check(hybrid_model, ConfigError, r"forward\(input\) takes 1 inputs, got 2", args=((X, X),))
    check(hybrid_model, ConfigError, r"example_inputs: keyword input 'x' is not a parameter of "
                                     r"HybridModel.forward\(input\)", args=({"x": X},))


def test_untraceable_code_names_module_and_suggests_leaf():
    m = WithGate()  # its gate branches on a value
    check(m, TraceError, r"module 'gate' \(Gate\).*non_traceable_module_name",
          prepare_custom_config_dict={"strict_tracing": True})
    gm = qcompiler.partition(m, X, prepare_custom_config_dict={"non_traceable_module_name": ["gate"]})
    assert torch.equal(gm(X), m(X))
    # without strict_tracing the same leaf is made automatically, with a warning naming it
    with pytest.warns(QCompilerWarning, match=r"cannot trace module 'gate' \(Gate\).*Done automatically: 'gate' "
                                              r"is a leaf that runs as a whole in eager torch"):
        auto = qcompiler.partition(m, X)
    assert torch.equal(auto(X), m(X))


def test_strict_tracing_must_be_a_flag(hybrid_model):
    check(hybrid_model, ConfigError, r"prepare_custom_config_dict\['strict_tracing'\] must be True or False, got 'yes'",
          prepare_custom_config_dict={"strict_tracing": "yes"})


def test_prepare_custom_config_errors(hybrid_model):
    check(hybrid_model, ConfigError, r"unknown key 'leaf_modules'; allowed keys: preserved_attributes",
          prepare_custom_config_dict={"leaf_modules": ["conv0"]})
    check(hybrid_model, ConfigError, r"model has no attribute 'nope'", prepare_custom_config_dict={"preserved_attributes": ["nope"]})


def test_preserved_attributes_are_kept(hybrid_model):
    hybrid_model.note = "keep me"
    gm = qcompiler.partition(hybrid_model, X, prepare_custom_config_dict={"preserved_attributes": ["note"]})
    assert gm.note == "keep me"


def test_model_must_be_a_module():
    with pytest.raises(ConfigError, match="model must be a torch.nn.Module, got function"):
        qcompiler.partition(lambda x: x, X)


def test_training_model_is_untouched_and_bn_statistics_unchanged():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    snap = snapshot(m)
    qcompiler.partition(m, X + 3)
    assert_untouched(m, snap)


def test_shape_error_message_has_no_torch_traceback(hybrid_model):
    with pytest.raises(ConfigError) as info:
        qcompiler.partition(hybrid_model, torch.rand(1, 4, 16, 16))
    assert "While executing" not in str(info.value) and "Original traceback" not in str(info.value)
