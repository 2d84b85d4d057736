"""benchmarks/architecture_zoo.py: the MAC count by placement, the torch.ao wrapper, the output structure,
and the rows of the per-model subprocess mode (measured fields, a timeout as a row)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from benchmarks import architecture_zoo as zoo  # noqa: E402
from qcompiler.compiled import compile as qc_compile  # noqa: E402

# conv 3->8, 3x3 on 8x8 (6x6 out), batch 2: 2*8*36*27 MACs; linear 8->4 on 2 rows: 2*4*8
CONV_MACS, LINEAR_MACS = 2 * 8 * 36 * 27, 2 * 4 * 8


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def _compiled(**kw):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    return qc_compile(ConvLinear().eval(), (x,), march="bayes", progress=False, **kw), x


def test_macs_by_placement_counts_the_bpu_nodes():
    cm, x = _compiled()
    assert zoo.macs_by_placement(cm.converted, [x]) == {"bpu": CONV_MACS + LINEAR_MACS, "cpu": 0}


def test_macs_by_placement_counts_a_cpu_forced_layer_as_cpu():
    cm, x = _compiled(hybrid_dict={"module_name": ["head"]})
    assert zoo.macs_by_placement(cm.converted, [x]) == {"bpu": CONV_MACS, "cpu": LINEAR_MACS}


def test_ao_wrapper_takes_keyword_inputs_positionally():
    class Kw(nn.Module):
        def forward(self, a, b=None, c=None):
            return a - 2 * c

    a, c = torch.randn(3), torch.randn(3)
    w = zoo._ao_wrapper(Kw(), ["a", "c"])
    assert torch.equal(w(a, c), a - 2 * c)
    with pytest.raises(zoo.ConfigError, match="at most 4"):
        zoo._ao_wrapper(Kw(), list("abcde"))


def test_structure_names_container_and_keys():
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=torch.zeros(1))
    assert zoo.structure(out) == "BaseModelOutput(last_hidden_state)"
    assert zoo.structure((torch.zeros(1), torch.zeros(1))) == "tuple[2]"
    assert zoo.structure(out) != zoo.structure({"last_hidden_state": torch.zeros(1)})


def _check_row(row: dict) -> None:
    """The fields of a finished row are measurements, not the placeholders run_case starts from."""
    assert row["seconds"] > 0
    assert row["macs"] > 0  # the float model ran under the MAC counter
    assert row["ao_fx"] in ("ok", "fail") and (row["ao_fx"] == "ok") == (row["ao_fx_error"] is None)
    if row["compile"] != "ok":
        assert row["compile"] == "fail" and row["errors"][0][0].startswith("compile: ")
        return
    parts = row["bpu_parts"] + row["cpu_islands"] + row["torch_islands"]
    assert parts >= 1 and min(row["bpu_parts"], row["cpu_islands"], row["torch_islands"]) >= 0
    # the compiled graph accounts for the float model's work (fixed-point modules compute in torch)
    assert row["macs_compiled"] == pytest.approx(row["macs"], rel=0.01)
    assert 0.0 <= row["bpu_share"] <= 1.0 and row["macs_bpu"] <= row["macs_compiled"]
    if row["bpu_parts"] == 0:
        assert row["bpu_share"] == 0.0
    assert isinstance(row["structure"], bool)
    assert row["sqnr_float"] is not None and not math.isnan(row["sqnr_float"])
    if row["bpu_parts"] == 0:
        assert row["sqnr_float"] > 100  # nothing quantized: float on the CPU
    assert row["export"] in ("ok", "refused", "fail")
    assert (row["export"] == "refused") == (row["torch_islands"] > 0)
    if row["export"] == "ok":
        assert isinstance(row["export_match"], bool) and row["export_diff"] >= 0


def test_rows_are_measured(tmp_path):
    """ResNet and BERT in this process (the worker's run_case; a subprocess would pay torch's and
    torch.export's warm-up again)."""
    rows = [zoo.run_case(zoo.BY_NAME[name], tmp_path) for name in ("ResNet", "BERT")]
    for row in rows:
        _check_row(row)
    cells = zoo.table_rows(rows)
    assert [c[0] for c in cells] == ["ResNet", "BERT"] and all(len(c) == len(zoo.HEADERS) for c in cells)


@pytest.mark.slow
def test_subprocess_row_is_measured():
    """The benchmark's mode: the worker's row comes back through its JSON file, measured."""
    row = zoo.run_isolated("BERT", timeout=300)
    _check_row(row)
    assert row["model"] == "BERT" and row["compile"] != "crash"


def test_timeout_is_a_row():
    row = zoo.run_isolated("BERT", timeout=0.5)
    assert row["compile"] == "timeout" and "killed after" in row["errors"][0][0]
    assert zoo.table_rows([row])[0][2] == "timeout"


def test_cli_rejects_an_unknown_model():
    with pytest.raises(SystemExit):
        zoo.main(["--models", "NoSuchNet"])


# --- issue 33's done criteria (bayes) that hold at this commit ---------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["ResNet", "MobileNetV2", "EfficientNet", "RegNet", "ConvNeXt"])
def test_conv_architecture_is_on_the_bpu_and_exports(name):
    """Convolutional architectures: 0 eager-torch islands, >= 95 % of the MACs on the BPU, the export valid
    and equal to the compiled model (the models of the zoo that meet it; docs/architecture_zoo.md)."""
    row = zoo.run_isolated(name)
    assert row["compile"] == "ok", row["errors"]
    assert row["torch_islands"] == 0 and row["bpu_share"] >= 0.95
    assert row["export"] == "ok" and row["export_match"] is True



def test_a_rewrite_of_the_page_keeps_the_low_sqnr_section(tmp_path):
    """benchmarks/low_sqnr_rows.py owns its section of the page; architecture_zoo.py --out keeps it."""
    old = tmp_path / "zoo.md"
    old.write_text("# Zoo\n\n## Limits\n\nold\n\n## Low-SQNR rows\n\ntable\n\n## Per model\n\nold rows\n")
    page = "# Zoo\n\n## Limits\n\nnew\n\n## Per model\n\nnew rows\n"
    kept = zoo.keep_section(old, page, zoo.KEPT_SECTION, before="## Per model")
    assert kept == "# Zoo\n\n## Limits\n\nnew\n\n## Low-SQNR rows\n\ntable\n\n## Per model\n\nnew rows\n"
    assert zoo.keep_section(tmp_path / "missing.md", page, zoo.KEPT_SECTION, before="## Per model") == page
    old.write_text("# Zoo\n\n## Per model\n")  # no section to keep: the page as generated
    assert zoo.keep_section(old, page, zoo.KEPT_SECTION, before="## Per model") == page
