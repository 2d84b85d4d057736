"""Model coverage: every model class of PyTorch's own quantization test files through ``qcompiler.compile``.

    OMP_NUM_THREADS=1 python benchmarks/model_coverage.py [--models NAME ...] [--march bayes bernoulli2]
    OMP_NUM_THREADS=1 python benchmarks/model_coverage.py --markdown docs/model_coverage.md   # regenerate the doc

The models are the ``nn.Module`` classes of ``torch/testing/_internal/common_quantization.py`` (top level and
``TestHelperModules``), ``quantization_torch_package_models.py`` and ``common_pruning.py``, all shipped in
the torch wheel (importing them needs ``expecttest``: ``pip install -e .[bench]``). They are built as torch's
tests build them: ``CONSTRUCTOR_ARGS`` gives the arguments torch's tests pass where a class needs some (a
class tested with several arguments is one case per variant, e.g. ``RNNDynamicModel[GRU]``), and the inputs
are the model's ``get_example_inputs()`` / ``example_inputs()`` where it has one, else ``EXAMPLE_INPUTS``.

Per case and march (:func:`run_case`): compile (calibrated on ``calibration_batches``), call the compiled
model, ``export_onnx`` + ``onnx.checker`` (full check) + an onnxruntime run through
``qcompiler.onnx.inference_session`` compared with the compiled model (``EXPORT_ATOL``/``EXPORT_RTOL``),
``save`` + ``load`` (outputs bit-identical), and the output SQNR against the float model and against
torch.ao FX (``prepare_fx``/``convert_fx``, x86 default qconfig mapping, the same calibration batches).
A model with eager-torch CPU islands cannot be exported or saved by design: those refusals
(UnsupportedOpError / ArtifactError) are counted as "refused", not as failures. A raw error is any
exception that is not a ``QCompilerError``. Every failure is classified by stage, exception type and the
first line of its message.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import onnx
import onnxruntime
import torch
import torch.nn as nn
from tabulate import tabulate

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._data import sqnr_db  # noqa: E402
from qcompiler.compiled import compile as qc_compile  # noqa: E402
from qcompiler.compiled import load  # noqa: E402
from qcompiler.errors import ArtifactError, QCompilerError, UnsupportedOpError  # noqa: E402
from qcompiler.ir.meta import BPU  # noqa: E402
from qcompiler.onnx import inference_session  # noqa: E402

try:
    import torch.testing._internal.common_pruning as _pruning
    import torch.testing._internal.common_quantization as _cq
    import torch.testing._internal.quantization_torch_package_models as _package
except ImportError as exc:  # torch's test modules import test-only packages (expecttest)
    raise SystemExit(f"model_coverage needs torch's test-only dependencies ({exc}); "
                     "install them with: pip install -e '.[bench]'") from None

MARCHES = ("bayes", "bernoulli2")
SOURCE_MODULES = (_cq, _package, _pruning)
# exported ONNX vs the compiled model (fixed-point simulator + islands); the export's weight layers are
# integer-exact, the tolerance covers float CPU ops run in differently optimized onnxruntime sessions
EXPORT_ATOL, EXPORT_RTOL = 1e-4, 1e-4
CALIBRATION_BATCHES = 4
ZERO_OUTPUT = 1e-6  # a reference output below this everywhere has no meaningful SQNR
QENGINE = "fbgemm"  # the default of the classes that take one; torch's tests loop over the engines

# --- how torch's tests build the classes that need arguments -------------------------------------------
# name -> [(variant label or "", args, kwargs)]; the arguments are those torch's tests pass
# (test/quantization/*: test_quantize_eager*, test_quantize_fx, test_fuse_eager, test_quantize_pt2e,
# test/ao/sparsity/*). A class listed with several variants is one case per variant.
CONSTRUCTOR_ARGS: dict[str, list[tuple[str, tuple, dict]]] = {
    "RNNDynamicModel": [("LSTM", ("LSTM",), {}), ("GRU", ("GRU",), {})],
    "RNNCellDynamicModel": [(m, (m,), {}) for m in ("LSTMCell", "GRUCell", "RNNTanh", "RNNReLU")],
    "AnnotatedConvModel": [("", (QENGINE,), {})],
    "AnnotatedConvTransposeModel": [("", (QENGINE,), {})],
    "AnnotatedNestedModel": [("", (QENGINE,), {})],
    "AnnotatedSkipQuantModel": [("", (QENGINE,), {})],
    "ManualLinearQATModel": [("", (QENGINE,), {})],
    "ManualDropoutQATModel": [("", (QENGINE,), {})],
    "ModelForFusion": [("", (torch.ao.quantization.default_qconfig,), {})],
    # SparseNNModel's own sizes
    "DenseTopMLP": [("", (4, 2, 5, 2, 2), {})],
    "EmbBagWrapper": [("", (10, 5), {})],
    # test_quantization's test_linear_relu_package_quantization_transforms: LinearReluFunctional(4)
    "LinearReluFunctionalChild": [("", (4,), {})],
    "LinearReluFunctional": [("", (4,), {})],
    # a converted SimpleLinear's first layer
    "MockSparseLinear": [("", (7, 5), {})],
    # test/ao/sparsity: LSTMLinearModel(input_dim=8, hidden_dim=8, output_dim=8, num_layers=1)
    "LSTMLinearModel": [("", (), {"input_dim": 8, "hidden_dim": 8, "output_dim": 8, "num_layers": 1})],
    "LSTMLayerNormLinearModel": [("", (), {"input_dim": 8, "hidden_dim": 8, "output_dim": 8, "num_layers": 1})],
    # test_quantize_pt2e: with and without the relu
    "TestHelperModules.ConvWithBNRelu": [("relu", (), {"relu": True}), ("norelu", (), {"relu": False})],
    "TestHelperModules.ConvTWithBNRelu": [("relu", (), {"relu": True}), ("norelu", (), {"relu": False})],
}


def _r(*shape: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape),)


def _rs(*shapes: tuple[int, ...]) -> Callable[[], tuple]:
    return lambda: tuple(torch.randn(*s) for s in shapes)


# the indices and offsets of test_quantize_fx's embedding-bag tests
_INDICES = [9, 6, 5, 7, 8, 8, 9, 2, 8, 6, 6, 9, 1, 6, 8, 8, 3, 2, 3, 6, 3, 6, 5, 7, 0, 8, 4, 6, 5, 8, 2, 3]
_OFFSETS = [0, 19, 20, 28, 28, 32]


def _indices() -> torch.Tensor:
    return torch.tensor(_INDICES)


# --- inputs of the models without get_example_inputs() / example_inputs() ------------------------------
# name (class, or "class[variant]" for one variant) -> a function returning the argument tuple.
EXAMPLE_INPUTS: dict[str, Callable[[], tuple]] = {
    "RNNDynamicModel": _r(10, 3, 2),  # (seq, batch, 2): test_quantized_rnn's 3x2 input repeated 10 times
    "RNNCellDynamicModel": _r(3, 2),
    "LSTMwithHiddenDynamicModel": lambda: (torch.randn(5, 3, 2), (torch.randn(1, 3, 2), torch.randn(1, 3, 2))),
    "ActivationsTestModel": _r(2, 5),
    "NormalizationTestModel": _r(2, 5),
    "NestedModel": _r(2, 5),
    "AnnotatedNestedModel": _r(2, 5),
    "AnnotatedSubNestedModel": _r(2, 5),
    "AnnotatedCustomConfigNestedModel": _r(2, 5),
    "QuantSubModel": _r(2, 5),
    "InnerModule": _r(2, 5),
    "SkipQuantModel": _r(2, 5),
    "AnnotatedSkipQuantModel": _r(2, 5),
    "QuantStubModel": _r(2, 5),
    "ManualLinearQATModel": _r(2, 5),
    "ManualDropoutQATModel": _r(2, 5),
    "ManualLinearDynamicQATModel": _r(2, 5),
    "ManualConvLinearQATModel": _r(10, 3, 10, 10),
    "ManualConvLinearSymmQATModel": _r(10, 3, 10, 10),
    "ManualEmbeddingBagLinear": lambda: (_indices(), torch.tensor(_OFFSETS[:-1])),
    "DeFusedEmbeddingBagLinear": lambda: (torch.randint(0, 10, (4, 3)),),
    "SubModelForFusion": _r(2, 2, 4, 4),
    "SubModelWithoutFusion": _r(2, 2, 4, 4),
    "ModelForFusion": _r(2, 3, 1, 19),  # its fc takes 36 = 2 channels x 18 per sample
    "ConvBNReLU": _r(2, 3, 4, 4),
    "ModelWithSequentialFusion": _r(2, 3, 10, 10),
    "ModelForFusionWithBias": _r(2, 3, 10, 10),
    "ModelForLinearBNFusion": _r(2, 20),
    "DummyObserver": _r(2, 5),
    "ModelForConvTransposeBNFusion": _r(2, 3, 10),
    "ModelWithFunctionals": _r(4, 4),
    "ResNetBase": _r(2, 3, 8, 8),
    "ModelMultipleOps": _r(2, 3, 8, 8),
    "ModelMultipleOpsNoAvgPool": _r(2, 3, 8, 8),
    "EmbeddingBagModule": lambda: (_indices(), torch.tensor(_OFFSETS[:-1]), torch.rand(len(_INDICES))),
    "EmbeddingModule": lambda: (_indices(),),
    "EmbeddingWithStaticLinear": lambda: (_indices(), torch.tensor(_OFFSETS[:-1]), torch.randn(5, 4)),
    "DenseTopMLP": _rs((5, 5), (5, 4)),
    "EmbBagWrapper": lambda: (_indices(), torch.tensor(_OFFSETS[:-1])),
    "SparseNNModel": lambda: (_indices(), torch.tensor(_OFFSETS[:-1]), torch.randn(5, 4)),
    "LinearReluFunctionalChild": _r(1, 1, 4, 4),
    "LinearReluFunctional": _r(1, 1, 4, 4),
    "MockSparseLinear": _r(2, 7),
    "SimpleLinear": _r(2, 7),
    "LinearBias": _r(2, 7),
    "LinearActivation": _r(2, 7),
    "LinearActivationFunctional": _r(2, 7),
    "SimpleConv2d": _r(1, 1, 28, 28),
    "Conv2dBias": _r(1, 1, 28, 28),
    "Conv2dActivation": _r(1, 1, 28, 28),
    "Conv2dPadBias": _r(1, 1, 28, 28),
    "Conv2dPool": _r(1, 1, 28, 28),
    "Conv2dPoolFlattenFunctional": _r(1, 1, 28, 28),
    "Conv2dPoolFlatten": _r(1, 1, 28, 28),
    "LSTMLinearModel": _r(4, 1, 8),
    "LSTMLayerNormLinearModel": _r(4, 1, 8),
    "TestHelperModules.Conv2dPropAnnotaton": _r(1, 3, 5, 5),
    "TestHelperModules.Conv2dWithObsSharingOps": _r(1, 3, 5, 5),
    "TestHelperModules.Conv2dWithTwoLinearPermute": _r(2, 3, 16, 16),
    "TestHelperModules.Conv2dWithTwoLinear": _r(2, 3, 4, 4),
    "TestHelperModules.ConvLinearWPermute": _r(2, 3, 8, 8),
    "TestHelperModules.ConvMaxPool2d": _r(1, 2, 5, 5),
    "TestHelperModules.ConvWithAdaptiveAvgPool2d": _r(1, 3, 5, 5),
    "TestHelperModules.ConvWithBNRelu": _r(1, 3, 5, 5),
    "TestHelperModules.ConvTWithBNRelu": _r(1, 3, 5, 5),
    "TestHelperModules.Conv2dWithCat": _rs((1, 3, 5, 5), (1, 3, 5, 5)),
    "TestHelperModules.Conv2dWithTwoCat": _rs((1, 3, 5, 5), (1, 3, 5, 5), (1, 6, 3, 3), (1, 6, 3, 3)),
    "TestHelperModules.ThreeAdd": _rs(*[(1, 3, 3, 3)] * 4),
    "TestHelperModules.EmbeddingModule": lambda: (_indices(),),
    "TestHelperModules.EmbeddingConvLinearModule": lambda: (torch.randint(0, 10, (2, 10)),),
    "TestHelperModules.AddInplaceAdd": _rs((1, 3, 3, 3), (1, 3, 3, 3)),
    "TestHelperModules.MulInplaceMul": _rs((1, 3, 3, 3), (1, 3, 3, 3)),
    "TestHelperModules.AddMulScalar": _r(1, 3, 3, 3),
    "TestHelperModules.ConvBnReLU2dAndLinearReLU": _r(1, 3, 8, 8),
    "TestHelperModules.LinearReluModel": _r(2, 5),
}


@dataclass
class Case:
    """One model to run: a class, its constructor arguments and its example inputs."""

    name: str
    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    inputs: Optional[Callable[[], tuple]] = None  # overrides the model's own and EXAMPLE_INPUTS

    @property
    def class_name(self) -> str:
        return self.name.split("[")[0]

    def build(self) -> tuple[nn.Module, tuple]:
        """The model (seeded, eval mode) and its example inputs (seeded)."""
        torch.manual_seed(0)
        model = self.cls(*self.args, **self.kwargs).eval()
        if self.inputs is not None:
            torch.manual_seed(1)
            return model, tuple(self.inputs())
        for getter in ("get_example_inputs", "example_inputs"):
            if callable(getattr(model, getter, None)):
                return model, tuple(getattr(model, getter)())
        table = EXAMPLE_INPUTS.get(self.name) or EXAMPLE_INPUTS.get(self.class_name)
        if table is None:
            raise KeyError(f"{self.name}: no example inputs (add it to EXAMPLE_INPUTS)")
        torch.manual_seed(1)
        return model, tuple(table())


def model_classes() -> dict[str, type]:
    """Every nn.Module class defined in torch's quantization test files, by (qualified) name."""
    found: dict[str, type] = {}
    for mod in SOURCE_MODULES:
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == mod.__name__:
                found[name] = obj
    for name, obj in vars(_cq.TestHelperModules).items():
        if inspect.isclass(obj) and issubclass(obj, nn.Module):
            found[f"TestHelperModules.{name}"] = obj
    return found


