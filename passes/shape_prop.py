"""Shape propagation as a pass: record shapes/dtypes from ``ctx.example_inputs``."""

from __future__ import annotations

import torch.fx as fx

from qcompiler.errors import PassError
from qcompiler.ir.meta import META_TENSOR
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.passes.base import CompileContext, Pass, PassResult


def shape_prop(gm: fx.GraphModule, ctx: CompileContext) -> PassResult:
    propagate_shapes(gm, ctx.example_inputs)
    return PassResult(gm, False)  # annotations only; the graph is unchanged


def verify_shapes(gm: fx.GraphModule, ctx: CompileContext) -> None:
    for node in gm.graph.nodes:
        if META_TENSOR not in node.meta:
            raise PassError(f"node {node.name} has no shape")


SHAPE_PROP = Pass("shape_prop", shape_prop, verify_shapes)
