"""Architecture zoo: today's vision, text and audio architectures (Hugging Face ``transformers``) on the BPU.

    OMP_NUM_THREADS=1 python benchmarks/architecture_zoo.py [--models NAME ...] [--timeout 300]
    OMP_NUM_THREADS=1 python benchmarks/architecture_zoo.py --out docs/architecture_zoo.md   # regenerate the doc
    OMP_NUM_THREADS=1 python benchmarks/architecture_zoo.py --march nash --out docs/architecture_zoo_nash.md

PyTorch's quantization test models (benchmarks/model_coverage.py) compile, but they are not what people
deploy. This benchmark builds the model classes of ``transformers`` (``pip install -e .[bench]``) with small
random configs (:data:`CASES`: no download, no tokenizer; random ``input_ids`` / ``pixel_values`` /
``input_values``), given as keyword inputs (``example_inputs={"input_ids": ...}``), and per model
(:func:`run_case`, march bayes unless ``--march`` names another):

* compiles it (``qcompiler.compile``, :data:`CALIBRATION_BATCHES` seeded batches);
* the share of multiply-accumulates on the BPU (:func:`macs_by_placement`: torch's flop formulas
  around every node of the compiled graph, summed by the node's placement; the compiled graph's
  fixed-point modules compute in torch, so BPU and CPU nodes are counted alike);
* the numbers of BPU partitions, CPU (ONNX) islands and eager-torch islands, the share of the
  partitions' ops on the BPU and the BPU<->CPU boundary edges;
* the output SQNR against the float model, and that of torch.ao FX PTQ (``prepare_fx`` / ``convert_fx``,
  x86 default qconfig mapping, the same batches) where torch.ao can trace the model;
* whether the output has the float model's structure (type and keys);
* ``export_onnx`` + ``onnx.checker`` + an onnxruntime run compared with the compiled model.

Each model runs in its own subprocess (``--worker``) under a time limit, so one model that hangs or
crashes is a row, not the end of the table.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

if __package__ in (None, ""):  # run as a script: make "benchmarks" and "qcompiler" importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._data import SmoothNoise, reestimate_bn  # noqa: E402
from benchmarks.model_coverage import (  # noqa: E402
    _check_export, _fmt_db, _md, _quiet, category, environment, flat_tensors, sqnr)
from qcompiler.compiled import compile as qc_compile  # noqa: E402
from qcompiler.errors import ConfigError  # noqa: E402
from qcompiler.ir.meta import BPU, GM_INPUT_SPEC, META_PLACEMENT  # noqa: E402

try:
    import transformers as T
except ImportError:  # pragma: no cover - the bench extra installs it
    raise SystemExit("architecture_zoo needs transformers: pip install -e '.[bench]'") from None

MARCH = "bayes"  # the default march
REPORTS = {"bayes": "docs/architecture_zoo.md", "nash": "docs/architecture_zoo_nash.md"}
CALIBRATION_BATCHES = 8
BN_BATCHES = 4  # batches the random model's BatchNorm statistics are estimated on
BATCH = 2
TIMEOUT = 300.0  # seconds per model (its subprocess is killed after it)
REPORT = REPORTS[MARCH]
LOW_SQNR = 10.0  # dB: a row below it is named under the page's limits
ROOT = Path(__file__).resolve().parents[1]


# --- the models --------------------------------------------------------------------------------------------

def _image(channels: int = 3, size: int = 64) -> Callable[[int], dict]:
    """Smooth-noise images (benchmarks/_data.py), batch ``i`` seeded by ``i``."""
    def make(i: int) -> dict:
        ds = SmoothNoise(BATCH, size=size, channels=channels, seed=100 + i)
        return {"pixel_values": torch.stack([ds[k][0] for k in range(BATCH)])}
    return make


def _tokens(vocab: int = 100, length: int = 16, **extra: int) -> Callable[[int], dict]:
    """Random token ids (and ``extra`` name=length token inputs, e.g. decoder_input_ids), seeded by ``i``."""
    def make(i: int) -> dict:
        g = torch.Generator().manual_seed(200 + i)
        out = {"input_ids": torch.randint(0, vocab, (BATCH, length), generator=g)}
        for name, n in extra.items():
            out[name] = torch.randint(0, vocab, (BATCH, n), generator=g)
        return out
    return make


def _audio_features(mels: int, frames: int) -> Callable[[int], dict]:
    def make(i: int) -> dict:
        g = torch.Generator().manual_seed(300 + i)
        return {"input_features": torch.randn(BATCH, mels, frames, generator=g),
                "decoder_input_ids": torch.randint(0, 100, (BATCH, 4), generator=g)}
    return make


def _waveform(samples: int) -> Callable[[int], dict]:
    def make(i: int) -> dict:
        g = torch.Generator().manual_seed(400 + i)
        return {"input_values": torch.randn(BATCH, samples, generator=g)}
    return make


_RESNET = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64)
_TEXT_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Case:
    """One architecture: a builder of the random-weight model and its keyword inputs per batch index."""

    name: str
    family: str  # "conv" | "vision transformer" | "detection" | "segmentation" | "text" | "audio"
    build: Callable[[], nn.Module]
    inputs: Callable[[int], dict]

    def model(self) -> nn.Module:
        """The model in eval mode, seeded: torch's default initialization of every layer (transformers'
        ``initializer_range=0.02`` makes the activations of a deep random model vanish: EfficientNet's
        output is exactly 0), then the BatchNorm statistics re-estimated on :data:`BN_BATCHES` batches
        other than the measured ones (running stats of 0 / 1 would not fit the random weights)."""
        torch.manual_seed(0)
        with _quiet():
            model = self.build()
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                with torch.no_grad():
                    reestimate_bn(_KeywordCall(model), [self.inputs(1000 + i) for i in range(BN_BATCHES)])
            return model.eval()


class _KeywordCall(nn.Module):
    """Calls the wrapped model with a dict of keyword inputs as its one argument."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict) -> Any:
        return self.model(**inputs)


