"""Shared helpers of the model zoo: seeded construction and weight init.

Every zoo factory builds its model inside :func:`seeded` so that the weights
depend only on a fixed per-model seed and the caller's global RNG stream is
left exactly as it was.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``, restoring the old state after.

    Module constructors draw from the global generator, so forking it (rather
    than passing a local ``torch.Generator`` everywhere) is what makes the whole
    construction deterministic without side effects for the caller.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


Model = TypeVar("Model", bound=nn.Module)


def build(seed: int, make: Callable[[], Model], *inits: Callable[[nn.Module], None]) -> Model:
    """``make()`` and then each of ``inits`` on the model, all inside :func:`seeded`; in eval mode."""
    with seeded(seed):
        model = make()
        for init in inits:
            init(model)
    return model.eval()


def input_generator(seed: int) -> torch.Generator:
    """A fresh local generator for building example inputs without touching global RNG."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def normal_inputs(seed: int, *shape: int) -> tuple:
    """The positional inputs ``(x,)``: one standard-normal tensor of ``shape``, drawn from a fresh
    generator seeded ``seed``."""
    return (torch.randn(*shape, generator=input_generator(seed)),)


def kaiming_init_convs(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, relu) conv weights, zero conv biases, BN affine = (1, 0)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


@torch.no_grad()
def perturb_batchnorm(model: nn.Module, scale: float = 0.1) -> None:
    """Give every BatchNorm small random affine params and running stats.

    With the textbook init (weight 1, bias 0, mean 0, var 1) BN is almost an
    identity, so a broken BN-folding pass would go unnoticed; perturbing all
    four tensors makes folding numerically visible.  Draws from the (seeded)
    global RNG, so call it inside :func:`seeded`.
    """
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            if m.affine:
                m.weight.copy_(1.0 + scale * torch.randn(n))
                m.bias.copy_(scale * torch.randn(n))
            if m.track_running_stats:
                m.running_mean.copy_(scale * torch.randn(n))
                # Keep the variance strictly positive: 1 +/- scale.
                m.running_var.copy_(1.0 + scale * (2.0 * torch.rand(n) - 1.0))