def all_cases() -> list[Case]:
    """One case per class, or one per variant for the classes ``CONSTRUCTOR_ARGS`` lists several of."""
    cases = []
    for name, cls in model_classes().items():
        for label, args, kwargs in CONSTRUCTOR_ARGS.get(name, [("", (), {})]):
            cases.append(Case(f"{name}[{label}]" if label else name, cls, args, kwargs))
    return cases


# --- helpers ---------------------------------------------------------------------------------------------

def calibration_batches(inputs: tuple, n: int = CALIBRATION_BATCHES) -> list[tuple]:
    """The example inputs, then ``n - 1`` batches whose float tensors are redrawn (seeded); other values
    (indices, offsets, flags) are kept, so every batch is valid for the model."""
    g = torch.Generator().manual_seed(2)

    def redraw(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return torch.randn(v.shape, generator=g, dtype=v.dtype)
        if isinstance(v, (tuple, list)):
            return type(v)(redraw(x) for x in v)
        return v

    return [inputs] + [tuple(redraw(v) for v in inputs) for _ in range(n - 1)]


def flat_tensors(v: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in order; a QTensor-like value is dequantized."""
    if isinstance(v, torch.Tensor):
        return [v.detach()]
    if hasattr(v, "dequantize") and callable(v.dequantize):
        return [v.dequantize().detach()]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in flat_tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in flat_tensors(x)]
    return []


def output_shapes(v: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in flat_tensors(v)]


def sqnr(ref: Any, test: Any) -> Optional[float]:
    """SQNR (dB) of all float outputs together; None if the outputs do not line up, NaN if the reference
    is numerically zero (|ref| < ZERO_OUTPUT everywhere: any SQNR would be noise over noise)."""
    r = [t.float() for t in flat_tensors(ref)]
    t = [x.float() for x in flat_tensors(test)]
    if not r or len(r) != len(t) or any(a.shape != b.shape for a, b in zip(r, t)):
        return None
    ref_all = torch.cat([a.flatten() for a in r])
    if ref_all.numel() == 0 or float(ref_all.abs().max()) < ZERO_OUTPUT:
        return float("nan")
    return sqnr_db(ref_all, torch.cat([b.flatten() for b in t]))


def category(stage: str, exc: BaseException) -> str:
    """``stage: ExceptionType: first line of the message``."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{stage}: {type(exc).__name__}: {first[:200]}"


@contextlib.contextmanager
def _quiet():
    """Warnings and stray prints of the models and libraries stay out of the table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(io.StringIO()):
            yield


def fx_reference(case: Case) -> dict:
    """torch.ao FX PTQ of the case (x86 default qconfig mapping, the same calibration batches): its
    output on the example inputs, or the error."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    try:
        with _quiet(), torch.no_grad():
            model, inputs = case.build()
            prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), inputs)
            for batch in calibration_batches(inputs):
                prepared(*copy.deepcopy(batch))
            quantized = convert_fx(prepared)
            return {"ok": True, "out": quantized(*copy.deepcopy(inputs))}
    except Exception as exc:  # noqa: BLE001 - any failure of the peer is data
        return {"ok": False, "error": category("fx", exc)}


