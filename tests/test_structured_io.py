"""Structured outputs and keyword inputs (qcompiler.ir.structure): dicts, OrderedDicts, namedtuples,
nested tuples of dicts and transformers' ModelOutput come back in the float model's structure from
the compiled model, the saved artifact and (flat, named by key path) the ONNX export."""

from __future__ import annotations

import collections
import functools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from transformers.modeling_outputs import BaseModelOutput

import qcompiler
from qcompiler.compiled import CompiledModel, lower
from qcompiler.errors import ArtifactError, ConfigError, QCompilerWarning
from qcompiler.ir.meta import GM_INPUT_SPEC, GM_OUTPUT_SPEC
from qcompiler.ir.structure import spec_from_json, spec_to_json
from qcompiler.onnx import export_to_onnx, inference_session
from qcompiler.quantization.qtensor import QTensor
from qcompiler.runtime import Runtime
from qcompiler.tools.metrics import compute_metric

from artifact_edit import Edit

Pair = collections.namedtuple("Pair", "main side")
ROOT = Path(__file__).resolve().parents[1]


class Heads(nn.Module):
    """Two conv heads returning their outputs in the structure ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        aux = torch.relu(self.stem(x))
        out = self.head(aux)
        if self.kind == "dict":
            return {"out": out, "aux": aux}
        if self.kind == "ordered_dict":
            return collections.OrderedDict(out=out, aux=aux)
        if self.kind == "namedtuple":
            return Pair(out, aux)
        if self.kind == "nested":
            return (out, {"aux": aux, "both": [out, aux]})
        if self.kind == "model_output":
            return BaseModelOutput(last_hidden_state=out, hidden_states=(aux, out))
        if self.kind == "constant":
            return {"out": out, "name": "heads", "n": 2}
        if self.kind == "tuple":
            return (out, (aux, out))
        raise ValueError(self.kind)


KINDS = ["dict", "ordered_dict", "namedtuple", "nested", "model_output"]
NAMES = {"dict": ["out", "aux"], "ordered_dict": ["out", "aux"], "namedtuple": ["main", "side"],
         "nested": ["0", "1.aux", "1.both.0", "1.both.1"],
         "model_output": ["last_hidden_state", "hidden_states.0", "hidden_states.1"]}
X = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
_CACHE: dict = {}


def compiled(kind: str):
    if kind not in _CACHE:
        torch.manual_seed(1)
        model = Heads(kind).eval()
        _CACHE[kind] = model, qcompiler.compile(model, X, march="bayes", progress=False)
    return _CACHE[kind]


def same_structure(a, b) -> bool:
    """Same pytree structure and the same classes at every level (ModelOutput included)."""
    return pytree.tree_structure(a) == pytree.tree_structure(b)


def floats(values):
    return [v.dequantize() if isinstance(v, QTensor) else v for v in values]


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_output_has_the_float_structure_and_the_graph_values(kind):
    model, cm = compiled(kind)
    out = cm(X)
    ref = model(X)
    assert type(out) is type(ref) and same_structure(out, ref)
    graph_out = cm.converted(X)  # the graph returns the flat tuple of leaves
    assert isinstance(graph_out, tuple) and len(graph_out) == len(NAMES[kind])
    leaves = pytree.tree_leaves(out)
    assert all(torch.equal(a, b) for a, b in zip(leaves, graph_out))
    sim = Runtime.simulated(cm.converted)(X)  # the integer-exact simulator path, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(leaves, floats(sim)))
    sqnr = compute_metric("SQNR", ref, out)
    assert sqnr > 15, sqnr


def test_model_output_keeps_its_class_and_attributes():
    model, cm = compiled("model_output")
    out = cm(X)
    assert isinstance(out, BaseModelOutput)
    assert out.attentions is None and len(out.hidden_states) == 2
    assert torch.equal(out.last_hidden_state, out["last_hidden_state"])


def test_plain_outputs_have_no_spec_and_keep_their_graph():
    """The rule must not fire on tensors and tuples: no spec, the output node as traced."""
    _, cm = compiled("tuple")
    assert GM_OUTPUT_SPEC not in cm.converted.meta and cm.runtime.output_spec is None
    assert cm.runtime.outputs == {"tuple": [{"value": cm.runtime.outputs["tuple"][0]["value"]},
                                            {"tuple": cm.runtime.outputs["tuple"][1]["tuple"]}]}
    out = cm(X)
    assert isinstance(out, tuple) and isinstance(out[1], tuple) and len(out[1]) == 2


def test_constant_leaves_come_back_as_they_were():
    model, cm = compiled("constant")
    out = cm(X)
    assert out["name"] == "heads" and out["n"] == 2 and list(out) == ["out", "name", "n"]
    assert torch.equal(out["out"], cm.converted(X)[0])


class DtypeLeaf(nn.Module):
    def forward(self, x):
        return {"out": x + 1, "kind": {"dtype": torch.float32}}


class SizeLeaf(nn.Module):
    def forward(self, x):
        return {"out": torch.relu(x), "batch": x.size(0)}


def test_a_leaf_that_is_neither_tensor_nor_constant_is_a_config_error_naming_its_path():
    with pytest.raises(ConfigError, match=r"model output output\['kind'\]\['dtype'\] is a dtype"):
        qcompiler.compile(DtypeLeaf(), X, march="bayes", progress=False)
    with pytest.raises(ConfigError, match=r"model output output\['batch'\] \(node 'size'\) is not a tensor"):
        qcompiler.compile(SizeLeaf(), X, march="bayes", progress=False)


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_keeps_the_structure(kind, tmp_path):
    model, cm = compiled(kind)
    path = cm.save(tmp_path / "m.qc")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QCompilerWarning)  # the classes are imported: no fallback
        loaded = qcompiler.load(path)
    out, again = cm(X), loaded(X)
    assert type(again) is type(out) and same_structure(again, out)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(again)))
    assert "output_spec" in Edit(path).manifest and "input_spec" not in Edit(path).manifest


def test_a_plain_model_saves_no_spec(tmp_path):
    _, cm = compiled("tuple")
    assert "output_spec" not in Edit(cm.save(tmp_path / "m.qc")).manifest


def test_a_spec_that_does_not_fit_the_outputs_is_refused(tmp_path):
    _, cm = compiled("dict")
    edit = Edit(cm.save(tmp_path / "m.qc"))
    edit.manifest["output_spec"]["children"].append({"type": "leaf"})
    edit.manifest["output_spec"]["keys"].append("extra")
    with pytest.raises(ArtifactError, match="output_spec has 3 leaves, but the model has 2 flat outputs"):
        qcompiler.load(edit.write(tmp_path / "bad.qc"))
    edit = Edit(cm.save(tmp_path / "m.qc"))
    edit.manifest["output_spec"] = {"type": "set", "children": []}
    with pytest.raises(ArtifactError, match="is not a structure spec"):
        qcompiler.load(edit.write(tmp_path / "bad2.qc"))


LOAD_IN_FRESH_PROCESS = """
import sys, warnings, torch
{pre}
import qcompiler
x = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = qcompiler.load(path)(x)
    print(type(out).__module__, type(out).__name__, "transformers" in sys.modules, "{module}" in sys.modules)
    print(sorted(str(w.message).split(": ", 2)[-1] for w in caught if w.category.__name__ == "QCompilerWarning"))
