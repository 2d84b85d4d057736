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
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import qcompiler
from qcompiler.atomic_write import check_target
from qcompiler.errors import ConfigError, QCompilerError
from qcompiler.march import March, get_march
from qcompiler.tools.build_config import read_build_config, report_args, to_build_config

# Nothing above imports torch: the parser and every argument check below run without it, so
# ``--help`` and a mistyped flag answer at once (issue 35); a command imports the compiler
# (tools/cli_commands.py) only once its arguments are known good.

EXIT_OK = 0
EXIT_IO = 1
EXIT_USAGE = 2

INPUT_DTYPE_NAMES = ("float32", "int64")
INT_INPUT_HIGH = 10
"""Random int64 inputs are drawn from ``[0, INT_INPUT_HIGH)`` (valid indices for most embeddings)."""
# The zoo's model names and the capture modes, spelled here so the help needs no torch;
# tests/test_cli_startup.py checks them against qcompiler.zoo.names() and qcompiler.ir.capture.
ZOO_NAMES = ("hybrid", "lstm_seq", "mobilenet_v2", "resnet18", "resnet50", "transformer_block", "unet")
CAPTURES = ("fx", "export", "auto")
DEFAULT_CAPTURE = "auto"
CHANNEL_ORDERS = ("rgb", "bgr", "gray")
LAYOUTS = ("nchw", "nhwc")
IMAGE_FLAGS = ("resize", "crop", "mean", "std", "pixel_max", "channel_order", "layout")


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