def _feeds(session, inputs: tuple) -> dict:
    names = [i.name for i in session.get_inputs()]
    values = [t.numpy() for t in flat_tensors(inputs)]
    if len(names) != len(values):
        raise ValueError(f"the exported graph has {len(names)} inputs, the example inputs {len(values)} tensors")
    return dict(zip(names, values))


# --- one case on one march -------------------------------------------------------------------------------

def run_case(case: Case, march: str, workdir: Path, fx: Optional[dict] = None) -> dict:
    """Compile ``case`` for ``march`` and check it; one result row.

    Fields: compile / call / export / saveload in {"ok", "fail", "refused", "-"} ("-": not reached),
    ``islands`` (number of eager-torch islands), ``export_diff`` (max |exported - compiled|),
    ``export_match``, ``sqnr_float`` / ``sqnr_fx`` (dB), ``errors`` [(category, raw)], ``seconds``."""
    row: dict[str, Any] = {"model": case.name, "march": march, "compile": "-", "call": "-", "islands": None,
                           "export": "-", "export_diff": None, "export_match": None, "saveload": "-",
                           "sqnr_float": None, "sqnr_fx": None, "fx": None, "errors": []}
    t0 = time.perf_counter()

    def fail(stage: str, exc: BaseException) -> None:
        row["errors"].append((category(stage, exc), not isinstance(exc, QCompilerError)))

    try:
        with _quiet():
            model, inputs = case.build()
            with torch.no_grad():
                ref = model(*copy.deepcopy(inputs))
    except Exception as exc:  # noqa: BLE001
        row["compile"] = "fail"
        fail("build", exc)
        row["seconds"] = time.perf_counter() - t0
        return row
    if fx is not None:
        row["fx"] = "ok" if fx["ok"] else "fail"
        row["fx_error"] = fx.get("error")
        fx_out = fx.get("out")
    else:
        fx_out = None

    try:
        with _quiet():
            cm = qc_compile(model, inputs, march=march, calib_data=calibration_batches(inputs), progress=False)
        row["compile"] = "ok"
    except Exception as exc:  # noqa: BLE001
        row["compile"] = "fail"
        fail("compile", exc)
        row["seconds"] = time.perf_counter() - t0
        return row
    row["islands"] = len(cm.torch_islands())
    row["bpu"] = sum(p["placement"] == BPU for p in cm.partitions)

    try:
        with _quiet():
            out = cm(*copy.deepcopy(inputs))
        row["call"] = "ok"
        if output_shapes(out) != output_shapes(ref):  # a silently wrong output, not an exception
            row["call"] = "wrong shape"
            row["errors"].append((f"call: output shapes {output_shapes(out)} differ from the float model's "
                                  f"{output_shapes(ref)}", False))
        row["sqnr_float"] = sqnr(ref, out)
        if fx_out is not None:
            row["sqnr_fx"] = sqnr(fx_out, out)
    except Exception as exc:  # noqa: BLE001
        row["call"] = "fail"
        fail("call", exc)
        out = None

    stem = workdir / f"{case.name.replace('.', '_').replace('[', '_').replace(']', '')}_{march}"
    _check_export(cm, inputs, out, stem.with_suffix(".onnx"), row, fail)
    _check_save_load(cm, inputs, out, stem.with_suffix(".qca"), row, fail)
    row["seconds"] = time.perf_counter() - t0
    return row


