"""The ONNX emit rules, one module per op family; importing this package registers them all.

Each family registers its rules with :mod:`qcompiler.backends.onnx.registry` (``@emits`` /
``@emits_module`` / table rows through ``register``). The families import each other only
downward: ``common`` <- ``elementwise`` <- ``conv`` <- ``norm``; ``pool``, ``layout``,
``reduce``, ``index``, ``embedding``, ``rnn``; ``arith`` (<- ``elementwise``), ``creation`` and ``views``
(<- ``layout``), ``loss``, ``attention``; ``quantized`` (the converted modules) last.
"""

from qcompiler.backends.onnx.rules import (  # noqa: F401  (imported to register their rules)
    arith,
    attention,
    common,
    conv,
    creation,
    elementwise,
    embedding,
    index,
    layout,
    loss,
    masked_softmax,
    norm,
    pool,
    quantized,
    reduce,
    rnn,
    views,
)

# Canonical ops (qcompiler.ir.ops) no rule emits yet, and why: the emitter's error says it, and
# tests/test_onnx_registry.py checks that every canonical op is emitted or listed here.
NOT_EMITTED: dict[str, str] = {
    "einsum": "ONNX opset 11 has no Einsum; passes/einsum.py rewrites an equation into transposes, reshapes and "
              "MatMul, but not this one (its placement reason says why)",
}

FAMILIES = ("elementwise", "conv", "norm", "pool", "reduce", "layout", "index", "embedding", "rnn", "arith",
            "creation", "views", "loss", "attention", "quantized")
