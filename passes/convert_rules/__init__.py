"""Convert rules, one module per op family: each turns an observed BPU node into its fixed-point module.

Importing this package registers every family with :mod:`.registry` (``@converts``). The rules get
one :class:`.context.ConvertContext`; the families import each other only downward: ``layout``
(with ``same_scale``, the module of every op that keeps its input's grid) <- ``activation``,
``pooling``; ``arith``, ``lut``, ``norm`` and ``weight_layers`` stand alone.
"""

from qcompiler.passes.convert_rules import (  # noqa: F401  (imported to register their rules)
    activation,
    arith,
    layout,
    lut,
    masked_softmax,
    norm,
    pooling,
    reduce,
    select,
    softmax,
    weight_layers,
)