def _check_export(cm, inputs: tuple, out: Any, path: Path, row: dict, fail) -> None:
    stage = "export"
    try:
        with _quiet():
            cm.export_onnx(path)
            stage = "onnx.checker"
            onnx.checker.check_model(str(path), full_check=True)
            stage = "onnxruntime"
            session = inference_session(path)
            exported = session.run(None, _feeds(session, inputs))
        row["export"] = "ok"
    except UnsupportedOpError as exc:
        if stage == "export" and row["islands"]:
            row["export"] = "refused"
            return
        row["export"] = "fail"
        fail(stage, exc)
        return
    except Exception as exc:  # noqa: BLE001
        row["export"] = "fail"
        fail(stage, exc)
        return
    if out is None:
        return
    compiled = [t.float().numpy() for t in flat_tensors(out)]
    if len(compiled) != len(exported) or any(a.shape != np.shape(b) for a, b in zip(compiled, exported)):
        row["export_match"] = False
        row["errors"].append((f"export==compiled: {len(exported)} exported outputs "
                              f"{[tuple(np.shape(b)) for b in exported]} vs compiled "
                              f"{[tuple(a.shape) for a in compiled]}", False))
        return
    diffs = [float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(compiled, exported)]
    row["export_diff"] = max(diffs, default=0.0)
    off = [~np.isclose(b, a, atol=EXPORT_ATOL, rtol=EXPORT_RTOL) for a, b in zip(compiled, exported)]
    row["export_match"] = not any(o.any() for o in off)
    if not row["export_match"]:
        row["errors"].append((f"export==compiled: max |diff| {row['export_diff']:.3g} on "
                              f"{sum(int(o.sum()) for o in off)}/{sum(o.size for o in off)} outputs, above "
                              f"atol {EXPORT_ATOL} / rtol {EXPORT_RTOL}", False))