CASES: tuple[Case, ...] = (
    Case("ResNet", "conv", lambda: T.ResNetModel(T.ResNetConfig(**_RESNET)), _image()),
    Case("MobileNetV2", "conv", lambda: T.MobileNetV2Model(T.MobileNetV2Config(depth_multiplier=0.35, image_size=64)),
         _image()),
    Case("EfficientNet", "conv", lambda: T.EfficientNetModel(T.EfficientNetConfig(
        width_coefficient=0.25, depth_coefficient=0.25, image_size=64, hidden_dim=320)), _image()),
    Case("RegNet", "conv", lambda: T.RegNetModel(T.RegNetConfig(**_RESNET, groups_width=8)), _image()),
    Case("ConvNeXt", "conv", lambda: T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[16, 32, 64, 128],
                                                                      depths=[1, 1, 1, 1])), _image()),
    Case("Swin", "vision transformer", lambda: T.SwinModel(T.SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), _image()),
    Case("ViT", "vision transformer", lambda: T.ViTModel(T.ViTConfig(**_VIT)), _image(size=32)),
    Case("DeiT", "vision transformer", lambda: T.DeiTModel(T.DeiTConfig(**_VIT)), _image(size=32)),
    Case("BEiT", "vision transformer", lambda: T.BeitModel(T.BeitConfig(**_VIT, use_relative_position_bias=True)),
         _image(size=32)),
    Case("MobileViT", "vision transformer", lambda: T.MobileViTModel(T.MobileViTConfig(
        image_size=64, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_attention_heads=2)), _image()),
    Case("Segformer", "segmentation", lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
        patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=32, num_labels=4)), _image()),
    Case("DPT", "segmentation", lambda: T.DPTForSemanticSegmentation(T.DPTConfig(
        **{**_VIT, "num_hidden_layers": 4}, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32],
        fusion_hidden_size=16, num_labels=4)), _image(size=32)),
    Case("DETR", "detection", lambda: T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False,
        backbone_config=T.ResNetConfig(**_RESNET, out_features=["stage4"]), d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_queries=10, num_labels=4)), _image()),
    Case("BERT", "text", lambda: T.BertModel(T.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0)), _tokens()),
    Case("DistilBERT", "text", lambda: T.DistilBertModel(T.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, pad_token_id=0)),
         _tokens()),
    Case("GPT-2", "text", lambda: T.GPT2Model(T.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False, **_TEXT_IDS)), _tokens()),
    Case("T5", "text", lambda: T.T5Model(T.T5Config(
        vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)), _tokens(decoder_input_ids=4)),
    Case("Whisper", "audio", lambda: T.WhisperModel(T.WhisperConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=16, max_target_positions=16, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)),
         _audio_features(16, 32)),
    Case("Wav2Vec2", "audio", lambda: T.Wav2Vec2Model(T.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4)), _waveform(400)),
)
BY_NAME = {c.name: c for c in CASES}


