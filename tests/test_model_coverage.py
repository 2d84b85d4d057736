"""The model-coverage benchmark's harness (benchmarks/model_coverage.py) on a few small models, so it cannot rot:
discovery and construction of every case, one model through every check, a model with a torch island
(refusals counted apart), and failures classified by stage / type / first line (raw vs QCompilerError)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from benchmarks.model_coverage import (
    Case,
    all_cases,
    counts,
    failure_categories,
    fx_reference,
    markdown,
    model_classes,
    run_case,
    select,
)


def _case(name: str):
    (case,) = [c for c in all_cases() if c.name == name]
    return case


def test_every_class_is_found_and_builds_with_its_inputs():
    classes = model_classes()
    assert len(classes) >= 116  # torch 2.13: 76 + 24 TestHelperModules + 2 package + 14 pruning
    assert {"SparseNNModel", "TestHelperModules.ConvWithBNRelu", "LSTMLinearModel",
            "LinearReluFunctional"} <= set(classes)
    cases = all_cases()
    assert {"RNNDynamicModel[GRU]", "RNNCellDynamicModel[LSTMCell]"} <= {c.name for c in cases}
    for case in cases:  # every constructor argument and every input table entry is right for its model
        model, inputs = case.build()
        assert isinstance(model, nn.Module) and isinstance(inputs, tuple) and inputs, case.name
        assert not model.training, case.name


def test_a_linear_model_passes_every_check_on_both_marches(tmp_path):
    case = _case("TestHelperModules.LinearReluModel")
    fx = fx_reference(case)
    assert fx["ok"]
    rows = [run_case(case, march, tmp_path, fx) for march in ("bayes", "bernoulli2")]
    for row in rows:
        assert row["errors"] == []
        assert (row["compile"], row["call"], row["export"], row["saveload"]) == ("ok", "ok", "ok", "ok")
        assert row["islands"] == 0 and row["bpu"] == 1 and row["export_match"] is True and row["export_diff"] == 0.0
        assert 25 < row["sqnr_float"] < math.inf and row["sqnr_fx"] > 25  # int8 on a 5x5 linear + relu
    lines = dict(counts(rows, ["bayes", "bernoulli2"]))
    assert lines["bayes: compile OK (cases)"] == "1/1"
    assert lines["bayes: no BPU partition (the whole model stays float on the CPU)"] == "0/1"
    assert lines["bayes: exported bit-identical to compiled (max diff 0)"] == "1/1"  # integer-exact linear
    assert lines["raw errors (not a QCompilerError), all stages and marches"] == "0"
    assert "| TestHelperModules.LinearReluModel | bayes" in markdown(rows, ["bayes", "bernoulli2"], 1.0, [])


class _Bessel(nn.Module):
    """A linear on the BPU, then an op ONNX opset 11 has no form for: an eager-torch island."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.special.bessel_j0(self.fc(x))


def test_torch_island_refusals_are_counted_apart_from_failures(tmp_path):
    row = run_case(Case("Bessel", _Bessel, inputs=lambda: (torch.randn(2, 4),)), "bayes", tmp_path)
    assert (row["compile"], row["call"], row["bpu"], row["islands"]) == ("ok", "ok", 1, 1)
    assert (row["export"], row["saveload"]) == ("refused", "refused")
    assert row["errors"] == [] and row["sqnr_float"] > 25
    lines = dict(counts([row], ["bayes"]))
    assert lines["bayes: export + checker + onnxruntime OK"] == "0/1 (refused, torch islands: 1; failed: 0)"


class _Broken(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return self.fc(x)


def test_failures_are_classified_by_stage_type_and_first_line(tmp_path):
    # a constructor that raises: a raw error at the build stage
    row = run_case(Case("Broken", _Broken), "bayes", tmp_path)  # missing argument n
    assert row["compile"] == "fail"
    [(cat, raw)] = row["errors"]
    assert cat.startswith("build: TypeError: ") and raw
    # a documented refusal of compile: not raw
    bad = run_case(Case("Broken[bad-march]", _Broken, (4,), inputs=lambda: (torch.randn(2, 4),)), "no-such-march",
                   tmp_path)
    [(cat2, raw2)] = bad["errors"]
    assert cat2.startswith("compile: ConfigError: ") and "\n" not in cat2 and not raw2
    cats = failure_categories([row, bad])
    assert [(n, r) for n, _, r, _ in cats] == [(1, "raw"), (1, "")]
    assert dict(counts([row, bad], ["bayes"]))["raw errors (not a QCompilerError), all stages and marches"] == "1"


def test_select_by_class_case_or_short_name():
    cases = all_cases()
    assert [c.name for c in select(cases, ["RNNDynamicModel"])] == ["RNNDynamicModel[LSTM]", "RNNDynamicModel[GRU]"]
    assert [c.name for c in select(cases, ["ThreeAdd"])] == ["TestHelperModules.ThreeAdd"]
    with pytest.raises(SystemExit, match="unknown model"):
        select(cases, ["NoSuchModel"])


def test_inputs_are_seeded():
    a, b = _case("SimpleLinear").build()[1], _case("SimpleLinear").build()[1]
    assert torch.equal(a[0], b[0])
