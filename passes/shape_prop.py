"""Shape propagation as a pass: record shapes/dtypes from ``ctx.example_inputs``."""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.meta import META_TENSOR
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.passes.base import CompileContext, Fact, Pass, PassResult


def shape_prop(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    propagate_shapes(gm, ctx.example_inputs)
    return PassResult(gm, False)  # annotations only; the graph is unchanged


def _unshaped(gm: fx.GraphModule) -> Optional[str]:
    node = next((n for n in gm.graph.nodes if META_TENSOR not in n.meta), None)
    return None if node is None else f"node {node.name} has no shape"


def verify_shapes(gm: fx.GraphModule, ctx: CompileContext) -> None:
    why = _unshaped(gm)
    if why is not None:
        raise PassError(why)


SHAPE_PROP = Pass("shape_prop", shape_prop, verify_shapes)
# every node's shapes and dtypes (META_TENSOR) and storages (META_STORAGE)
TENSOR_META = Fact("tensor metadata", SHAPE_PROP, _unshaped)