# --- measures ----------------------------------------------------------------------------------------------

class _MacCounter(TorchDispatchMode):
    """Counts the flops of the ATen ops torch's flop counter has formulas for (``flop_registry``: mm, bmm,
    addmm, baddbmm, convolution, attention); an op without one is decomposed first, as FlopCounterMode
    does. FlopCounterMode itself is not used: its module tracker fails on graphs that switch grad mode
    ("Expected gradient function to be set")."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = flop_registry.get(func._overloadpacket)
        if formula is None and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _macs(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the multiply-accumulates torch counted while it ran (flops / 2). Attention runs its math
    form (matmuls): the CPU's fused kernel (``_scaled_dot_product_flash_attention_for_cpu``) has no flop
    formula, so it would count as nothing."""
    with sdpa_kernel([SDPBackend.MATH]), _MacCounter() as counter:
        out = fn()
    return out, counter.flops // 2


def _graph_args(gm: torch.fx.GraphModule, inputs: dict) -> list:
    """The compiled graph's placeholder values for keyword ``inputs`` (flattened by GM_INPUT_SPEC where the
    graph has one, else the values in order: the positional form)."""
    return list(_leaves(inputs) if gm.meta.get(GM_INPUT_SPEC) is not None else inputs.values())


def macs_by_placement(gm: torch.fx.GraphModule, args: Sequence[Any]) -> dict[str, int]:
    """Multiply-accumulates of one run of the compiled graph ``gm``, by node placement ("bpu" / "cpu").

    Every node is run under its own :class:`_MacCounter` (mm / bmm / conv / addmm / attention).
    A node without a placement (plumbing) counts as "cpu": work the BPU does not do."""
    totals = {"bpu": 0, "cpu": 0}

    class Counter(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out, macs = _macs(lambda: super(Counter, self).run_node(n))
            totals["bpu" if n.meta.get(META_PLACEMENT) == BPU else "cpu"] += macs
            return out

    with torch.no_grad():
        Counter(gm).run(*args)
    return totals


def _ao_wrapper(model: nn.Module, keys: Sequence[str]) -> nn.Module:
    """``model`` with its keyword inputs taken positionally (torch.ao's prepare_fx takes a tuple)."""
    if len(keys) > 4:
        raise ConfigError(f"the torch.ao wrapper takes at most 4 inputs, got {len(keys)}")

    class Positional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, a0, a1=None, a2=None, a3=None):  # fx cannot iterate *args
            return self.model(**dict(zip(keys, (a0, a1, a2, a3))))

    return Positional().eval()


def ao_fx(case: Case, batches: list[dict]) -> dict:
    """torch.ao FX PTQ (x86 default qconfig mapping, the same batches): its output on batch 0, or the error."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    try:
        with _quiet(), torch.no_grad():
            keys = list(batches[0])
            model = _ao_wrapper(case.model(), keys)
            prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), tuple(batches[0].values()))
            for b in batches:
                prepared(*copy.deepcopy(tuple(b.values())))
            return {"ok": True, "out": convert_fx(prepared)(*copy.deepcopy(tuple(batches[0].values())))}
    except Exception as exc:  # noqa: BLE001 - the peer's failure is data
        return {"ok": False, "error": category("ao FX", exc)}


def _positional(model: nn.Module, inputs: dict) -> Optional[tuple]:
    """``inputs`` as positional arguments, where they are the first parameters of ``forward`` in order."""
    params = list(inspect.signature(model.forward).parameters)
    return tuple(inputs.values()) if params[:len(inputs)] == list(inputs) else None


def structure(v: Any) -> str:
    """The output's container type and keys (``ModelOutput`` / dict) or tuple length, without the tensors."""
    if isinstance(v, dict):
        return f"{type(v).__name__}({', '.join(map(str, v.keys()))})"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}[{len(v)}]"
    return type(v).__name__