def _check_save_load(cm, inputs: tuple, out: Any, path: Path, row: dict, fail) -> None:
    stage = "save"
    try:
        with _quiet():
            cm.save(path)
            stage = "load"
            loaded = load(path)
            stage = "loaded call"
            again = loaded(*copy.deepcopy(inputs))
    except ArtifactError as exc:
        if stage == "save" and row["islands"]:
            row["saveload"] = "refused"
            return
        row["saveload"] = "fail"
        fail(stage, exc)
        return
    except Exception as exc:  # noqa: BLE001
        row["saveload"] = "fail"
        fail(stage, exc)
        return
    a, b = flat_tensors(out), flat_tensors(again)
    if out is not None and (len(a) != len(b) or not all(x.shape == y.shape and torch.equal(x, y)
                                                         for x, y in zip(a, b))):
        row["saveload"] = "fail"
        row["errors"].append(("save/load: the loaded model's outputs differ from the compiled model's", False))
        return
    row["saveload"] = "ok"


# --- the whole run ---------------------------------------------------------------------------------------

def run(cases: Sequence[Case], marches: Sequence[str], *, progress: bool = True) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="qc_model_coverage_") as tmp:
        for i, case in enumerate(cases):
            fx = fx_reference(case)
            for march in marches:
                row = run_case(case, march, Path(tmp), fx)
                rows.append(row)
                if progress:
                    print(f"[{i + 1}/{len(cases)}] {case.name} {march}: compile {row['compile']} "
                          f"({row['seconds']:.1f}s)", file=sys.stderr, flush=True)
    return rows


