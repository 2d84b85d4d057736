"""nash (J6-class, transformer era): op support as data. Source: ../shared/MARCH_OPS.md, nash column.

Everything bayes runs, on tensors of up to 5 dims, int8 or int16 on every op, plus the
normalizations, tables, reductions and data movement a transformer block needs. Where the
reference table is silent the choice is ours and docs/marches.md says why.
"""

from qcompiler.backends.bpu import constraints as c
from qcompiler.backends.bpu.support import OpRule, OpTable, rules
from qcompiler.march import March

# spatial ops keep bayes's 4-D (NCHW) form; everything else runs on 1..5-D tensors
_NCHW = c.rank_between(1, 4)


def _row(op: str, *constraints) -> OpRule:
    """A nash row: int8 or int16 on every op."""
    return OpRule(op, tuple(constraints), int16=True)


TABLE = OpTable(
    march=March.NASH,
    general=(c.rank_between(1, 5), c.max_dims(65536), c.max_batch(4096), c.feature_map_operands(1)),
    rules=rules(
        # --- what bayes runs -----------------------------------------------------------------
        _row("conv2d", _NCHW, c.module_form(), c.kernel_range(1, 31), c.max_kernel_volume(65535),
             c.max_channels(8192), c.max_stride(256), c.max_dilation(16), c.zero_padding()),
        _row("conv_transpose2d", _NCHW, c.module_form(), c.kernel_range(1, 14), c.max_stride(14),
             c.stride_not_all_one(), c.max_channels(2048)),
        _row("linear", c.module_form()),
        _row("matmul", c.feature_map_operands(2)),
        _row("relu"),
        _row("relu6"),
        _row("leaky_relu"),
        _row("prelu", c.constant_weight()),
        _row("add", c.max_constant_operands(1)),
        _row("sub", c.max_constant_operands(1)),
        _row("mul", c.max_constant_operands(1)),
        _row("div", c.feature_map_operands(2), c.true_division()),
        _row("cat", c.not_along_batch()),
        _row("max_pool2d", _NCHW, c.pool_limits(kernel=256, stride=256, pad=256), c.pool_semantics()),
        _row("avg_pool2d", _NCHW, c.pool_limits(kernel=256, stride=256, pad=256), c.pool_semantics()),
        _row("adaptive_avg_pool2d", _NCHW, c.global_pool()),
        _row("interpolate", _NCHW, c.resize_hw(nearest_pow2=True)),
        _row("batch_norm", _NCHW, c.batch_norm_affine()),
        _row("reshape"),
        _row("flatten"),
        _row("transpose"),
        _row("permute"),

        # --- element-wise functions by lookup table ------------------------------------------
        _row("sigmoid"),
        _row("tanh"),
        _row("exp"),
        _row("silu"),
        _row("hardsigmoid"),
        _row("hardswish"),
        _row("gelu"),
        _row("elu"),
        _row("selu"),
        # (slot: the tables of the nash element-wise functions)


        # --- reductions ----------------------------------------------------------------------
        _row("mean", c.global_pool()),
        # (slot: reductions over any dims)


        # --- layer_norm ----------------------------------------------------------------------
        # (slot: layer_norm)


        # --- softmax -------------------------------------------------------------------------
        # (slot: softmax, log_softmax)


        # --- data movement and selection ------------------------------------------------------
        # (slot: slice, gather with constant indices, where with a constant mask)


    ),
)
