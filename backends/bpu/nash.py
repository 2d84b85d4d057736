"""nash (J6-class, transformer era): op support as data. Source: ../shared/MARCH_OPS.md, nash column.

Everything bayes runs, on tensors of up to 5 dims, int8 or int16 on every op, plus the
normalizations, tables, reductions and data movement a transformer block needs. Where the
reference table is silent the choice is ours and docs/marches.md says why.
"""

from qcompiler.backends.bpu import bayes, constraints as c
from qcompiler.backends.bpu.support import DefaultDtype, OpRule, OpTable, rules
from qcompiler.march import March
from qcompiler.quantization.fixed_point import SOFTMAX_MAX_LEN

# spatial ops keep bayes's 4-D (NCHW) form; everything else runs on 1..5-D tensors
_NCHW = c.rank_between(1, 4)


def _row(op: str, *constraints) -> OpRule:
    """A nash row: int8 or int16 on every op."""
    return OpRule(op, tuple(constraints), int16=True)


def _bayes(op: str, *extra) -> OpRule:
    """bayes's row for ``op`` with its constraints (after ``extra``), int16 allowed."""
    return _row(op, *extra, *bayes.TABLE.rules[op].constraints)


TABLE = OpTable(
    march=March.NASH,
    general=(c.rank_between(1, 5), c.max_dims(65536), c.max_batch(4096), c.feature_map_operands(1)),
    rules=rules(
        # bayes's rows as they are (the spatial ones held to 4-D NCHW), int16 on every one
        *(_bayes(op) for op in ("linear", "matmul", "relu", "relu6", "leaky_relu", "div", "cat", "reshape",
                                "flatten", "transpose", "permute", "sigmoid", "tanh", "exp", "silu")),
        *(_bayes(op, _NCHW) for op in ("conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d",
                                       "adaptive_avg_pool2d", "interpolate", "batch_norm")),
        # element-wise on 1..5-D under the march-wide limits (bayes: 2..5-D, its own limits)
        _row("add", c.max_constant_operands(1)),
        _row("sub", c.max_constant_operands(1)),
        _row("mul", c.max_constant_operands(1)),
        _row("prelu", c.constant_weight()),
        # element-wise functions by lookup table (the table kernel of sigmoid)
        *(_row(op) for op in ("hardsigmoid", "hardswish", "gelu", "elu", "selu")),
        # --- layer_norm: the integer kernel of fixed_point.int_layer_norm (docs/marches.md, "LayerNorm kernel")
        _row("layer_norm", c.layer_norm_group(), c.layer_norm_constant_affine()),
        # --- end layer_norm
        # --- softmax kernel (fixed_point.int_softmax): a constant dim, an axis the int64 sum bounds
        *(_row(op, c.softmax_call(SOFTMAX_MAX_LEN)) for op in ("softmax", "log_softmax")),
        # --- reductions over any dims (mean: not only bayes's global pool); amax / amin select on the
        # input's grid, sum / mean requantize once (convert_rules.reduce, lowering.reduce)
        *(_row(op, c.reduction()) for op in ("sum", "mean", "amax", "amin")),
        # --- lookup tables for transformer blocks (issue 34): the same table kernel; the domain choices
        # (log / sqrt / rsqrt / reciprocal / pow off their domain) are in docs/marches.md
        *(_row(op) for op in ("erf", "log", "sqrt", "rsqrt", "reciprocal", "mish")),
        _row("pow", c.number_exponent()),
        # --- end lookup tables
        # --- selection with constant indices: the same codes moved (getitem, narrow, torch.export's slice;
        # lowering.select)
        _row("getitem", c.constant_index()),
        _row("narrow", c.constant_index()),
        _row("slice", c.constant_index()),
        # --- masked_softmax (fixed_point.int_masked_softmax): softmax's call limits; the mask enters as 0/1 codes
        _row("masked_softmax", c.softmax_call(SOFTMAX_MAX_LEN)),
        # --- end masked_softmax
    ),
    # --- default output types under the global int8 qconfig (issue 34, accuracy): int8 outputs of these
    # kernels cost BERT 1.8 dB and GPT-2 1.4 dB against bayes (float on the CPU); int16 outputs of all four
    # give BERT 33.5 / GPT-2 38.0 / transformer_block 36.0 dB (benchmarks/nash_accuracy.py, docs/marches.md)
    default_dtypes={
        op: DefaultDtype("qint16", "its int8 output rounding dominates the transformer's error")
        for op in ("layer_norm", "softmax", "masked_softmax", "gelu")
    },
    # --- end default output types
)
