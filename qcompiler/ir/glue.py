"""The statements of a ``forward`` that cannot be traced, run as eager-torch islands; the rest traced.

When tracing fails in a module's own ``forward`` (``if x.sum() > 0``, a loop over a list of
images), making the whole module a leaf would put every submodule it calls in eager torch too,
unquantized. Instead the failing top-level statement of that ``forward`` is cut out: it becomes a
function of the local variables it reads, returning the ones it writes that later statements read,
called through a :class:`GlueIsland` submodule (a leaf: fx records one ``call_module`` node). The
``forward`` is rewritten from its source with that call in the statement's place and set on the
module instance, and tracing starts again. Statements before and after it, and the submodules they
call, are traced into the one graph (placement, partition and convert see their ops); only the glue
runs in Python, on the CPU. A statement that contains a ``return`` takes the rest of the body with
it (a graph cannot branch on where the forward returned): the island then returns the forward's
result. Each retry cuts one more statement, so a ``forward`` with several untraceable statements
gets several islands.

The rewritten code keeps the user's file name and line numbers (a later failure names the user's
line). Not rewritable (the caller falls back to a leaf / the whole model): a forward without
source, a decorated one (the decorator's code would be lost), one using ``global`` / ``nonlocal`` /
``yield``, and a cut that would take the whole body (that is the module as a leaf).
"""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from qcompiler.compat.torch_private import pytree

GLUE_PREFIX = "_qc_glue_"
# gm.meta while capturing: [(GlueIsland, constants)] the trace found, bound once the model's state is put back
GLUE_CONSTANTS = "qc_glue_constants"
_RESULT = "_qc_glue_result"
_LOCALS = "_qc_glue_locals"


class GlueIsland(nn.Module):
    """A cut-out piece of ``owner``'s forward, called with the locals it reads. A leaf (``qc_leaf``):
    it runs as eager torch on the CPU. ``owner`` is held outside the module tree (it is this module's
    parent; a registered child would make a cycle)."""

    qc_leaf = True

    def __init__(self, fn: types.FunctionType, owner: nn.Module, lines: tuple[int, int], reads: tuple[str, ...],
                 writes: Optional[tuple[str, ...]]) -> None:
        super().__init__()
        self.fn = fn
        self.lines = lines  # first and last source line of the statements it runs
        self.reads = reads
        self.writes = writes  # None: it runs to the end of forward and returns forward's result
        self.name = ""  # its attribute name on the owner
        self.later_reads: set[str] = set()  # locals the forward reads after the island
        self.fresh: set[str] = set()  # reads bound as containers the traced code made (Fresh)
        # reads no graph node can hold (a function the forward defined): position -> the traced value
        self.bound: dict[int, Any] = {}
        object.__setattr__(self, "_owner", owner)

    def forward(self, *args: Any) -> Any:
        if len(args) == len(self.reads):  # called by the rewritten forward run eagerly: every read given
            return self.fn(self._owner, *args)
        full, rest = [], iter(args)
        for i in range(len(args) + len(self.bound)):
            value = self.bound[i] if i in self.bound else next(rest)
            full.append(copy.deepcopy(value.value) if isinstance(value, Fresh) else value)
        return self.fn(self._owner, *full)

    def split_constants(self, args: tuple, representable: Any) -> tuple[tuple, Optional[dict[int, Any]]]:
        """While tracing: the arguments fx can record (``representable`` does not fail), and the others
        by position, which become constants of the island (``bound``), as fx bakes in any Python value
        that is no Proxy. None for the constants where the call has fewer arguments than the island
        reads: a graph traced again, its constants bound already. The caller sets ``bound`` after the
        trace: what tracing sets on the model's modules is put back (qcompiler.ir.state)."""
        if len(args) != len(self.reads):
            return args, None
        bound, kept = {}, []
        for i, arg in enumerate(args):
            if isinstance(arg, (list, dict, set)) and not _holds_proxy(arg):
                bound[i] = Fresh(arg)  # a container the forward made (``sizes = []``) that the glue fills
                continue
            try:
                representable(arg)
            except Exception:  # fx raises NotImplementedError, or TypeError for some types
                bound[i] = arg
                continue
            kept.append(arg)
        return tuple(kept), bound

    def extra_repr(self) -> str:
        return f"lines {self.lines[0]}-{self.lines[1]} of {self.fn.__code__.co_filename}"