def parse_size(text: str) -> tuple[int, ...]:
    """``--resize`` / ``--crop``: ``"224"`` -> ``(224,)``, ``"224,320"`` (height,width) -> ``(224, 320)``."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (1, 2) or not all(re.fullmatch(r"\d+", p) and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"malformed size {text!r}: expected N or HEIGHT,WIDTH (positive integers)")
    return tuple(int(p) for p in parts)


def parse_floats(text: str) -> tuple[float, ...]:
    """``--mean`` / ``--std``: ``"0.485,0.456,0.406"`` -> a tuple of floats (one, or one per channel)."""
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"malformed values {text!r}: expected comma-separated numbers, "
                                         "e.g. 0.485,0.456,0.406") from None
    if not all(v == v and abs(v) != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"malformed values {text!r}: give finite numbers")
    return values


def check_calibration_args(args: argparse.Namespace) -> None:
    """UsageError for a calibration flag that cannot work, whatever the data source: a count below 1,
    a data path that does not exist, image preprocessing without --calib-images, mean/std that do not fit the channels. Called before
    any work (and before torch is imported: a bad value must not wait for the model to load)."""
    for option, value in (("--calib-batch-size", getattr(args, "calib_batch_size", None)),
                          ("--calib-random", args.calib_random),
                          ("--calib-limit", getattr(args, "calib_limit", None))):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be at least 1, got {value}")
    images = getattr(args, "calib_images", None)
    for option, path in (("--calib-data", args.calib_data), ("--calib-images", images)):
        if path and not Path(path).exists():
            raise UsageError(f"{option} {path}: does not exist")
    if not images:
        given = [f"--{k.replace('_', '-')}" for k in IMAGE_FLAGS if getattr(args, k, None) is not None]
        if given:
            raise UsageError(f"{given[0]} is image preprocessing: it applies to --calib-images DIR only")
    if getattr(args, "calib_limit", None) is not None and not (images or args.calib_data):
        raise UsageError("--calib-limit applies to --calib-data or --calib-images (--calib-random N sets the count)")
    if images:
        channels = 1 if args.channel_order == "gray" else 3
        for option, values in (("--mean", args.mean), ("--std", args.std)):
            if values is not None and len(values) not in (1, channels):
                raise UsageError(f"{option} has {len(values)} values; give 1 or {channels} (one per "
                                 f"{args.channel_order or 'rgb'} channel, in that order)")
        if args.std is not None and 0.0 in args.std:
            raise UsageError("--std has a 0: a standard deviation of 0 divides by zero")


def image_preprocess_args(args: argparse.Namespace) -> dict:
    """The ``ImagePreprocess`` keyword arguments the image flags ask for (defaults where not given)."""
    size = {k: (v[0] if v and len(v) == 1 else v) for k, v in (("resize", args.resize), ("crop", args.crop))}
    return {**size, "mean": args.mean, "std": args.std, "channel_order": args.channel_order or "rgb",
            "layout": args.layout or "nchw", "pixel_max": float(args.pixel_max or 1)}


def check_report_args(args: argparse.Namespace) -> None:
    """``report``'s own argument checks, --apply's target too: a directory or a path below a file must
    not be found only after the whole analysis, with --out written."""
    if args.advise < 0 or (args.apply is not None and not args.advise):
        raise UsageError("--advise K needs K >= 1 with --apply (the fixes come from the advice), K >= 0 otherwise")
    if args.apply is not None:
        check_apply_target(args.apply)


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


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The arguments every command that loads a model shares."""
    p.add_argument("model", metavar="MODEL",
                   help=f"zoo:NAME (NAME one of {', '.join(ZOO_NAMES)}), package.module:factory or "
                        "path/to/file.py:factory; factory() must return an nn.Module")
    p.add_argument("--input-shape", metavar="N,C,H,W", type=parse_shape, action="append",
                   help="shape of one positional input; repeat for multi-input models. Random seeded data is used. "
                        "Required unless MODEL is a zoo model (which has default inputs)")
    p.add_argument("--input-dtype", choices=INPUT_DTYPE_NAMES, action="append",
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


def _add_calib_args(p: argparse.ArgumentParser, random_default: int) -> None:
    """Where the calibration (and evaluation) data comes from, shared by compile and report."""
    calib = p.add_mutually_exclusive_group()
    calib.add_argument("--calib-data", metavar="FILE",
                       help="calibration inputs from a file, told apart by content: .npz (one array per "
                            "positional input, np.savez order or keyed by the forward's parameter names), .npy "
                            "(one array: the one input), or torch.save (a tensor, a tuple/list of tensors or a "
                            "dict name->tensor; read with weights_only=True); samples along the first axis")
    calib.add_argument("--calib-images", metavar="DIR",
                       help="calibrate on the images in DIR (searched recursively, sorted by path), preprocessed "
                            "by --resize, --crop, --channel-order, --pixel-max, --mean/--std, --layout (in that "
                            "order); they make the model's one input")
    calib.add_argument("--calib-random", metavar="N", type=int, default=None,
                       help="calibrate on N seeded random batches shaped like the example inputs, uniform noise "
                            f"(default {random_default} when no data is given; every SQNR printed then says random)")
    p.add_argument("--calib-batch-size", metavar="B", type=int, default=8,
                   help="samples per calibration batch for --calib-data and --calib-images (default 8)")
    p.add_argument("--calib-limit", metavar="N", type=int, default=None,
                   help="use only the first N samples of --calib-data or --calib-images (default: all)")
    img = p.add_argument_group("image preprocessing (with --calib-images)")
    img.add_argument("--resize", metavar="N|H,W", type=parse_size, default=None,
                     help="N: scale the shorter side to N, keeping the aspect ratio; H,W: resize to exactly that "
                          "(bilinear). Default: keep the size")
    img.add_argument("--crop", metavar="N|H,W", type=parse_size, default=None,
                     help="cut N x N (or H x W) from the center after resizing. Default: no crop")
    img.add_argument("--channel-order", choices=CHANNEL_ORDERS, default=None,
                     help="rgb (default), bgr (as OpenCV reads images) or gray (one channel)")
    img.add_argument("--pixel-max", choices=("1", "255"), default=None,
                     help="1 (default): pixels are scaled from 0..255 to [0, 1]; 255: kept as read. --mean and "
                          "--std are in these units")
    img.add_argument("--mean", metavar="MEAN", type=parse_floats, default=None,
                     help="subtract this, one value or one per channel in --channel-order order "
                          "(e.g. 0.485,0.456,0.406). Default 0")
    img.add_argument("--std", metavar="STD", type=parse_floats, default=None,
                     help="then divide by this, one value or one per channel (e.g. 0.229,0.224,0.225). Default 1")
    img.add_argument("--layout", choices=LAYOUTS, default=None,
                     help="nchw (default, channels first as in PyTorch) or nhwc")


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
    p.set_defaults(func="cmd_partition")

    p = sub.add_parser(
        "compile",
        help="quantize (PTQ), lower and package a model; write dumps, ONNX, sidecar and artifact",
        description="Calibrate MODEL (on --calib-data, --calib-images or --calib-random batches), convert it to fixed "
        "point, lower BPU partitions to programs and CPU partitions to ONNX islands, and write into "
        "--out: the review dump, model.onnx with model.onnx.quant.json, and model.qc (load it with "
        "qcompiler.load).",
    )
    _add_model_args(p)
    _add_calib_args(p, random_default=8)
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
    p.add_argument("--print-config", action="store_true",
                   help="print these flags as a build config file (TOML, for 'qcompiler build') and exit")
    p.add_argument("--out", metavar="DIR", required=True, type=out_dir, help="output directory (created if needed)")
    p.set_defaults(func="cmd_compile")

    p = sub.add_parser(
        "report",
        help="accuracy report: float vs quantized per layer, advisor, sensitivity, HTML",
        description="Calibrate MODEL (on --calib-data, --calib-images or --calib-random batches), convert it, "
        "pick the worst batch as the bad case and write into --out: compare_per_layer_out.txt/.csv, "
        "abnormal_layer_advisor.txt, sensitive_ops.txt, badcase.pt and report.html (charts of the per-layer "
        "error and the sensitivity, int16 advice with --target-sqnr, the partitioned graph).",
    )
    _add_model_args(p)
    _add_calib_args(p, random_default=4)
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
    p.set_defaults(func="cmd_report")

    p = sub.add_parser(
        "build",
        help="compile from a build config file (TOML): model, inputs, march, calibration, hybrid, qconfig, out",
        description="Read CONFIG (a TOML file with the fields of the compile flags; tools/build_config.py, "
        "docs/calibration_data.md), check it (errors name the line and the key) and compile as "
        "'qcompiler compile' would; --out also gets build.toml (the config as run) and versions.json.",
    )
    p.add_argument("config", metavar="CONFIG.toml", help="the build config file; relative paths in it are "
                                                          "relative to its folder")
    p.add_argument("--print-config", action="store_true",
                   help="print the config as read (paths resolved, defaults filled in) and exit")
    p.add_argument("--report", action="store_true",
                   help="instead of compiling, write the accuracy report on the config's calibration data into "
                        "OUT/report and its advice into the config's 'fixes' file (default OUT/fixes.json); "
                        "the next 'qcompiler build CONFIG' applies that file")
    p.set_defaults(func="cmd_build")
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
            raise UsageError("a command is required: partition, compile, report or build (see 'qcompiler --help')")
        if args.command == "build":
            print_config, report = args.print_config, args.report
            args = read_build_config(args.config)
            if print_config:
                print(to_build_config(args), end="")
                return EXIT_OK
            try:
                args.out = out_dir(args.out)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"{args.config}: out: {exc}") from None
            if report:
                args = report_args(args)
        if args.command in ("compile", "build"):
            check_calibration_args(args)
            if args.print_config:
                print(to_build_config(args), end="")
                return EXIT_OK
        if args.command == "report":
            check_calibration_args(args)
        if args.command == "report":
            check_report_args(args)
        from qcompiler.tools import cli_commands  # the compiler and torch: only once the arguments are good

        return getattr(cli_commands, args.func)(args)
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