"""


def _load_fresh(tmp_path, kinds, pre=""):
    """Per artifact of ``kinds``, loaded and called in one fresh interpreter: the output's class, whether
    transformers / this test module are imported there, and the QCompilerWarnings."""
    paths = [str(compiled(kind)[1].save(tmp_path / f"{kind}.qc")) for kind in kinds]
    torch.save(X, tmp_path / "x.pt")
    code = LOAD_IN_FRESH_PROCESS.format(pre=pre, module=Heads.__module__)
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.pt"), *paths], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    return list(zip(lines[::2], lines[1::2]))


@pytest.mark.slow
def test_a_class_whose_module_is_not_imported_comes_back_plain_with_a_warning(tmp_path):
    (mo, mo_warned), (nt, nt_warned) = _load_fresh(tmp_path, ["model_output", "namedtuple"])
    assert mo == "collections OrderedDict False False"  # transformers was never imported for the file
    assert "transformers.modeling_outputs:BaseModelOutput is not available" in mo_warned
    assert nt == "builtins tuple False False" and "comes back as a tuple" in nt_warned
    assert "test_structured_io:Pair is not available" in nt_warned


@pytest.mark.slow
def test_a_class_whose_module_is_imported_comes_back_in_a_fresh_process(tmp_path):
    (mo, warned), = _load_fresh(tmp_path, ["model_output"], pre="import transformers.modeling_outputs")
    assert mo == "transformers.modeling_outputs BaseModelOutput True False" and warned == "[]"


def test_spec_json_codec_round_trips_and_names_unknown_classes():
    spec = pytree.tree_structure({"a": Pair(1, (2, [3])), "b": collections.OrderedDict(c=4)})
    data = spec_to_json(spec)
    assert json.loads(json.dumps(data)) == data
    assert spec_from_json(data) == spec
    data["children"][0]["class"] = "no_such_module_xyz:Pair"
    with pytest.warns(QCompilerWarning, match="no_such_module_xyz:Pair is not available"):
        plain = spec_from_json(data)
    assert plain.child(0).type is tuple and "no_such_module_xyz" not in sys.modules


@pytest.mark.parametrize("kind", ["dict", "nested", "model_output"])
def test_onnx_export_names_outputs_by_key_path_and_equals_the_compiled_model(kind, tmp_path):
    import onnx

    _, cm = compiled(kind)
    cm.export_onnx(tmp_path / "m.onnx")
    proto = onnx.load(tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == NAMES[kind]
    got = inference_session(str(tmp_path / "m.onnx")).run(None, {"x": X.numpy()})
    want = pytree.tree_leaves(cm(X))
    assert all(torch.equal(torch.from_numpy(g), w) for g, w in zip(got, want))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, a, b):
        return {"out": self.conv(a) * b, "gate": b}


def keyword_model():
    """A model whose graph takes keyword inputs (GM_INPUT_SPEC over ``((), {"pixels", "mask"})``),
    made from the positional graph the way the front end marks a dict of example inputs."""
    torch.manual_seed(2)
    a, b = torch.randn(2, 3, 8, 8), torch.rand(2, 4, 8, 8)
    cm = qcompiler.compile(TwoInputs().eval(), (a, b), march="bayes", progress=False)
    cm.converted.meta[GM_INPUT_SPEC] = pytree.tree_structure(((), {"pixels": a, "mask": b}))
    runtime = lower(cm.converted, example_inputs=(a, b))
    return CompiledModel(runtime, name="TwoInputs", march="bayes", converted=cm.converted,
                         example_inputs=(a, b)), a, b


def test_keyword_inputs_are_bound_by_the_input_spec(tmp_path):
    cm, a, b = keyword_model()
    want = cm.converted(a, b)
    for out in (cm(pixels=a, mask=b), cm(mask=b, pixels=a), cm(**{"pixels": a, "mask": b}), cm(a, b),
                cm(a, mask=b)):
        assert list(out) == ["out", "gate"] and torch.equal(out["out"], want[0])
    with pytest.raises(ConfigError, match="keyword argument 'pixel' names no input of the model; its inputs are "
                                          "pixels, mask"):
        cm(pixel=a, mask=b)
    with pytest.raises(ConfigError, match="input 'mask' missing"):
        cm(pixels=a)
    loaded = qcompiler.load(cm.save(tmp_path / "kw.qc"))
    assert torch.equal(loaded(mask=b, pixels=a)["out"], want[0])
    export_to_onnx(cm.converted, (a, b), tmp_path / "kw.onnx")
    import onnx

    assert [i.name for i in onnx.load(tmp_path / "kw.onnx").graph.input] == ["pixels", "mask"]


def test_positional_models_keep_their_own_input_names(tmp_path):
    """Without an input spec the ONNX inputs are named after the forward's parameters, as always."""
    torch.manual_seed(2)
    a, b = torch.randn(2, 3, 8, 8), torch.rand(2, 4, 8, 8)
    cm = qcompiler.compile(TwoInputs().eval(), (a, b), march="bayes", progress=False)
    assert cm.runtime.input_spec is None
    export_to_onnx(cm.converted, (a, b), tmp_path / "p.onnx")
    import onnx

    assert [i.name for i in onnx.load(tmp_path / "p.onnx").graph.input] == ["a", "b"]
    assert torch.equal(cm(b=b, a=a)["out"], cm(a, b)["out"])