@dataclass(frozen=True)
class Fresh:
    """A mutable container the traced code made before the island: each call gets a copy of it as
    traced, as eager torch makes it anew on each call (fx would pass one frozen list to every call)."""

    value: Any


def _holds_proxy(value: Any) -> bool:
    import torch.fx as fx

    return any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves(value))


@dataclass
class ForwardCuts:
    """A module's original forward (parsed) and the statements cut out of it so far."""

    function: types.FunctionType
    tree: ast.FunctionDef
    cuts: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) indices into the body
    code: Optional[types.CodeType] = None  # of the current rewritten forward

    @classmethod
    def parse(cls, module: nn.Module) -> Optional["ForwardCuts"]:
        fn = getattr(type(module).forward, "__func__", type(module).forward)
        if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__"):
            return None
        try:
            source = textwrap.dedent(inspect.getsource(fn))
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError):
            return None
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
            return None
        ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
        func = tree.body[0]
        if any(isinstance(n, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await))
               for n in _own_nodes(func.body)) or not func.args.args:
            return None
        return cls(fn, func, code=fn.__code__)

    def statement_at(self, line: int) -> Optional[int]:
        """The index of the top-level body statement spanning ``line`` (not already cut)."""
        for i, stmt in enumerate(self.tree.body):
            if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
                return None if any(a <= i < b for a, b in self.cuts) else i
        return None

    def cut(self, module: nn.Module, index: int, name_of: Any) -> Optional[GlueIsland]:
        """Cut statement ``index`` (and the rest of the body if it returns) into a GlueIsland set on
        ``module`` under ``name_of(n)``, and set the rewritten forward on the instance; None if the cut
        would take the whole body."""
        body = self.tree.body
        stop = len(body) if any(isinstance(n, ast.Return) for n in _own_nodes([body[index]])) else index + 1
        start = index
        first_real = 1 if _is_docstring(body[0]) else 0
        if start <= first_real and stop == len(body):
            return None
        island = self._island(module, start, stop)
        island.name = name_of(len(self.cuts))
        setattr(module, island.name, island)
        self.cuts.append((start, stop))
        island_names = {cut: name_of(i) for i, cut in enumerate(self.cuts)}  # in the order they were cut
        self._rewrite(module, island_names)
        return island

    def _namespace(self) -> dict[str, Any]:
        fn = self.function
        ns = dict(fn.__globals__)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                ns[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        return ns

    def _compile(self, func: ast.FunctionDef, defaults: bool = False) -> types.FunctionType:
        module = ast.Module(body=[func], type_ignores=[])
        ast.fix_missing_locations(module)
        ns = self._namespace()
        exec(compile(module, self.function.__code__.co_filename, "exec"), ns)  # noqa: S102 - the user's own code
        made = ns[func.name]
        if defaults:  # the rewritten forward takes the original's defaults; a glue function has none
            made.__defaults__ = self.function.__defaults__
            made.__kwdefaults__ = self.function.__kwdefaults__
        return made

    def _island(self, module: nn.Module, start: int, stop: int,
                writes: Optional[tuple[str, ...]] = None) -> GlueIsland:
        body = self.tree.body
        self_name = self.tree.args.args[0].arg
        available = _parameters(self.tree.args) | {n for stmt in body[:start] for n in _stored([stmt])}
        stmts = body[start:stop]
        reads = tuple(sorted((_loaded(stmts) & available) - {self_name}))
        if writes is None:
            writes = None if stop == len(body) else tuple(sorted(_stored(stmts) & _loaded(body[stop:])))
        glue_body = [_SuperFix(self_name).visit(s) for s in _copy(stmts)]
        if writes is not None:
            # a name the statements did not bind (a branch not taken) is None, as no value
            ret = ast.parse(f"{_RESULT} = locals()\nreturn tuple({_RESULT}.get(n) for n in {writes!r})").body
            for s in ret:
                for n in ast.walk(s):
                    ast.copy_location(n, stmts[-1])
            glue_body.extend(ret)
        args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=a) for a in (self_name,) + reads],
                             kwonlyargs=[], kw_defaults=[], defaults=[])
        func = _function(f"{self.tree.name}_glue", args, glue_body)
        ast.copy_location(func, stmts[0])
        lines = (stmts[0].lineno, stmts[-1].end_lineno or stmts[-1].lineno)
        island = GlueIsland(self._compile(func), module, lines, reads, writes)
        island.later_reads = _loaded(body[stop:])
        return island

    def also_return(self, module: nn.Module, island: "GlueIsland", names: set[str],
                    island_names: dict[tuple[int, int], str]) -> None:
        """Make ``island`` return ``names`` too (containers it fills that later code reads), and
        rewrite the forward: the glue function is compiled again with the longer return."""
        start, stop = next(cut for cut, name in island_names.items() if name == island.name)
        writes = tuple(sorted(set(island.writes or ()) | names))
        island.fn, island.writes = self._island(module, start, stop, writes).fn, writes
        self._rewrite(module, island_names)

    def island_names(self, name_of: Any) -> dict[tuple[int, int], str]:
        return {cut: name_of(i) for i, cut in enumerate(self.cuts)}

    def _rewrite(self, module: nn.Module, island_names: dict[tuple[int, int], str]) -> None:
        body, self_name = self.tree.body, self.tree.args.args[0].arg
        new_body: list[ast.stmt] = []
        i = 0
        while i < len(body):
            cut = next(((a, b) for a, b in self.cuts if a == i), None)
            if cut is None:
                new_body.append(_SuperFix(self_name).visit(_copy([body[i]])[0]))
                i += 1
                continue
            island = getattr(module, island_names[cut])
            # a local bound only on some paths (``if targets is not None: boxes = ...``) may be unbound
            # here: it is read from locals() (None if unbound; the glue's own code binds it first)
            params = _parameters(self.tree.args)
            reads = [r if r in params else f"{_LOCALS}.get({r!r})" for r in island.reads]
            call = f"{self_name}.{island_names[cut]}({', '.join(reads)})"
            lines = [f"{_LOCALS} = locals()"] if len(params) < len(set(island.reads) | params) else []
            if island.writes is None:
                lines.append(f"return {call}")
            else:
                lines += [f"{_RESULT} = {call}"] + [f"{w} = {_RESULT}[{k}]" for k, w in enumerate(island.writes)]
            stmts = ast.parse("\n".join(lines)).body
            for s in stmts:
                for n in ast.walk(s):
                    ast.copy_location(n, body[i])
            new_body.extend(stmts)
            i = cut[1]
        func = _function(self.tree.name, self.tree.args, new_body)
        ast.copy_location(func, self.tree)
        made = self._compile(func, defaults=True)
        self.code = made.__code__
        module.forward = types.MethodType(made, module)


