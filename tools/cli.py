"""The ``qcompiler`` command line.

One subcommand per compiler phase: ``partition`` (place, partition, dump),
``compile`` (quantize, lower, package) and ``report`` (accuracy analysis with
its HTML report).  User mistakes -- a bad
flag value, an unknown march or module name, a model that cannot be
imported -- print ``error: <message>`` to stderr and exit with status 2,
never a traceback; the message comes from qcompiler's own errors, which
already name the culprit and the allowed values.

Examples::

    qcompiler partition zoo:hybrid --march bayes --hybrid-module-name conv3 --out dump/
    qcompiler partition zoo:resnet18 --input-shape 1,3,64,64 --march bernoulli2 --out dump/
    qcompiler partition my_models.py:build --input-shape 1,3,224,224 --out dump/
    qcompiler compile zoo:resnet18 --input-shape 1,3,64,64 --calib-random 4 --out out/r18
    qcompiler report zoo:hybrid --input-shape 1,3,64,64 --target-sqnr 30 --out out/qa
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import sysconfig
import traceback
import zipfile
import zlib
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn
from tabulate import tabulate

import qcompiler
from qcompiler import zoo
from qcompiler.atomic_write import check_target
from qcompiler.batches import check_inputs, input_signature
from qcompiler.distributed import is_main_process, join_torchrun, shard
from qcompiler.errors import ConfigError, QCompilerError
from qcompiler.ir.capture import CAPTURES, DEFAULT_CAPTURE
from qcompiler.ir.dump import dump_partitioned
from qcompiler.ir.names import resolve_type
from qcompiler.ir.partitions import partitions, summary_line
from qcompiler.march import March, get_march
from qcompiler.quantization.convert import convert_fx
from qcompiler.quantization.fake_quantize import set_state
from qcompiler.quantization.prepare import prepare_calibration_fx, prepare_qat_fx
from qcompiler.tools.config_file import read_hybrid_file, read_qconfig_file
from qcompiler.tools.quant_analysis import QuantAnalysis

EXIT_OK = 0
EXIT_IO = 1
EXIT_USAGE = 2

INPUT_DTYPES = {"float32": torch.float32, "int64": torch.int64}
INT_INPUT_HIGH = 10
"""Random int64 inputs are drawn from ``[0, INT_INPUT_HIGH)`` (valid indices for most embeddings)."""
INPUT_SEED = 0
ZOO_PREFIX = "zoo:"
NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty zip (np.savez of nothing)
FACTORY_LIST_LIMIT = 20  # callables listed when a factory name is missing


class UsageError(Exception):
    """A command-line mistake found by argparse or by our own argument checks."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that raises instead of printing usage and calling ``sys.exit(2)``."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------- argument types


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``; positive integers only."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(re.fullmatch(r"\d+", p) for p in parts) or any(int(p) < 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"malformed input shape {text!r}: expected comma-separated positive integers, e.g. 1,3,224,224"
        )
    return tuple(int(p) for p in parts)


