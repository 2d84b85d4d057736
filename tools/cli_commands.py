"""The work behind the ``qcompiler`` commands: model loading, calibration data, and the commands.

tools/cli.py parses and checks the arguments without importing torch or the compiler (so
``--help`` and argument errors are instant) and imports this module only to run a command.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import importlib.util
import json
import inspect
import math
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
from tabulate import tabulate

import qcompiler
from qcompiler import zoo
from qcompiler.calib_data import CalibData, ImagePreprocess, input_names, load_batches
from qcompiler.distributed import is_main_process, join_torchrun, shard
from qcompiler.errors import ConfigError
from qcompiler.ir.capture import DEFAULT_CAPTURE
from qcompiler.ir.dump import DUMP_STEM, dump_partitioned
from qcompiler.ir.names import resolve_type
from qcompiler.ir.partitions import format_op_counts, partitions, summary_line
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools.cli import (EXIT_OK, INT_INPUT_HIGH, UsageError, check_calibration_args,
                                 check_report_args, image_preprocess_args)
from qcompiler.tools.build_config import to_build_config
from qcompiler.tools.config_file import read_hybrid_file, read_qconfig_file
from qcompiler.tools.quant_analysis import QuantAnalysis

INPUT_DTYPES = {"float32": torch.float32, "int64": torch.int64}
INPUT_SEED = 0
ZOO_PREFIX = "zoo:"
FACTORY_LIST_LIMIT = 20  # callables listed when a factory name is missing


# ----------------------------------------------------------------------------- model loading


def _user_frame(exc: BaseException) -> str:
    """``file:line`` of the user's code where ``exc`` arose: the line of a SyntaxError, else the innermost
    frame outside Python's and the installed packages' files (and qcompiler's); "" if there is none."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}" if exc.lineno else exc.filename
    library = tuple({str(Path(p).resolve()) for p in (
        sysconfig.get_path("stdlib"), sysconfig.get_path("purelib"), sysconfig.get_path("platlib"),
        Path(qcompiler.__file__).parent, Path(__file__).parent)})
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(library)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _user_code_error(what: str, exc: BaseException) -> ConfigError:
    """One line for an exception raised by the user's model code: ``what``, where, type and message."""
    message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    where = _user_frame(exc)
    text = " ".join(f"{type(exc).__name__}: {message}".split())
    return ConfigError(f"{what}: {where}: {text}" if where else f"{what}: {text}")


def _import_file(path: Path):
    """Import a ``.py`` file as a module; registered under its stem when that name is free,
    so ``--hybrid-module-type stem.Class`` can refer to classes defined in it."""
    if path.is_dir():
        package = (f"; for the package in it, write {path.name + ':FACTORY'!r}"
                   if (path / "__init__.py").is_file() and path.name.isidentifier() else "")
        raise ConfigError(f"model file {str(path)!r} is a directory: a model spec names a Python file and a factory "
                          f"in it, 'path/to/file.py:factory' (or 'package.module:factory', 'zoo:NAME'){package}")
    if not path.is_file():
        raise ConfigError(f"model file {str(path)!r} does not exist")
    stem = path.stem if path.stem.isidentifier() else "qc_user_model"
    name = stem
    if name in sys.modules:
        existing = getattr(sys.modules[name], "__file__", None)
        if existing and Path(existing).resolve() == path.resolve():
            return sys.modules[name]
        name = f"_qcompiler_user_{stem}_{abs(hash(str(path.resolve()))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import model file {str(path)!r}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise _user_code_error(f"cannot import model file {str(path)!r}", exc) from exc
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(name: str):
    """Import a dotted module name, with the current directory importable (as with ``python -m``)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ConfigError(f"cannot import model module {name!r}: {exc}") from None
        raise _user_code_error(f"cannot import model module {name!r}", exc) from exc
    except Exception as exc:
        raise _user_code_error(f"cannot import model module {name!r}", exc) from exc
    finally:
        if added:
            try:
                sys.path.remove(cwd)
            except ValueError:
                pass


def _factory_hint(module, attr: str) -> str:
    """`` Did you mean 'x'? Callables defined in it: a, b`` for a factory name the module lacks."""
    own = str(getattr(module, "__name__", ""))

    def defined_here(value) -> bool:  # not imported from elsewhere (a package's own submodules count)
        where = str(getattr(value, "__module__", own) or "")
        return where == own or where.startswith(own + ".")

    public = sorted(n for n, v in vars(module).items() if not n.startswith("_") and callable(v) and defined_here(v))
    close = difflib.get_close_matches(attr, public, n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    if not public:
        return f"{hint} It defines no callable: add a function that returns the nn.Module"
    return f"{hint} Callables defined in it: {_names(public, FACTORY_LIST_LIMIT)}"


def load_factory_model(spec: str) -> nn.Module:
    """Build the model of ``module:factory`` or ``path/to/file.py:factory`` by calling ``factory()``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"model {spec!r} must be 'zoo:NAME', 'package.module:factory' or 'path/to/file.py:factory'"
        )
    looks_like_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(Path(target)) if looks_like_file else _import_module(target)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{target!r} has no attribute {attr!r}.{_factory_hint(module, attr)}") from None
    if not callable(obj):
        raise ConfigError(f"{spec!r} is not callable: got {type(obj).__name__}")
    try:
        inspect.signature(obj).bind()
    except TypeError as exc:
        raise ConfigError(f"{spec!r} must be callable without arguments: {exc}") from None
    except ValueError:  # no signature available (some builtins): just try the call
        pass
    try:
        model = obj()
    except Exception as exc:
        raise _user_code_error(f"model factory {spec!r} failed", exc) from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec!r}() must return a torch.nn.Module, got {type(model).__name__}")
    return model