def counts(rows: Sequence[dict], marches: Sequence[str]) -> list[tuple[str, str]]:
    """The headline numbers, one (label, value) per line."""
    cases = sorted({r["model"] for r in rows})
    classes = sorted({r["model"].split("[")[0] for r in rows})
    out = [("model classes / cases (variants)", f"{len(classes)} / {len(cases)}")]
    fx_ok = {r["model"] for r in rows if r["fx"] == "ok"}
    out.append(("torch.ao FX PTQ runs (cases)", f"{len(fx_ok)}/{len(cases)}"))
    for march in marches:
        mr = [r for r in rows if r["march"] == march]
        n = len(mr)
        ok = [r for r in mr if r["compile"] == "ok"]
        cls_ok = {r["model"].split("[")[0] for r in ok}
        cls_all = {r["model"].split("[")[0] for r in mr}
        cls_all_ok = {c for c in cls_all
                      if all(r["compile"] == "ok" for r in mr if r["model"].split("[")[0] == c)}
        out += [
            (f"{march}: compile OK (cases)", f"{len(ok)}/{n}"),
            (f"{march}: compile OK (classes, every variant / any variant)",
             f"{len(cls_all_ok)}/{len(cls_all)} / {len(cls_ok)}/{len(cls_all)}"),
            (f"{march}: compiled model runs (output shapes as the float model's)", f"{sum(r['call'] == 'ok' for r in ok)}/{len(ok)}"),
            (f"{march}: no BPU partition (the whole model stays float on the CPU)",
             f"{sum(r.get('bpu') == 0 for r in ok)}/{len(ok)}"),
            (f"{march}: with eager-torch islands", f"{sum(bool(r['islands']) for r in ok)}/{len(ok)}"),
            (f"{march}: export + checker + onnxruntime OK",
             f"{sum(r['export'] == 'ok' for r in ok)}/{len(ok)} "
             f"(refused, torch islands: {sum(r['export'] == 'refused' for r in ok)}; "
             f"failed: {sum(r['export'] == 'fail' for r in ok)})"),
            (f"{march}: exported == compiled",
             f"{sum(r['export_match'] is True for r in ok)}/{sum(r['export'] == 'ok' for r in ok)}"),
            (f"{march}: exported bit-identical to compiled (max diff 0)",
             f"{sum(r['export_diff'] == 0.0 for r in ok)}/{sum(r['export'] == 'ok' for r in ok)}"),
            (f"{march}: save/load OK, identical outputs",
             f"{sum(r['saveload'] == 'ok' for r in ok)}/{len(ok)} "
             f"(refused, torch islands: {sum(r['saveload'] == 'refused' for r in ok)}; "
             f"failed: {sum(r['saveload'] == 'fail' for r in ok)})"),
        ]
    raw = [e for r in rows for e, is_raw in r["errors"] if is_raw]
    out.append(("raw errors (not a QCompilerError), all stages and marches", str(len(raw))))
    return out