def _leaves(inputs: dict) -> tuple:
    """The tensor leaves of the keyword call, in the order the captured graph takes them (GM_INPUT_SPEC)."""
    leaves, _ = torch.utils._pytree.tree_flatten(((), inputs))
    return tuple(v for v in leaves if isinstance(v, torch.Tensor))


def compile_keywords(model: nn.Module, inputs: dict, batches: list[dict], march: str = MARCH
                     ) -> tuple[Any, Any, str]:
    """``qcompiler.compile`` with keyword example inputs and calibration batches: (compiled model, the
    example inputs it took, how the inputs were given).

    A commit that refuses the keyword form of a part gets the next form, named in the row: dict
    calibration batches refused -> each batch as the tuple of its tensor leaves; dict example inputs
    refused -> the same tensors positionally (where they are the forward's first parameters in order).
    Any other error is the row's failure."""
    try:
        return qc_compile(model, inputs, march=march, calib_data=batches, progress=False), inputs, "keywords"
    except ConfigError as exc:
        if "calib_data batch" in str(exc):
            cm = qc_compile(model, inputs, march=march, calib_data=[_leaves(b) for b in batches], progress=False)
            return cm, inputs, "keywords (calibration batches as tuples)"
        positional = _positional(model, inputs)
        if "example_inputs must be" not in str(exc) or positional is None:
            raise
    cm = qc_compile(model, positional, march=march, calib_data=[tuple(b.values()) for b in batches],
                    progress=False)
    return cm, positional, "positional (keywords refused)"


# --- one model ---------------------------------------------------------------------------------------------

def run_case(case: Case, workdir: Path, march: str = MARCH) -> dict:
    """Compile ``case`` for ``march`` and measure it; one result row (see :data:`HEADERS`)."""
    row: dict[str, Any] = {"model": case.name, "family": case.family, "march": march, "compile": "-",
                           "inputs": "keywords", "ops_bpu_share": None, "boundary_edges": None,
                           "macs": None, "macs_bpu": None, "macs_compiled": None, "bpu_share": None,
                           "bpu_parts": None, "cpu_islands": None, "torch_islands": None, "structure": None,
                           "sqnr_float": None, "ao_fx": None, "sqnr_ao_fx": None, "islands": None,
                           "export": "-", "export_diff": None, "export_match": None, "compile_s": None,
                           "errors": []}
    t0 = time.perf_counter()

    def fail(stage: str, exc: BaseException) -> None:
        row["errors"].append((category(stage, exc), False))

    batches = [case.inputs(i) for i in range(CALIBRATION_BATCHES)]
    inputs = batches[0]
    try:
        model = case.model()
        with _quiet(), torch.no_grad():
            ref, row["macs"] = _macs(lambda: model(**copy.deepcopy(inputs)))
    except Exception as exc:  # noqa: BLE001
        row["compile"] = "fail"
        fail("float model", exc)
        return row
    ao = ao_fx(case, batches)
    row["ao_fx"] = "ok" if ao["ok"] else "fail"
    row["ao_fx_error"] = ao.get("error")
    if ao["ok"]:
        row["sqnr_ao_fx"] = sqnr(ref, ao["out"])

    t1 = time.perf_counter()
    example: Any = inputs
    try:
        with _quiet():
            cm, example, row["inputs"] = compile_keywords(model, inputs, batches, march)
        row["compile"] = "ok"
    except Exception as exc:  # noqa: BLE001
        row["compile"] = "fail"
        fail("compile", exc)
        row["seconds"] = time.perf_counter() - t0
        return row
    row["compile_s"] = time.perf_counter() - t1
    kinds = [s.kind for s in cm.runtime.steps]
    row["bpu_parts"] = kinds.count(BPU)
    row["torch_islands"] = row["islands"] = len(cm.torch_islands())
    row["island_reasons"] = sorted({re.sub(r"node '[^']*'", "node", (r.strip().splitlines() or [""])[0])[:160]
                                    for r in cm.torch_islands().values()})  # one line per distinct reason
    row["cpu_islands"] = len(kinds) - row["bpu_parts"] - row["torch_islands"]
    ops = [(s.kind, len(s.nodes)) for s in cm.runtime.steps]
    total_ops = sum(n for _, n in ops)
    row["ops_bpu_share"] = sum(n for k, n in ops if k == BPU) / total_ops if total_ops else 0.0
    row["boundary_edges"] = cm.boundary_edges()
    try:
        args = _graph_args(cm.converted, inputs) if isinstance(example, dict) else list(example)
        with _quiet():
            counted = macs_by_placement(cm.converted, copy.deepcopy(args))
        row["macs_bpu"], row["macs_compiled"] = counted["bpu"], counted["bpu"] + counted["cpu"]
        row["bpu_share"] = counted["bpu"] / row["macs_compiled"] if row["macs_compiled"] else 0.0
    except Exception as exc:  # noqa: BLE001
        fail("MAC count", exc)

    out = None
    try:
        with _quiet():
            out = cm(**copy.deepcopy(inputs)) if isinstance(example, dict) else cm(*copy.deepcopy(example))
        row["structure"] = structure(out) == structure(ref)
        if not row["structure"]:
            row["errors"].append((f"call: output {structure(out)}, the float model's {structure(ref)}", False))
        row["sqnr_float"] = sqnr(ref, out)
    except Exception as exc:  # noqa: BLE001
        fail("call", exc)
    flat_inputs = tuple(inputs.values()) if isinstance(example, dict) else example
    _check_export(cm, flat_inputs, out, workdir / f"{case.name}.onnx", row, fail)
    row["seconds"] = time.perf_counter() - t0
    return row