def _function(name: str, args: ast.arguments, body: list[ast.stmt]) -> ast.FunctionDef:
    extra = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}  # Python >= 3.12
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None, **extra)


def _copy(stmts: list[ast.stmt]) -> list[ast.stmt]:
    return [copy.deepcopy(s) for s in stmts]


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)


def _own_nodes(stmts: list[ast.AST]):
    """Every node of ``stmts`` outside nested scopes (functions, lambdas, classes, comprehensions)."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, _SCOPES):
                todo.append(child)
            elif isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                todo.extend(g.iter for g in child.generators)  # evaluated in the enclosing scope
            else:
                yield child  # a def / class / lambda: its name is bound here, its body is its own


def _stored(stmts: list[ast.AST]) -> set[str]:
    """Names ``stmts`` bind in their own scope: assignments, ``def`` / ``class``, imports."""
    names = set()
    for n in _own_nodes(stmts):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.ExceptHandler,)) and n.name:
            names.add(n.name)
    return names


def _loaded(stmts: list[ast.AST]) -> set[str]:
    """Names read anywhere in ``stmts``, nested scopes included (a comprehension reads the locals)."""
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _parameters(args: ast.arguments) -> set[str]:
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    return names


class _SuperFix(ast.NodeTransformer):
    """``super()`` needs the ``__class__`` cell of a function defined in a class body: code compiled on
    its own has none, so it becomes ``super(__class__, self)`` with ``__class__`` from the closure."""

    def __init__(self, self_name: str) -> None:
        self.self_name = self_name

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args and not node.keywords:
            node.args = [ast.Name(id="__class__", ctx=ast.Load()), ast.Name(id=self.self_name, ctx=ast.Load())]
        return node


__all__ = ["GlueIsland", "ForwardCuts", "Fresh", "GLUE_PREFIX", "GLUE_CONSTANTS"]