def failure_categories(rows: Sequence[dict]) -> list[tuple[int, str, str, str]]:
    """(count, category, raw?, cases) sorted by count."""
    by_cat: dict[str, list[str]] = defaultdict(list)
    raw_cat: dict[str, bool] = {}
    for r in rows:
        for cat, is_raw in r["errors"]:
            by_cat[cat].append(f"{r['model']}@{r['march']}")
            raw_cat[cat] = raw_cat.get(cat, False) or is_raw
    out = []
    for cat, where in sorted(by_cat.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        models = sorted({w.split("@")[0] for w in where})
        marches = sorted({w.split("@")[1] for w in where})
        shown = ", ".join(models[:6]) + (f" (+{len(models) - 6} more)" if len(models) > 6 else "")
        out.append((len(where), cat, "raw" if raw_cat[cat] else "", f"{shown} [{'/'.join(marches)}]"))
    return out


def fx_failures(rows: Sequence[dict]) -> list[tuple[str, str]]:
    """(case, category) of every case torch.ao FX PTQ fails on (the peer's coverage, for comparison)."""
    seen: dict[str, str] = {}
    for r in rows:
        if r.get("fx_error"):
            seen.setdefault(r["model"], r["fx_error"])
    return sorted(seen.items())


def _fmt_db(v: Optional[float]) -> str:
    if v is None:
        return ""
    if math.isnan(v):
        return "n/a (output ~0)"
    return "inf" if v == float("inf") else f"{v:.1f}"


def table_rows(rows: Sequence[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        first_error = r["errors"][0][0] if r["errors"] else ""
        out.append([
            r["model"], r["march"], r["fx"] or "", r["compile"], r["call"],
            "" if r.get("bpu") is None else str(r["bpu"]), "" if r["islands"] is None else str(r["islands"]),
            r["export"],
            "" if r["export_match"] is None else ("yes" if r["export_match"] else f"no ({r['export_diff']:.2g})"
                                                  if r["export_diff"] is not None else "no"),
            r["saveload"], _fmt_db(r["sqnr_float"]), _fmt_db(r["sqnr_fx"]),
            first_error[:110],
        ])
    return out


HEADERS = ["model", "march", "ao FX", "compile", "call", "BPU parts", "torch islands", "export", "exported==compiled",
           "save/load", "SQNR vs float (dB)", "SQNR vs ao FX (dB)", "first failure"]


def environment(report: str = "docs/model_coverage.md") -> list[tuple[str, str]]:
    """Date, commit (flagged when the checkout has uncommitted changes other than ``report``), machine, versions."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":!{report}"], cwd=root,  # the report itself does not count
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return [
        ("date (UTC)", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")),
        ("commit", commit),
        ("machine", f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
                    f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"),
        ("versions", f"python {platform.python_version()}, torch {torch.__version__}, onnx {onnx.__version__}, "
                     f"onnxruntime {onnxruntime.__version__}"),
    ]


def _md(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Table cells with ``|`` escaped (a pipe would split a markdown cell)."""
    return [[c.replace("|", "\\|") if isinstance(c, str) else c for c in row] for row in rows]


def markdown(rows: Sequence[dict], marches: Sequence[str], seconds: float, argv: Sequence[str]) -> str:
    cmd = "OMP_NUM_THREADS=1 python benchmarks/model_coverage.py " + " ".join(argv)
    parts = [
        "# Model coverage: PyTorch's quantization test models through qcompiler.compile",
        "",
        "Generated by `benchmarks/model_coverage.py` (do not edit by hand); regenerate with",
        "",
        f"    {cmd.strip()}",
        "",
        "Every `nn.Module` class of torch's `torch/testing/_internal/common_quantization.py` (top level and "
        "`TestHelperModules`), `quantization_torch_package_models.py` and `common_pruning.py`, built with the "
        "constructor arguments torch's tests use (a class tested with several is one case per variant), "
        "compiled on each march and checked: call, ONNX export + `onnx.checker` + onnxruntime (compared "
        f"with the compiled model, atol {EXPORT_ATOL} / rtol {EXPORT_RTOL}), save/load (bit-identical "
        "outputs), and SQNR against the float model and against torch.ao FX PTQ (x86 default qconfig "
        "mapping, same calibration batches). Models with eager-torch CPU islands are *refused* by "
        "export and save by design (counted apart from failures). A raw error is an exception that is not "
        "a `QCompilerError`.",
        "",
        tabulate(environment() + [("run time", f"{seconds:.0f} s")], headers=["", ""], tablefmt="github"),
        "",
        "Reading the table: *SQNR vs float* above ~100 dB (or inf) means no op was quantized (no BPU "
        "partition: the model ran in float on the CPU); *n/a (output ~0)*: the float output is numerically "
        "zero everywhere, so no SQNR is meaningful. *ao FX* is torch.ao's own FX PTQ of the same model "
        "(`fail`: torch.ao cannot quantize it either; its errors are listed below).",
        "",
        "## Counts",
        "",
        tabulate(_md(counts(rows, marches)), headers=["", ""], tablefmt="github"),
        "",
        "## Failure categories",
        "",
        "Stage, exception type and the first line of its message; `raw` marks categories that are not a "
        "QCompilerError.",
        "",
        tabulate(_md(failure_categories(rows)), headers=["n", "category", "raw", "cases [marches]"],
                 tablefmt="github") if any(r["errors"] for r in rows) else "None.",
        "",
        "## torch.ao FX failures (the peer, for comparison)",
        "",
        tabulate(_md(fx_failures(rows)), headers=["case", "category"], tablefmt="github")
        if fx_failures(rows) else "None.",
        "",
        "## Per model",
        "",
        tabulate(_md(table_rows(rows)), headers=HEADERS, tablefmt="github"),
        "",
    ]
    return "\n".join(parts)


def select(cases: Sequence[Case], names: Optional[Sequence[str]]) -> list[Case]:
    """The cases named (a class name selects all its variants; ``TestHelperModules.`` may be left off)."""
    if not names:
        return list(cases)
    wanted, out = set(names), []
    for c in cases:
        short = c.class_name.removeprefix("TestHelperModules.")
        if {c.name, c.class_name, short} & wanted:
            out.append(c)
    unknown = wanted - {n for c in out for n in (c.name, c.class_name, c.class_name.removeprefix("TestHelperModules."))}
    if unknown:
        raise SystemExit(f"unknown model(s): {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(c.name for c in cases)}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", metavar="NAME", help="only these classes or cases")
    parser.add_argument("--march", nargs="+", choices=MARCHES, default=list(MARCHES), help="marches to compile for")
    parser.add_argument("--markdown", metavar="FILE", help="also write the report as markdown to FILE ('-': stdout)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON to FILE (to diff two runs)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = select(all_cases(), args.models)
    if args.list:
        print("\n".join(c.name for c in cases))
        return
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = run(cases, args.march)
    seconds = time.perf_counter() - t0
    print(tabulate(table_rows(rows), headers=HEADERS))
    print()
    print(tabulate(counts(rows, args.march)))
    print()
    print(tabulate(failure_categories(rows), headers=["n", "category", "raw", "cases [marches]"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": dict(environment()), "rows": rows}, indent=1))
    if args.markdown:
        passed = list(argv if argv is not None else sys.argv[1:])
        text = markdown(rows, args.march, seconds, passed)
        if args.markdown == "-":
            print(text)
        else:
            Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
