"""qcompiler's own nn modules (fused layers made by the fuse pass)."""

from qcompiler.nn.fused import (
    FusedConv2d,
    FusedConvTranspose2d,
    FusedLinear,
    FusedModule,
    build_fused,
    fold_bn,
)

__all__ = [
    "FusedModule",
    "FusedConv2d",
    "FusedConvTranspose2d",
    "FusedLinear",
    "fold_bn",
    "build_fused",
]