def test_compute_metric_pairs_a_structured_output_with_the_flat_graph_output():
    """The float model's dict against the graph's flat tuple, leaf by leaf in the dict's order (the
    sorted-key order of two dicts would pair 'out' with 'aux': both 512 values, a wrong SQNR)."""
    model, cm = compiled("dict")
    ref, flat = model(X), cm.converted(X)
    right = compute_metric("SQNR", ref, flat)
    assert right == compute_metric("SQNR", ref, cm(X)) and right > 15
    swapped = compute_metric("SQNR", ref, (flat[1], flat[0]))
    assert swapped < 10


def test_a_graph_returning_a_dict_without_a_spec_is_refused_with_the_fix():
    """A graph built by hand (not through the front end) that returns a dict: lowering names the fix."""
    import copy

    import torch.fx as fx

    _, cm = compiled("dict")
    gm = fx.GraphModule(cm.converted, copy.deepcopy(cm.converted.graph))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ({"out": out.args[0][0], "aux": out.args[0][1]},)
    gm.meta.update({k: v for k, v in cm.converted.meta.items() if k != GM_OUTPUT_SPEC})
    with pytest.raises(ConfigError, match=r"model output contains a immutable_dict; .* run "
                                          r"qcompiler.ir.structure.flatten_output"):
        lower(gm)


