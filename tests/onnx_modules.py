"""Small modules and helpers the ONNX emitter tests share: a functional op as a module, a torch.nn
layer kept a leaf inside a traced root, flattening nested outputs, the op types of a model."""

from __future__ import annotations

import onnx
import torch
import torch.nn as nn


class Wrap(nn.Module):
    """Keeps a torch.nn layer a leaf inside a traced root."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)


class Fn(nn.Module):
    """A module whose forward is ``fn`` of its input (functional ops trace as call_function/call_method)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Fn2(Fn):
    def forward(self, x, y):
        return self.fn(x, y)


def flat(x) -> list:
    """The tensors of a (nested) output, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in flat(v)]


def op_types(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def op_list(model: onnx.ModelProto) -> list[str]:
    """The op types of a model in node order (repeats kept)."""
    return [n.op_type for n in model.graph.node]
