"""Pass infrastructure: a pass is ``(gm, ctx) -> PassResult``; ``PassManager`` runs a named list.

The manager adds what every pass would otherwise repeat: timing, checking the
facts a pass requires (tensor metadata, placement ...: :class:`Fact`) before it
runs, wrapping a failure with the pass name and the passes that ran before it,
linting and verifying the graph after each pass (and re-verifying a
``lasting`` pass's invariant after every later one), and dumping the graph
after each pass into a folder (``NN_<pass>.txt``) for review.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch.fx as fx
import torch.nn as nn

from qcompiler.atomic_write import check_directory, make_directory, write_file
from qcompiler.errors import ConfigError, PassError, QCompilerError
from qcompiler.ir.printing import annotated_code
from qcompiler.march import March
from qcompiler.quantization.observer import MinMaxObserver
from qcompiler.quantization.qconfig import QConfigResolver


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) GraphModule and whether it changed anything."""

    gm: fx.GraphModule
    modified: bool


@dataclass(frozen=True)
class CompileOptions:
    """The options passes read beyond the march and the user's configs (prepare sets them)."""

    # which qconfig each node gets (insert_observers) and which ops a qconfig of None keeps float (place)
    qconfig_resolver: Optional[QConfigResolver] = None
    # every BPU cat shares one quantizer among its inputs and output (insert_observers)
    optimize_graph: bool = False
    # the zero-argument factory of the observers insert_stubs puts on float values entering the BPU
    activation_observer: Callable[[], nn.Module] = MinMaxObserver

    @classmethod
    def by_name(cls, options: Mapping[str, Any]) -> CompileOptions:
        """The record of ``options`` given by name; a ConfigError names an unknown one."""
        known = [f.name for f in fields(cls)]
        unknown = [name for name in options if name not in known]
        if unknown:
            raise ConfigError(f"unknown compile option {unknown[0]!r}; the options are: {', '.join(known)}")
        return cls(**options)


@dataclass
class CompileContext:
    """What passes may read: target, user configs, example inputs. Passes never mutate it."""

    march: March
    example_inputs: tuple = ()
    hybrid_dict: Any = None  # qcompiler.hybrid.HybridConfig or None
    qconfig_dict: Optional[dict] = None
    prepare_custom_config_dict: Optional[dict] = None
    options: CompileOptions = field(default_factory=CompileOptions)


PassFn = Callable[[fx.GraphModule, CompileContext], PassResult]
Verifier = Callable[[fx.GraphModule, CompileContext], None]


@dataclass(frozen=True)
class Pass:
    """A named pass with an optional verifier of the invariants it establishes.  With ``lasting``, the
    invariant must survive every later pass too (a later pass may not undo it), and the manager checks
    it after each of them.  ``requires``: the facts the pass reads, which the manager checks first."""

    name: str
    run: PassFn
    verify: Optional[Verifier] = None
    lasting: bool = False
    requires: tuple[Fact, ...] = ()

    def __call__(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        return self.run(gm, ctx)


@dataclass(frozen=True)
class Fact:
    """What a pass establishes on the graph for later passes (tensor metadata, placement, ...).

    ``missing(gm)`` says why the graph lacks it, naming the node at fault, or returns None: it is
    checked on the graph itself, so a graph prepared earlier (calibration, then QAT) has it too."""

    name: str
    provider: Pass
    missing: Callable[[fx.GraphModule], Optional[str]]


@dataclass
class PassRecord:
    name: str
    modified: bool
    seconds: float


class PassManager:
    """Run passes in order; lint/verify and dump after each one if asked."""

    def __init__(
        self,
        passes: Sequence[Union[Pass, PassFn]],
        *,
        verify: bool = True,
        dump_dir: Optional[Union[str, Path]] = None,
    ) -> None:
        self.passes = [p if isinstance(p, Pass) else Pass(getattr(p, "__name__", "pass"), p) for p in passes]
        self.verify = verify
        # checked before any pass runs: a path below a file is a ConfigError naming it, not a raw
        # NotADirectoryError after the first pass
        self.dump_dir = check_directory(dump_dir, "dump_dir") if dump_dir is not None else None
        self.records: list[PassRecord] = []

    def run(self, gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
        modified_any = False
        done: list[str] = []
        lasting: list[Verifier] = []  # verifiers of earlier passes whose invariants must still hold
        if self.dump_dir is not None:
            make_directory(self.dump_dir, "dump_dir")
        for index, p in enumerate(self.passes):
            start = time.perf_counter()
            try:
                _check_requires(p, gm)
                result = p(gm, ctx)
                if not isinstance(result, PassResult):
                    raise TypeError(f"returned {type(result).__name__}, expected PassResult")
            except QCompilerError as exc:
                # A user-facing error keeps its type (callers catch ConfigError etc.); we add where.
                exc.pass_name, exc.passes_before = p.name, tuple(done)
                exc.add_note(_where(p.name, done))
                raise
            except Exception as exc:
                raise _failed(p.name, done, exc) from exc
            if self.verify:
                try:
                    result.gm.graph.lint()
                    for verify in (*lasting, *([p.verify] if p.verify is not None else [])):
                        verify(result.gm, ctx)
                except Exception as exc:  # a broken invariant (a verifier's PassError too) is this pass's failure
                    raise _failed(p.name, done, exc) from exc
            self.records.append(PassRecord(p.name, result.modified, time.perf_counter() - start))
            gm = result.gm
            modified_any |= result.modified
            done.append(p.name)
            if p.lasting and p.verify is not None:
                lasting.append(p.verify)
            if self.dump_dir is not None:
                write_file(self.dump_dir / f"{index:02d}_{p.name}.txt", annotated_code(gm).encode(), "dump_dir")
        return PassResult(gm, modified_any)


class Decline(Exception):
    """Why a rewriting pass leaves a node as it is (recorded on the node, not raised to the user)."""


def rewrite_each(gm: fx.GraphModule, selected: Callable[[fx.Node], bool],
                 rewrite: Callable[[fx.Node], None], declined: str, note_key: str) -> PassResult:
    """``rewrite(node)`` for every node ``selected`` picks; a :class:`Decline` leaves the node with
    ``"{declined}: {why}"`` under ``note_key`` in its meta (the placement shows it). Lints and
    recompiles once when anything changed."""
    modified = False
    for node in list(gm.graph.nodes):
        if not selected(node):
            continue
        try:
            rewrite(node)
            modified = True
        except Decline as why:
            node.meta[note_key] = f"{declined}: {why}"
    if modified:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def _check_requires(p: Pass, gm: fx.GraphModule) -> None:
    for fact in p.requires:
        why = fact.missing(gm)
        if why is not None:
            raise PassError(f"pass '{p.name}' requires {fact.name}, which pass '{fact.provider.name}' provides, "
                            f"and {why}: run '{fact.provider.name}' before '{p.name}'")


def _failed(name: str, done: list[str], exc: Exception) -> PassError:
    return PassError(f"pass '{name}' failed: {type(exc).__name__}: {exc}. {_where(name, done)}")


def _where(name: str, done: list[str]) -> str:
    before = ", ".join(done) if done else "none"
    return f"(in pass '{name}'; passes run before it: {before})"