def _wrapped(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return wrapper


class DecoratedForward(nn.Module):
    """transformers 5's pattern: a ``*args, **kwargs`` decorator on the forward, a ModelOutput out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    @_wrapped
    def forward(self, x, **kwargs):
        return BaseModelOutput(last_hidden_state=self.conv(x))


def test_a_decorated_forward_keeps_its_model_output_class():
    cm = qcompiler.compile(DecoratedForward().eval(), X, march="bayes", progress=False)
    out = cm(X)
    assert type(out) is BaseModelOutput and list(out) == ["last_hidden_state"]


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, pixels, mask):
        return {"out": self.conv(pixels) * mask, "gate": mask}


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_dict_example_inputs_compile_and_are_called_by_keyword(order, tmp_path):
    """Keyword inputs from the front end itself: in the forward's order (fx capture) and in another
    order (torch.export capture); both give GM_INPUT_SPEC, calls by keyword in any order, ONNX
    inputs named by keyword, the artifact keeps the spec."""
    import onnx

    torch.manual_seed(3)
    p, m = torch.randn(2, 3, 8, 8), torch.rand(2, 4, 8, 8)
    example = {"pixels": p, "mask": m} if order == "forward" else {"mask": m, "pixels": p}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)  # the export capture says why it was chosen
        cm = qcompiler.compile(KeywordModel().eval(), example, march="bayes", progress=False)
    assert cm.runtime.input_spec is not None
    want = cm(**example)
    assert list(want) == ["out", "gate"] and torch.equal(want["gate"], m)
    assert torch.equal(cm(mask=m, pixels=p)["out"], want["out"])
    assert torch.equal(cm(*example.values())["out"], want["out"])  # positionally, in the keywords' order
    with pytest.raises(ConfigError, match="keyword argument 'pixel' names no input"):
        cm(pixel=p, mask=m)
    loaded = qcompiler.load(cm.save(tmp_path / "kw.qc"))
    assert torch.equal(loaded(pixels=p, mask=m)["out"], want["out"])
    cm.export_onnx(tmp_path / "kw.onnx")
    assert [i.name for i in onnx.load(tmp_path / "kw.onnx").graph.input] == list(example)
    got = inference_session(str(tmp_path / "kw.onnx")).run(None, {k: v.numpy() for k, v in example.items()})
    assert all(torch.equal(torch.from_numpy(g), w) for g, w in zip(got, want.values()))


def test_quant_analysis_and_compute_error_run_on_a_dict_output(tmp_path):
    """The numeric tools compare the float model's dict with the prepared graph's flat tuple."""
    from qcompiler.quantization.prepare import prepare_calibration_fx
    from qcompiler.tools import QuantAnalysis
    from qcompiler.tools.numeric_suite import compute_error

    torch.manual_seed(1)
    model = Heads("dict").eval()
    cal = prepare_calibration_fx(model, None, example_inputs=X, march="bayes")
    cal(X)
    qa = QuantAnalysis(model, cal, "fake_quant", out_dir=tmp_path)
    qa.set_bad_case(X)
    rows = qa.run()
    assert [r["node"] for r in rows][:3] == ["x_activation_post_process", "stem", "head"]
    assert compute_metric("SQNR", qa.base_output, qa.analy_output) > 15  # the whole-model row pairs out, aux
    flat = cal(X)
    assert isinstance(flat, tuple) and len(flat) == 2
    sqnr = float(compute_error(model(X), flat))
    assert sqnr > 15 and sqnr == pytest.approx(compute_metric("SQNR", model(X), flat), abs=1e-9)


def test_the_export_refuses_a_constant_leaf_by_name(tmp_path):
    from qcompiler.errors import UnsupportedOpError

    _, cm = compiled("constant")
    with pytest.raises(UnsupportedOpError, match="graph output 'name' is not a tensor"):
        cm.export_onnx(tmp_path / "c.onnx")


class ImagesToDicts(nn.Module):
    """A detector's interface with a traceable body: a list of images (C, H, W) in, a list of dicts out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, images):
        out = []
        for image in images:
            f = self.head(torch.relu(self.conv(image[None])))
            out.append({"boxes": f.flatten(1), "scores": f.mean((2, 3))})
        return out


class ImagePair(ImagesToDicts):
    """ImagesToDicts indexing its two images (symbolic tracing takes that; it cannot iterate a list)."""

    def forward(self, images):
        return self.head(self.conv(images[0][None])), self.head(self.conv(images[1][None]))


@pytest.mark.parametrize("capture, model", [("fx", ImagePair), ("export", ImagesToDicts), ("auto", ImagesToDicts)])
def test_a_positional_list_of_images_feeding_the_bpu_is_a_config_error_naming_the_dict_form(capture, model):
    """The quantizer of a positional list would take the whole list (an AttributeError from inside torch
    before): the error names the input and the keyword form that makes each image one input."""
    images = [torch.randn(3, 8, 8), torch.randn(3, 8, 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        with pytest.raises(ConfigError, match=r"model input 'images' is a list / tuple of tensors that feeds BPU op "
                                              r"'getitem'.*qcompiler.compile\(model, \{'images': \[...\]\}\)"):
            qcompiler.compile(model().eval(), (images,), march="bayes", progress=False,
                              prepare_custom_config_dict={"capture": capture})


def test_a_list_of_images_as_a_keyword_input_is_one_graph_input_per_image(tmp_path):
    """``{"images": [...]}``: each image is one placeholder (GM_INPUT_SPEC), the whole body is on the BPU,
    and the list of dicts comes back from the compiled model (called with the list by keyword or position),
    its .qc and its ONNX export (inputs images.0, images.1) bit for bit."""
    torch.manual_seed(0)
    model = ImagesToDicts().eval()
    g = torch.Generator().manual_seed(1)
    batches = [{"images": [torch.randn(3, 8, 8, generator=g), torch.randn(3, 8, 8, generator=g)]} for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        cm = qcompiler.compile(model, batches[0], march="bayes", calib_data=batches, progress=False)
    assert {s.kind for s in cm.runtime.steps} == {"bpu"}  # (one partition per image: they share nothing)
    images = batches[1]["images"]
    got = cm(images=images)
    assert isinstance(got, list) and [sorted(d) for d in got] == [["boxes", "scores"]] * 2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(cm(images), got) for k in a)
    with torch.no_grad():
        want = model(images)
    for g_, w in zip(got, want):
        assert compute_metric("SQNR", w["boxes"], g_["boxes"]) > 25.0
    loaded = qcompiler.load(cm.save(tmp_path / "m.qc"))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(loaded(images=images), got) for k in a)
    cm.export_onnx(tmp_path / "m.onnx")
    session = inference_session(str(tmp_path / "m.onnx"))
    assert [i.name for i in session.get_inputs()] == ["images.0", "images.1"]
    outs = session.run(None, {"images.0": images[0].numpy(), "images.1": images[1].numpy()})
    assert all(torch.equal(torch.from_numpy(o), w) for o, w in zip(outs, pytree.tree_leaves(got)))
    with pytest.raises(ConfigError, match="structure"):
        cm(images=images[:1])  # one image where the model was compiled for two