def out_dir(text: str) -> Path:
    """``--out``: a directory that exists or can be created, checked before any work, so a bad
    path is not found only when the results are written. Nothing is left behind here: a missing
    directory is probed by creating and removing its first missing component (permission bits do
    not tell, e.g. for root or in /proc)."""
    out = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path: give the output directory")
    if out.exists() and not out.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is an existing file, not a directory; give a directory path")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {str(parent)!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write to {text!r}: {str(parent)!r} is not writable")
    if not out.exists():
        first = out
        while first.parent != parent:
            first = first.parent
        try:
            first.mkdir()
            first.rmdir()
        except FileExistsError:
            pass  # made meanwhile by another process probing the same path (another rank under torchrun)
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot create {text!r}: {exc.strerror}") from None
    return out


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
    result = dump_partitioned(gm, out, name=name)

    print(summary_line(gm))
    rows = [[p.name, p.placement, len(p.nodes), _names(p.inputs), _names(p.outputs)] for p in partitions(gm)]
    print(tabulate(rows, headers=["partition", "placement", "#nodes", "inputs", "outputs"], tablefmt="simple"))
    print(f"wrote {len(result.files)} files to {out}:")
    for path in result.files:
        print(f"  {path}")
    if dump_dir is not None:
        print(f"per-pass graphs in {dump_dir}")
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return EXIT_OK


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The arguments every command that loads a model shares."""
    p.add_argument("model", metavar="MODEL",
                   help=f"zoo:NAME (NAME one of {', '.join(zoo.names())}), package.module:factory or "
                        "path/to/file.py:factory; factory() must return an nn.Module")
    p.add_argument("--input-shape", metavar="N,C,H,W", type=parse_shape, action="append",
                   help="shape of one positional input; repeat for multi-input models. Random seeded data is used. "
                        "Required unless MODEL is a zoo model (which has default inputs)")
    p.add_argument("--input-dtype", choices=sorted(INPUT_DTYPES), action="append",
                   help="dtype of the input at the same position as its --input-shape (default float32; "
                        f"int64 inputs are random in [0, {INT_INPUT_HIGH}))")
    p.add_argument("--march", default=None, metavar="MARCH",
                   help=f"target BPU generation: {', '.join(m.value for m in March)}, in any letter case "
                        f"(default: {get_march().value})")
    p.add_argument("--hybrid-module-name", metavar="NAME", action="append", default=[],
                   help="run this submodule (dotted path as in model.named_modules()) on the CPU; repeatable")
    p.add_argument("--hybrid-module-type", metavar="DOTTED.TYPE", action="append", default=[],
                   help="run every module of this class (e.g. torch.nn.PReLU) on the CPU; repeatable")
    p.add_argument("--leaf-module", metavar="NAME", action="append", default=[],
                   help="do not trace into this submodule (prepare_custom_config_dict "
                        "non_traceable_module_name); repeatable")
    p.add_argument("--capture", choices=CAPTURES, default=DEFAULT_CAPTURE,
                   help="how the model is captured: fx (symbolic tracing), export (torch.export), or auto: "
                        "symbolic tracing, then torch.export where it fails (default: %(default)s; docs/capture.md)")


def read_calib_data(path: Path, inputs: tuple) -> tuple:
    """The arrays of an .npz as tensors, checked against the example inputs like every batch
    (qcompiler.batches: float64 cast to float32, any number of samples on the batch axis)."""
    import numpy as np

    how = "write it with np.savez(path, input0, input1, ...)"
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
    except OSError as exc:
        raise UsageError(f"--calib-data {path}: cannot read it ({exc.strerror})") from None
    if not magic:
        raise UsageError(f"--calib-data {path}: cannot read it as an .npz file (empty file)")
    if magic.startswith(NPY_MAGIC):
        raise UsageError(f"--calib-data {path}: holds a single .npy array, not an .npz archive; {how}")
    if not magic.startswith(ZIP_MAGICS):  # text, a pickle...: np.load would suggest allow_pickle
        raise UsageError(f"--calib-data {path}: not an .npz archive (an .npz is a zip file of .npy arrays); {how}")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise UsageError(f"--calib-data {path}: cannot read it as an .npz file ({exc or 'empty file'}); "
                         f"{how}") from None
    with data:
        arrays = []
        for key in data.files:
            if _holds_objects(data, key):
                raise UsageError(f"--calib-data {path}: array {key!r} holds Python objects (dtype object), not "
                                 "numbers; save numeric arrays, one per model input")
            try:
                array = data[key]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # a damaged member
                raise UsageError(f"--calib-data {path}: array {key!r} is damaged ({exc or 'truncated'}); "
                                 f"{how}") from None
            try:
                arrays.append(torch.from_numpy(array))
            except (TypeError, ValueError) as exc:
                raise UsageError(f"--calib-data {path}: array {key!r} cannot be a tensor ({exc})") from None
    try:
        return check_inputs(arrays, input_signature(inputs), where=f"--calib-data {path}")
    except ConfigError as exc:
        exc.add_note("--calib-data holds one array per model input (np.savez order), samples along the first "
                     "axis; the example inputs come from --input-shape/--input-dtype (or the zoo model's default)")
        raise


def _holds_objects(data, key: str) -> bool:
    """Whether the .npz member ``key`` is an object array (pickled; np.load refuses it), read from
    its header; False if the header cannot be read (loading the array reports that)."""
    import numpy as np

    try:
        with data.zip.open(f"{key}.npy") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return read(f)[2].hasobject
    except (KeyError, OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error):
        return False


def check_calibration_args(args: argparse.Namespace) -> None:
    """UsageError for a --calib-batch-size or --calib-random below 1, whatever the data source:
    called before any work (a bad value must not wait for the model to load)."""
    for option, value in (("--calib-batch-size", getattr(args, "calib_batch_size", None)),
                          ("--calib-random", args.calib_random)):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be at least 1, got {value}")


def calibration_batches(args: argparse.Namespace, inputs: tuple) -> list[tuple]:
    """Calibration batches from --calib-data (an .npz) or --calib-random N (seeded, like the inputs)."""
    check_calibration_args(args)
    if args.calib_data:
        arrays, step = read_calib_data(Path(args.calib_data), inputs), args.calib_batch_size
        return [tuple(a[i:i + step] for a in arrays) for i in range(0, arrays[0].shape[0], step)]
    count = 8 if args.calib_random is None else args.calib_random
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
    return batches


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
    batches = calibration_batches(args, inputs)
    model.eval()
    compiled = qcompiler.compile(model, inputs, march=args.march, qconfig_dict=qconfig_dict, hybrid_dict=hybrid_dict,
                                 calib_data=shard(batches), prepare_custom_config_dict=custom,
                                 weight_rounding=args.weight_rounding, int16_budget=args.int16_budget,
                                 progress=is_main_process())
    if not is_main_process():
        return EXIT_OK
    out = Path(args.out)
    files = compiled.dump(out, name=name)
    onnx_path = out / f"{name}.onnx"
    compiled.export_onnx(onnx_path)
    files += [onnx_path, Path(f"{onnx_path}.quant.json")]
    files.append(compiled.save(out / f"{name}.qc"))
    print(compiled.summary())
    ops = {}
    for part in compiled.partitions:
        ops[part["placement"]] = ops.get(part["placement"], 0) + part["ops"]
    print("ops per placement: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
    if compiled.int16 is not None:
        rec = compiled.int16
        print(f"int16: {len(rec['chosen'])} of {rec['tensors']} BPU activation tensors "
              f"({', '.join(rec['chosen']) or 'none'}); calibration-data SQNR {rec['baseline_sqnr']:.2f} -> "
              f"{rec['reached_sqnr']:.2f} dB")
    print(f"output SQNR vs float on the calibration inputs: {output_sqnr(model, compiled, batches):.2f} dB")
    print(f"wrote {len(files)} files to {out}")
    return EXIT_OK


def check_apply_target(text: str) -> Path:
    """``--apply FILE``: a file that can be written (a ConfigError for an empty path, a directory,
    a path below a file, or a folder that is not writable), checked before the analysis runs."""
    target = check_target(text, "--apply")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--apply: cannot write {text!r}: {str(parent)!r} is not writable; give another path")
    return target


def cmd_report(args: argparse.Namespace) -> int:
    """Quantization accuracy report: float vs fake-quant vs converted, per layer, with advisor and sensitivity.

    The arguments are checked before any work, --apply's target too: a directory or a path
    below a file must not be found only after the whole analysis, with --out written."""
    check_calibration_args(args)
    if args.advise < 0 or (args.apply is not None and not args.advise):
        raise UsageError("--advise K needs K >= 1 with --apply (the fixes come from the advice), K >= 0 otherwise")
    if args.apply is not None:
        check_apply_target(args.apply)
    model, inputs, name = load_model(args.model, args.input_shape or [], args.input_dtype or [])
    hybrid_dict, custom = model_configs(args, model)
    args.calib_data = None
    batches = calibration_batches(args, inputs)
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
    if args.advise:
        qa.advise(top_k=args.advise)
        if args.apply:
            qa.apply_advice(args.apply)
    qa.report()
    print(f"bad case: batch {qa.bad_case_index} ({args.metric} {qa.bad_case_metric:.6g})")
    print(f"{len(qa.compare_rows)} layers compared, {len(qa.advice)} advisor finding(s)")
    for row in ranked[:5]:
        print(f"  sensitive: {row[0]} ({row[1]}) {args.metric} {row[3]:.6g}")
    print(qa.int16_advice_text() or "int16 advice: none (give --target-sqnr DB to get it)\n", end="")
    print(qa.fix_advice_text(), end="")
    if args.apply:
        print(f"fixes written to {args.apply}: qcompiler compile {args.model} --qconfig {args.apply} "
              f"--hybrid {args.apply} ... applies them")
    if missed is not None:
        print(f"note: {missed}", file=sys.stderr)
    print(f"wrote {len(qa.written)} files to {out}:")
    for path in qa.written:
        print(f"  {path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: global options and one sub-parser per command."""
    parser = _Parser(
        prog="qcompiler",
        description="Quantization compiler for BPU + CPU targets.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {qcompiler.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser(
        "partition",
        help="place a model's ops on BPU/CPU, partition it and dump the result for review",
        description="Trace MODEL, place every op on the BPU or the CPU for --march, insert the "
        "boundary stubs, partition the graph and write a review dump (annotated code, table, "
        "JSON, DOT/SVG, summary) into --out.",
    )
    _add_model_args(p)
    p.add_argument("--dump-passes", action="store_true",
                   help="also write the annotated graph after every pass into OUT/passes")
    p.add_argument("--out", metavar="DIR", required=True, type=out_dir,
                   help="directory for the dump files (created if needed)")
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser(
        "compile",
        help="quantize (PTQ), lower and package a model; write dumps, ONNX, sidecar and artifact",
        description="Calibrate MODEL (on --calib-data or --calib-random batches), convert it to fixed "
        "point, lower BPU partitions to programs and CPU partitions to ONNX islands, and write into "
        "--out: the review dump, MODEL.onnx with MODEL.onnx.quant.json, and MODEL.qc (load it with "
        "qcompiler.load).",
    )
    _add_model_args(p)
    calib = p.add_mutually_exclusive_group()
    calib.add_argument("--calib-data", metavar="FILE.npz",
                       help="calibration inputs: one array per positional input (np.savez order), "
                            "samples along the first axis")
    calib.add_argument("--calib-random", metavar="N", type=int, default=None,
                       help="calibrate on N seeded random batches shaped like the example inputs (default 8)")
    p.add_argument("--calib-batch-size", metavar="B", type=int, default=8,
                   help="samples per calibration batch for --calib-data (default 8)")
    p.add_argument("--weight-rounding", action="store_true",
                   help="after calibrating, re-round the BPU weights to minimize each layer's output error "
                        "on the calibration data (GPTQ-style; one pass over the data per layer)")
    p.add_argument("--qconfig", metavar="FILE.json", default=None,
                   help="qconfig file: {\"global\": {\"dtype\", \"observer\"}, \"module_name\": {path: {...}}} or a "
                        "file with a \"qconfig\" section (what 'qcompiler report --apply' writes)")
    p.add_argument("--hybrid", metavar="FILE.json", default=None,
                   help="hybrid file: {\"module_name\": [...], \"module_type\": [...]} (or a \"hybrid\" section), "
                        "run on the CPU in addition to --hybrid-module-*")
    p.add_argument("--int16-budget", metavar="FRACTION", type=float, default=None,
                   help="move at most this fraction of the BPU activation tensors to int16, those that gain most "
                        "output SQNR on the calibration data (bayes only; e.g. 0.1)")
    p.add_argument("--out", metavar="DIR", required=True, type=out_dir, help="output directory (created if needed)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser(
        "report",
        help="accuracy report: float vs quantized per layer, advisor, sensitivity, HTML",
        description="Calibrate MODEL on --calib-random seeded random batches, convert it, pick the worst "
        "batch as the bad case and write into --out: compare_per_layer_out.txt/.csv, "
        "abnormal_layer_advisor.txt, sensitive_ops.txt, badcase.pt and report.html (charts of the per-layer "
        "error and the sensitivity, int16 advice with --target-sqnr, the partitioned graph).",
    )
    _add_model_args(p)
    p.add_argument("--calib-random", metavar="N", type=int, default=4,
                   help="calibrate (and search the bad case) on N seeded random batches (default 4)")
    p.add_argument("--metric", choices=["L1", "COSINE", "ATOL", "SQNR"], default="L1",
                   help="metric for the bad case search and the sensitivity ranking (default L1)")
    p.add_argument("--target-sqnr", metavar="DB", type=float, default=None,
                   help="also advise which quantizers to move to int16 (most sensitive first) for this output "
                        "SQNR in dB, with the predicted gain (QuantAnalysis.suggest_int16); shown in the output "
                        "and in report.html")
    p.add_argument("--advise", metavar="K", type=int, default=3,
                   help="for the K worst layers, measure each fix (int16, CPU via hybrid_dict, a clipping observer) "
                        "on the bad case and print its gain (default 3; 0: skip)")
    p.add_argument("--apply", metavar="FILE.json", default=None,
                   help="write the best fix of each advised layer as a config file for "
                        "'qcompiler compile --qconfig FILE --hybrid FILE'")
    p.add_argument("--out", metavar="DIR", required=True, type=out_dir, help="output directory (created if needed)")
    p.set_defaults(func=cmd_report)
    return parser


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _os_error_message(exc: OSError, out: Optional[Path]) -> str:
    """``exc`` as one line; a failure to write into ``--out`` says so."""
    failed = exc.filename
    if out is not None and failed is not None:
        where, target = Path(os.path.abspath(failed)), Path(os.path.abspath(out))
        if where == target or target in where.parents:
            if where.name.startswith(".") and where.name.endswith(".tmp"):  # a writer's temporary file
                where = where.parent
            return f"--out {out}: cannot write {where}: {exc.strerror}"
    return str(exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``qcompiler`` console script; returns the exit status."""
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            raise UsageError("a command is required: partition, compile or report (see 'qcompiler --help')")
        return args.func(args)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except QCompilerError as exc:
        _error(str(exc))
        for note in getattr(exc, "__notes__", ()):
            print(f"  {note}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # stdout closed early, e.g. `qcompiler partition ... | head`
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_IO
    except OSError as exc:  # e.g. --out not writable, or a full disk
        _error(_os_error_message(exc, getattr(args, "out", None)))
        return EXIT_IO


if __name__ == "__main__":
    sys.exit(main())
