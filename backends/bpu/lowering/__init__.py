"""BPU lowering rules, one module per op family; importing this package registers them all.

Each family registers its rules with :mod:`qcompiler.backends.bpu.lowering.registry` (``@lowers``).
The families import each other only downward: ``common`` <- every family; ``layout`` <- ``pooling``
(max pooling is a same-scale op).
"""

from qcompiler.backends.bpu.lowering import (  # noqa: F401  (imported to register their rules)
    activations,
    elementwise,
    layout,
    lut,
    masked_softmax,
    norm,
    pooling,
    quantize,
    reduce,
    select,
    resize,
    softmax,
    weight_layers,
)

# March-table ops convert turns into a module of another op, and that op: no rule of their own is needed.
CONVERTED_AS: dict[str, tuple[str, str]] = {
    "batch_norm": ("conv2d", "convert folds a BatchNorm2d into a depthwise 1x1 conv2d weight layer"),
    "adaptive_avg_pool2d": ("global_avg_pool", "convert makes a 1x1 adaptive average pool a global average pool"),
    "mean": ("global_avg_pool", "convert makes a mean over H and W a global average pool"),
}
