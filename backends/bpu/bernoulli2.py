"""bernoulli2 (RDK X3): op support as data. Source: ../shared/MARCH_OPS.md."""

from qcompiler.backends.bpu import constraints as c
from qcompiler.backends.bpu.support import OpRule, OpTable, rules
from qcompiler.march import March

_LUT = (c.max_lut_volume(8192),)

TABLE = OpTable(
    march=March.BERNOULLI2,
    # every BPU tensor is NCHW; a 2-D (N, C) tensor is read as (N, C, 1, 1)
    general=(c.ranks((2, 4), "bernoulli2 runs 4-D (NCHW) tensors only"), c.max_batch(128),
             c.feature_map_operands(1)),
    rules=rules(
        OpRule("conv2d", (c.module_form(), c.kernel_range(1, 7), c.max_channels(2048), c.dilation_pow2(), c.max_kernel_volume(32768), c.zero_padding())),
        OpRule("conv_transpose2d", (c.module_form(), c.kernel_range(2, 14), c.stride_in((2, 4)), c.max_channels(2048), c.dilation_one())),
        OpRule("linear", (c.module_form(),)),
        OpRule("relu"),
        OpRule("relu6"),
        OpRule("leaky_relu"),
        OpRule("prelu", (c.constant_weight(),)),
        OpRule("add", (c.max_feature_channels(2048), c.nchw_or_nc11_broadcast())),
        OpRule("mul", (c.max_feature_channels(2048), c.nchw_or_nc11_broadcast())),
        OpRule("div", (c.feature_map_operands(2), c.true_division())),
        OpRule("cat", (c.max_feature_channels(2048),)),
        OpRule("max_pool2d", (c.pool_limits(kernel=64, stride=185), c.pool_semantics())),
        OpRule("avg_pool2d", (c.pool_limits(kernel=7), c.pool_semantics())),
        OpRule("adaptive_avg_pool2d", (c.global_pool(max_hw=8192),)),
        OpRule("mean", (c.global_pool(max_hw=8192),)),
        OpRule("interpolate", (c.resize_hw(nearest_pow2=True),)),
        OpRule("sigmoid", _LUT),
        OpRule("tanh", _LUT),
        OpRule("exp", _LUT),
        OpRule("silu", _LUT),
        OpRule("batch_norm", (c.batch_norm_affine(),)),
        # layout ops carry no arithmetic: they run on the BPU only when they fold away
        OpRule("reshape", (c.static_arguments(), c.folds_away())),
        OpRule("flatten", (c.static_arguments(), c.folds_away())),
    ),
)
