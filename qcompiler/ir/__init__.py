"""The IR: torch.fx graphs with qcompiler facts in ``node.meta`` (see ``meta``)."""

from qcompiler.ir.meta import *  # noqa: F401,F403
from qcompiler.ir.shape_prop import propagate_shapes
from qcompiler.ir.tracer import QTracer, trace

__all__ = ["QTracer", "trace", "propagate_shapes"]