def random_inputs(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> tuple:
    """Seeded random inputs: float32 uniform ``[0, 1)``, int64 in ``[0, INT_INPUT_HIGH)``."""
    g = torch.Generator().manual_seed(INPUT_SEED)
    out = []
    for i, shape in enumerate(shapes):
        dtype = INPUT_DTYPES[dtypes[i] if i < len(dtypes) else "float32"]
        if dtype.is_floating_point:
            out.append(torch.rand(shape, generator=g, dtype=dtype))
        else:
            out.append(torch.randint(0, INT_INPUT_HIGH, shape, generator=g, dtype=dtype))
    return tuple(out)


def load_model(spec: str, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> tuple[nn.Module, tuple, str]:
    """``(model, example_inputs, dump name)`` for a ``zoo:NAME`` or ``module:factory`` spec."""
    if dtypes and not shapes:
        raise UsageError("--input-dtype needs --input-shape (dtypes pair with shapes by position)")
    if len(dtypes) > len(shapes):
        raise UsageError(
            f"{len(dtypes)} --input-dtype values for {len(shapes)} --input-shape values; "
            "give at most one dtype per input, in the same order"
        )
    if spec.startswith(ZOO_PREFIX):
        name = spec[len(ZOO_PREFIX):]
        model = zoo.get(name)
        inputs = random_inputs(shapes, dtypes) if shapes else zoo.example_inputs(name)
        return model, inputs, name
    if not shapes:
        raise UsageError(f"--input-shape is required for {spec!r} (only zoo models have default inputs)")
    model = load_factory_model(spec)
    return model, random_inputs(shapes, dtypes), type(model).__name__


# ----------------------------------------------------------------------------- subcommands


def _names(names: Sequence[str], limit: int = 3) -> str:
    if not names:
        return "-"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... (+{len(names) - limit})"


def model_configs(args: argparse.Namespace, model: nn.Module) -> tuple[Optional[dict], Optional[dict]]:
    """``(hybrid_dict, prepare_custom_config_dict)`` from the shared model flags; module type names are
    matched against ``model``'s classes, never imported (qcompiler.ir.names.resolve_type)."""
    hybrid_dict = None
    if args.hybrid_module_name or args.hybrid_module_type:
        types = [resolve_type(t, f"--hybrid-module-type {t!r}", model) for t in args.hybrid_module_type]
        hybrid_dict = {"module_name": list(args.hybrid_module_name), "module_type": types}
    custom = {"non_traceable_module_name": list(args.leaf_module)} if args.leaf_module else {}
    if args.capture != DEFAULT_CAPTURE:
        custom["capture"] = args.capture
    return hybrid_dict, (custom or None)


def cmd_partition(args: argparse.Namespace) -> int:
    """Trace, place and partition a model, print the partitions and write the review dump."""
    model, inputs, name = load_model(args.model, args.input_shape or [], args.input_dtype or [])
    hybrid_dict, custom = model_configs(args, model)
    out = Path(args.out)
    dump_dir = out / "passes" if args.dump_passes else None

    gm = qcompiler.partition(
        model,
        inputs,
        march=args.march,
        hybrid_dict=hybrid_dict,
        prepare_custom_config_dict=custom,
        dump_dir=dump_dir,
    )
    result = dump_partitioned(gm, out)

    print(summary_line(gm))
    rows = [[p.name, p.placement, len(p.nodes), _names(p.inputs), _names(p.outputs)] for p in partitions(gm)]
    print(tabulate(rows, headers=["partition", "placement", "ops", "inputs", "outputs"], tablefmt="simple"))
    print(format_op_counts(gm))
    print(f"wrote {len(result.files)} files to {out}:")
    for path in result.files:
        print(f"  {path}")
    if dump_dir is not None:
        print(f"per-pass graphs in {dump_dir}")
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return EXIT_OK


RANDOM_NOTE = "not real inputs: give --calib-data FILE or --calib-images DIR"


def calibration_batches(args: argparse.Namespace, inputs: tuple, model: Optional[nn.Module] = None,
                        random_default: int = 8) -> CalibData:
    """The calibration batches and what they are: from --calib-data (a file), --calib-images (a folder
    with its preprocessing), or --calib-random N seeded random batches shaped like ``inputs``."""
    check_calibration_args(args)
    images = getattr(args, "calib_images", None)
    if args.calib_data or images:
        option, source = ("--calib-data", args.calib_data) if args.calib_data else ("--calib-images", images)
        preprocess = ImagePreprocess(**image_preprocess_args(args)) if images else None
        if not images and Path(source).is_dir():
            raise ConfigError(f"--calib-data {source}: is a folder; for a folder of images give --calib-images "
                              f"{source} with its preprocessing (--resize, --crop, --mean, --std, ...)")
        try:
            data = load_batches(Path(source), inputs, batch_size=args.calib_batch_size, preprocess=preprocess,
                                limit=args.calib_limit, names=input_names(model) if model is not None else None,
                                where=f"{option} {source}")
        except ConfigError as exc:
            if getattr(exc, "__notes__", None):  # a shape or dtype mismatch (load_batches notes the format)
                exc.add_note("the example inputs the data must match come from --input-shape/--input-dtype (or "
                             "the zoo model's default)")
            raise
        return data
    count = random_default if args.calib_random is None else args.calib_random
    g = torch.Generator().manual_seed(INPUT_SEED + 1)
    batches = []
    for _ in range(count):
        batch = []
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                batch.append(x)
            elif x.is_floating_point():
                batch.append(torch.rand(x.shape, generator=g, dtype=x.dtype))
            else:
                batch.append(torch.randint(0, INT_INPUT_HIGH, x.shape, generator=g, dtype=x.dtype))
        batches.append(tuple(batch))
    return CalibData(batches, f"random data ({count} seeded batches of uniform noise, --calib-random; {RANDOM_NOTE})",
                     count, random=True)


def _data_label(data: CalibData) -> str:
    """What a printed measurement was made on: "random data (...)" or "the calibration data, 8 images in d"."""
    return data.description if data.random else f"the calibration data, {data.description}"


def _flat_tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat_tensors(v)]
    return []


def output_sqnr(model: nn.Module, compiled, batches: Sequence[tuple]) -> float:
    """Output SQNR (dB) of the compiled model against the float model over the batches."""
    sig = err = 0.0
    with torch.no_grad():
        for batch in batches:
            for f, q in zip(_flat_tensors(model(*batch)), _flat_tensors(compiled(*batch))):
                f, q = f.double(), q.double()
                sig += float((f * f).sum())
                err += float(((f - q) ** 2).sum())
    if err == 0:
        return float("inf")
    return 10 * math.log10(sig / err) if sig > 0 else float("-inf")


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a model end to end and write everything a user reviews or deploys.

    Under ``torchrun`` each rank calibrates every world-th batch, the observers are
    reduced over the ranks (the result of one process on all batches), and rank 0
    alone writes the outputs and prints the summary. The arguments (and the torchrun
    environment) are checked before the process group is joined.
    """
    check_calibration_args(args)
    joined = join_torchrun()
    try:
        return _compile(args)
    finally:
        if joined:
            torch.distributed.destroy_process_group()


def _file_configs(args: argparse.Namespace, hybrid_dict: Optional[dict], model: nn.Module
                  ) -> tuple[Optional[dict], Optional[dict]]:
    """``(qconfig_dict, hybrid_dict)`` with the ``--qconfig`` / ``--hybrid`` JSON files (tools/config_file.py)
    merged in: the file's hybrid entries join the --hybrid-module-* flags (its module types matched
    against ``model``'s classes, as the flag's are)."""
    qconfig_dict = read_qconfig_file(args.qconfig) if args.qconfig else None
    if args.hybrid:
        extra = read_hybrid_file(args.hybrid)
        extra["module_type"] = [resolve_type(t, f"--hybrid {args.hybrid}: ['module_type'][{i}]", model)
                                for i, t in enumerate(extra["module_type"])]
        base = hybrid_dict or {"module_name": [], "module_type": []}
        hybrid_dict = {k: list(dict.fromkeys(base.get(k, []) + extra[k])) for k in ("module_name", "module_type")}
    return qconfig_dict, hybrid_dict


def _compile(args: argparse.Namespace) -> int:
    model, inputs, name = load_model(args.model, args.input_shape or [], args.input_dtype or [])
    hybrid_dict, custom = model_configs(args, model)
    qconfig_dict, hybrid_dict = _file_configs(args, hybrid_dict, model)
    data = calibration_batches(args, inputs, model, random_default=8)
    batches = data.batches
    model.eval()
    compiled = qcompiler.compile(model, inputs, march=args.march, qconfig_dict=qconfig_dict, hybrid_dict=hybrid_dict,
                                 calib_data=shard(batches), prepare_custom_config_dict=custom,
                                 weight_rounding=args.weight_rounding, int16_budget=args.int16_budget,
                                 progress=is_main_process())
    if not is_main_process():
        return EXIT_OK
    out = Path(args.out)
    files = compiled.dump(out)
    onnx_path = out / f"{DUMP_STEM}.onnx"
    compiled.export_onnx(onnx_path)
    files += [onnx_path, Path(f"{onnx_path}.quant.json")]
    files.append(compiled.save(out / f"{DUMP_STEM}.qc"))
    print(compiled.summary())
    print(format_op_counts(compiled.converted))
    if compiled.int16 is not None:
        rec = compiled.int16
        print(f"int16: {len(rec['chosen'])} of {rec['tensors']} BPU activation tensors "
              f"({', '.join(rec['chosen']) or 'none'}); output SQNR on {_data_label(data)}: "
              f"{rec['baseline_sqnr']:.2f} -> {rec['reached_sqnr']:.2f} dB")
    print(f"output SQNR vs float on {_data_label(data)}: {output_sqnr(model, compiled, batches):.2f} dB")
    print(f"wrote {len(files)} files to {out}")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    """Quantization accuracy report: float vs fake-quant vs converted, per layer, with advisor and sensitivity.

    The arguments are checked before any work (tools/cli.py check_report_args). Every metric is
    measured on the calibration batches, and the output says which data those are."""
    check_calibration_args(args)
    check_report_args(args)
    model, inputs, name = load_model(args.model, args.input_shape or [], args.input_dtype or [])
    hybrid_dict, custom = model_configs(args, model)
    data = calibration_batches(args, inputs, model, random_default=4)
    batches = data.batches
    model.eval()
    cal = prepare_calibration_fx(model, None, custom, hybrid=True, hybrid_dict=hybrid_dict, example_inputs=inputs,
                                 march=args.march)
    cal.eval()
    with torch.no_grad():
        for batch in batches:
            cal(*batch)
    fq = prepare_qat_fx(cal, None, custom, hybrid=True, hybrid_dict=hybrid_dict)
    set_state(fq, "validation")
    fq.eval()
    converted = convert_fx(fq)
    out = Path(args.out)
    qa = QuantAnalysis(model, converted, "quantized", out_dir=out, fake_quant_model=fq)
    qa.auto_find_bad_case(batches, metric=args.metric)
    qa.run()
    qa.compare_per_layer()
    ranked = qa.sensitivity(metric=args.metric)
    missed = None
    if args.target_sqnr is not None:
        try:
            qa.suggest_int16(args.target_sqnr)
        except ConfigError as exc:  # the advice (every step) is kept and reported; the target is out of reach
            missed = str(exc)
    applied = None
    if args.advise:
        qa.advise(top_k=args.advise)
        if args.apply:
            applied = qa.apply_advice(args.apply)
    qa.report()
    print(f"measured on {_data_label(data)}: every metric and SQNR below")
    print(f"bad case: batch {qa.bad_case_index} ({args.metric} {qa.bad_case_metric:.6g})")
    print(f"{len(qa.compare_rows)} layers compared, {len(qa.advice)} advisor finding(s)")
    for row in ranked[:5]:
        print(f"  sensitive: {row[0]} ({row[1]}) {args.metric} {row[3]:.6g}")
    print(qa.int16_advice_text() or "int16 advice: none (give --target-sqnr DB to get it)\n", end="")
    print(qa.fix_advice_text(), end="")
    if applied is not None and getattr(args, "config", None):
        print(f"fixes written to {applied}: qcompiler build {args.config} applies them")
    elif applied is not None:
        print(f"fixes written to {applied}: qcompiler compile {args.model} --qconfig {applied} "
              f"--hybrid {applied} ... applies them")
    elif args.apply:
        print(f"no fix gains on the bad case: nothing written to {args.apply}")
    if missed is not None:
        print(f"note: {missed}", file=sys.stderr)
    print(f"wrote {len(qa.written)} files to {out}:")
    for path in qa.written:
        print(f"  {path}")
    return EXIT_OK


VERSIONED = ("qcompiler", "torch", "numpy", "onnx", "onnxruntime", "pillow")


def _versions() -> dict:
    """The versions a build ran with, for the record in --out."""
    found = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = qcompiler.__version__ if name == "qcompiler" else None
    return found


def cmd_build(args: argparse.Namespace) -> int:
    """``qcompiler build CONFIG``: compile as the config says (tools/build_config.py made ``args``),
    then record the config as run and the versions in --out, so the build can be repeated."""
    fixes = getattr(args, "fixes", None)
    if fixes is not None:
        if not Path(fixes).is_file():
            print(f"no fixes file {fixes} yet ('qcompiler build {args.config} --report' writes it): "
                  "building without it")
        elif args.qconfig is not None or args.hybrid is not None:
            raise ConfigError(f"{args.config}: fixes = {fixes!r} and qconfig / hybrid.file are both set; a fixes "
                              "file is applied as both: merge it into your files and drop one of the keys")
        else:
            print(f"applying the report's fixes {fixes} (as --qconfig and --hybrid)")
            args.qconfig = args.hybrid = fixes
        args.fixes = None  # build.toml records what was applied: qconfig and hybrid.file
    code = cmd_compile(args)
    if code == EXIT_OK and os.environ.get("RANK", "0") == "0":
        out = Path(args.out)
        (out / "build.toml").write_text(to_build_config(args))
        (out / "versions.json").write_text(json.dumps(_versions(), indent=1) + "\n")
        print(f"recorded the config as run and the versions: {out / 'build.toml'}, {out / 'versions.json'}")
    return code