def run_worker(name: str, row_json: Path, march: str = MARCH) -> None:
    """The ``--worker`` mode: one model, its row written as JSON to ``row_json``."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="qc_zoo_") as tmp:
        row = run_case(BY_NAME[name], Path(tmp), march)
    row_json.write_text(json.dumps(row, default=str))


def run_isolated(name: str, timeout: float = TIMEOUT, march: str = MARCH) -> dict:
    """``name`` in its own subprocess under ``timeout`` seconds; a crash or a timeout is a row too."""
    family = BY_NAME[name].family
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qc_zoo_row_") as tmp:
        path = Path(tmp) / "row.json"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--row-json", str(path),
               "--march", march]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return _failed_row(name, family, "timeout", f"killed after {timeout:.0f} s", time.perf_counter() - t0)
        if proc.returncode != 0 or not path.exists():
            tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            return _failed_row(name, family, "crash", f"worker: exit {proc.returncode}: {tail[:200]}",
                               time.perf_counter() - t0)
        row = json.loads(path.read_text())
    row["seconds"] = time.perf_counter() - t0
    return row


def _failed_row(name: str, family: str, status: str, error: str, seconds: float) -> dict:
    return {"model": name, "family": family, "compile": status, "errors": [(error, False)], "seconds": seconds}


# --- the table ---------------------------------------------------------------------------------------------

HEADERS = ["model", "family", "compile", "MACs (M)", "MACs on BPU", "ops on BPU", "BPU parts", "CPU islands",
           "torch islands", "boundary edges",
           "structure", "SQNR vs float (dB)", "ao FX SQNR vs float (dB)", "export", "exported==compiled",
           "time (s)", "first failure"]


def _pct(v: Optional[float]) -> str:
    return "" if v is None else f"{100 * v:.1f} %"


def _n(v: Any) -> str:
    return "" if v is None else str(v)


def table_rows(rows: Sequence[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        first = r["errors"][0][0] if r.get("errors") else ""
        match = r.get("export_match")
        ao = r.get("ao_fx")
        positional = r.get("inputs", "keywords").startswith("positional")
        out.append([
            r["model"], r["family"], r["compile"] + (" (positional)" if positional else ""),
            "" if r.get("macs") is None else f"{r['macs'] / 1e6:.2f}", _pct(r.get("bpu_share")),
            _pct(r.get("ops_bpu_share")), _n(r.get("bpu_parts")), _n(r.get("cpu_islands")),
            _n(r.get("torch_islands")), _n(r.get("boundary_edges")),
            "" if r.get("structure") is None else ("same" if r["structure"] else "differs"),
            _fmt_db(r.get("sqnr_float")), "fail" if ao == "fail" else _fmt_db(r.get("sqnr_ao_fx")),
            r.get("export", "-"),
            "" if match is None else (f"yes ({r['export_diff']:.2g})" if match else
                                      f"no ({r['export_diff']:.2g})" if r.get("export_diff") is not None else "no"),
            f"{r['seconds']:.0f}", first[:120],
        ])
    return out


TRANSFORMERS = ("BERT", "DistilBERT", "GPT-2", "ViT", "Swin", "ConvNeXt")
# issue 34: the transformer-era march keeps these encoders / decoders on the BPU in one or two partitions
NASH_TRANSFORMERS = ("BERT", "GPT-2", "ViT", "Swin")


def criteria(rows: Sequence[dict], march: str = MARCH) -> list[tuple[str, str, str]]:
    """The issues' done criteria this table can check for ``march``: (criterion, models meeting it,
    models missing it). bayes: issue 33's; nash: issue 34's on top."""
    def check(label: str, family: Sequence[str], ok: Callable[[dict], bool]) -> tuple[str, str, str]:
        sel = [r for r in rows if r["model"] in family or r["family"] in family]
        good = [r["model"] for r in sel if ok(r)]
        met = f"{len(good)}/{len(sel)}" + (f": {', '.join(good)}" if good else "")
        return label, met, ", ".join(r["model"] for r in sel if not ok(r))

    def share(r: dict) -> float:
        return r.get("bpu_share") or 0.0

    exported = lambda r: r.get("export") == "ok" and r.get("export_match") is True  # noqa: E731
    nash = [check("nash: >= 95 % of the ops on BPU, <= 2 BPU partitions, export valid and equal",
                  NASH_TRANSFORMERS,
                  lambda r: r["compile"] == "ok" and (r.get("ops_bpu_share") or 0.0) >= 0.95
                  and (r.get("bpu_parts") or 99) <= 2 and exported(r))] if march == "nash" else []
    return nash + [
        check("conv: compiles, 0 torch islands, >= 95 % MACs on BPU, export valid and equal", ("conv",),
              lambda r: r["compile"] == "ok" and r.get("torch_islands") == 0 and share(r) >= 0.95 and exported(r)),
        check("segmentation: compiles, the float model's output structure", ("segmentation",),
              lambda r: r["compile"] == "ok" and r.get("structure") is True),
        check("transformers: >= 80 % MACs on BPU, export valid", TRANSFORMERS,
              lambda r: r["compile"] == "ok" and share(r) >= 0.80 and r.get("export") == "ok"),
        check("accuracy: SQNR >= torch.ao FX's (where both run)", [r["model"] for r in rows if r.get("ao_fx") == "ok"],
              lambda r: r.get("sqnr_float") is not None and r.get("sqnr_ao_fx") is not None
              and r["sqnr_float"] >= r["sqnr_ao_fx"]),
    ]


def ao_failures(rows: Sequence[dict]) -> list[tuple[str, str]]:
    return [(r["model"], r["ao_fx_error"]) for r in rows if r.get("ao_fx_error")]


def markdown(rows: Sequence[dict], seconds: float, argv: Sequence[str], timeout: float, march: str = MARCH) -> str:
    env = environment(REPORTS.get(march, REPORT)) + [("transformers", T.__version__),
                                                     ("run time", f"{seconds:.0f} s")]
    cmd = "OMP_NUM_THREADS=1 python benchmarks/architecture_zoo.py " + " ".join(argv)
    positional = [r["model"] for r in rows if r.get("inputs", "keywords").startswith("positional")]
    flat_calib = [r["model"] for r in rows if "as tuples" in r.get("inputs", "")]
    parts = [
        f"# Architecture zoo: today's architectures (Hugging Face transformers) on the BPU ({march})",
        "",
        "Generated by `benchmarks/architecture_zoo.py` (do not edit by hand); regenerate with",
        "",
        f"    {cmd.strip()}",
        "",
        "**Goal.** PyTorch's quantization test models all compile (docs/model_coverage.md); this page measures "
        "the architectures people deploy: how much of each model's work reaches the BPU, whether it exports, "
        "and how accurate it is against the float model and against torch.ao FX PTQ. It tracks issue 33's "
        "done criteria (below).",
        "",
        tabulate(env, headers=["", ""], tablefmt="github"),
        "",
        "## Method",
        "",
        f"Each model is a `transformers` model class with a small random config (`benchmarks/architecture_zoo.py`"
        f" `CASES`: no download, no tokenizer), in eval mode, called with keyword inputs "
        f"(`example_inputs={{\"pixel_values\": ...}}`): smooth-noise images (benchmarks/_data.py), random token "
        f"ids, random audio features or waveforms, batch {BATCH}. Per model, in its own subprocess (time limit "
        f"{timeout:.0f} s): `qcompiler.compile(march=\"{march}\")` with {CALIBRATION_BATCHES} seeded calibration "
        "batches (batch 0 is the one measured); the multiply-accumulates (MACs) of every node of the compiled "
        "graph, counted with torch's flop formulas (`torch.utils.flop_counter.flop_registry`, flops / 2: conv, "
        "linear, matmul / bmm, attention) and "
        "summed by the node's placement (*MACs on BPU* is the BPU's share of the compiled graph's MACs; "
        "*MACs (M)* is the float model's total); the partitions of the runtime (BPU partitions, CPU islands "
        "run by onnxruntime, eager-torch islands), the share of the partitions' ops that are in BPU partitions "
        "(*ops on BPU*, the quantize / dequantize stubs at their edges included) and the values crossing between "
        "a BPU and a CPU partition (*boundary edges*); the output's structure (container type and keys) against "
        "the float model's; the output SQNR against the float model over all output tensors; torch.ao FX PTQ "
        "(`prepare_fx` / `convert_fx`, x86 default qconfig mapping, the same batches, inputs given "
        "positionally) and its SQNR against the float model; `export_onnx` + `onnx.checker` (full check) + "
        "an onnxruntime run compared with the compiled model (atol/rtol 1e-4; the number is the max |diff|). "
        "A model with eager-torch islands has no ONNX form: its export is *refused* by design.",
        "",
        "## Limits",
        "",
        "- Random weights and small configs (2 layers, width 16-32, 32x32 or 64x64 images, 16 tokens): the "
        "MAC shares and island counts depend mostly on which ops the architecture uses and where, not on its "
        "sizes; the SQNRs do not transfer to trained weights and real data.",
        "- *MACs on BPU* counts what torch's flop formulas count (matrix products and convolutions); "
        "elementwise work, norms and softmax are not MACs. An eager-torch island that runs the whole model "
        "counts as CPU.",
        f"- torch.ao FX traces with torch.fx, which transformers' `forward`s defeat: it ran on "
        f"{sum(r.get('ao_fx') == 'ok' for r in rows)}/{len(rows)} models here (its errors are listed below), so "
        "the accuracy criterion has no peer on the others; torch.ao's export-based PT2E flow is not measured.",
        f"- One march ({march}) per page, one batch measured; time is the whole subprocess (import, float run, torch.ao, "
        "compile, MAC count, export) on a 2-core machine shared with other work.",
    ]
    if positional:
        parts.append(f"- At this commit `compile` refused keyword (dict) example inputs; "
                     f"{', '.join(positional)} ran with the same tensors given positionally (*(positional)* "
                     "in the compile column).")
    low = [f"{r['model']} ({r['sqnr_float']:.1f} dB)" for r in rows
           if r.get("sqnr_float") is not None and not math.isnan(r["sqnr_float"]) and r["sqnr_float"] < LOW_SQNR]
    if low:
        parts.append(f"- SQNR vs float below {LOW_SQNR:.0f} dB: {', '.join(low)}. torch.ao cannot trace them; "
                     "`benchmarks/low_sqnr_rows.py` measures onnxruntime's int8 quantizer on the same models and data, "
                     "the weight-only bound and the float model's perturbation gain (*Low-SQNR rows* below).")
    if flat_calib:
        parts.append(f"- At this commit `compile` took keyword example inputs but not dict calibration batches; "
                     f"{', '.join(flat_calib)} were calibrated on each batch's tensors as a tuple (the graph's "
                     "input order).")
    parts += [
        "",
        f"## Done criteria ({'issues 34 and 33' if march == 'nash' else 'issue 33'}, {march})",
        "",
        tabulate(_md(criteria(rows, march)), headers=["criterion", "meeting it", "missing it"], tablefmt="github"),
        "",
        "## Per model",
        "",
        tabulate(_md(table_rows(rows)), headers=HEADERS, tablefmt="github"),
        "",
        "## Failures",
        "",
        "Every failure of a row, stage first (the table shows the first).",
        "",
        tabulate(_md([(r["model"], e) for r in rows for e, _ in r.get("errors", [])]),
                 headers=["model", "failure"], tablefmt="github")
        if any(r.get("errors") for r in rows) else "None.",
        "",
        "## Eager-torch islands",
        "",
        "Why each model's eager-torch islands are not ONNX (the distinct reasons; they block export).",
        "",
        tabulate(_md([(r["model"], reason) for r in rows for reason in r.get("island_reasons", [])]),
                 headers=["model", "reason"], tablefmt="github")
        if any(r.get("island_reasons") for r in rows) else "None.",
        "",
        "## torch.ao FX failures (the peer)",
        "",
        tabulate(_md(ao_failures(rows)), headers=["model", "error"], tablefmt="github") if ao_failures(rows)
        else "None.",
        "",
    ]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", metavar="NAME", choices=list(BY_NAME),
                        help=f"only these models (default: all): {', '.join(BY_NAME)}")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per model (default %(default)s)")
    parser.add_argument("--out", metavar="FILE", help=f"write the markdown report to FILE (e.g. {REPORT})")
    parser.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON to FILE")
    parser.add_argument("--march", default=MARCH, choices=("bayes", "bernoulli2", "nash"),
                        help="the march to compile for (default %(default)s)")
    parser.add_argument("--worker", metavar="NAME", choices=list(BY_NAME), help=argparse.SUPPRESS)
    parser.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.row_json is None:
            parser.error("--worker needs --row-json")
        run_worker(args.worker, args.row_json, args.march)
        return
    names = args.models or list(BY_NAME)
    t0 = time.perf_counter()
    rows = []
    for i, name in enumerate(names):
        rows.append(run_isolated(name, args.timeout, args.march))
        r = rows[-1]
        print(f"[{i + 1}/{len(names)}] {name}: compile {r['compile']}, BPU MACs {_pct(r.get('bpu_share'))} "
              f"({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    print(tabulate(table_rows(rows), headers=HEADERS))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": dict(environment(REPORT)), "rows": rows},
                                              indent=1, default=str))
    if args.out:
        passed = list(argv if argv is not None else sys.argv[1:])
        # the command the page shows regenerates the page, not a scratch JSON file
        passed = [a for i, a in enumerate(passed) if a != "--json" and not a.startswith("--json=")
                  and (i == 0 or passed[i - 1] != "--json")]
        page = markdown(rows, seconds, passed, args.timeout, args.march)
        Path(args.out).write_text(keep_section(Path(args.out), page, KEPT_SECTION, before="## Per model"))


KEPT_SECTION = "## Low-SQNR rows"  # written by benchmarks/low_sqnr_rows.py; a rewrite of the page keeps it


def keep_section(old: Path, page: str, heading: str, before: str) -> str:
    """``page`` with the ``heading`` section of the ``old`` file (up to its next ``## ``) put back in
    front of ``before``: another benchmark owns that section."""
    text = old.read_text() if old.is_file() else ""
    start = text.find(heading + "\n")
    if start < 0 or before not in page:
        return page
    end = text.find("\n## ", start + len(heading))
    section = text[start:] if end < 0 else text[start:end + 1]
    return page.replace(before, section.rstrip("\n") + "\n\n" + before, 1)


if __name__ == "__main__":
    main()
