"""bayes (J5 / RDK Ultra): op support as data. Source: ../shared/MARCH_OPS.md."""

from qcompiler.backends.bpu import constraints as c
from qcompiler.backends.bpu.support import OpRule, OpTable, rules
from qcompiler.march import March

TABLE = OpTable(
    march=March.BAYES,
    # 4-D unless an op says otherwise (lower ranks are padded)
    general=(c.rank_between(1, 4), c.max_dims(65536), c.max_batch(4096), c.feature_map_operands(1)),
    rules=rules(
        OpRule("conv2d", (c.module_form(), c.kernel_range(1, 31), c.max_kernel_volume(65535), c.max_channels(8192), c.max_stride(256), c.max_dilation(16), c.zero_padding())),
        OpRule("conv_transpose2d", (c.module_form(), c.kernel_range(1, 14), c.max_stride(14), c.stride_not_all_one(), c.max_channels(2048))),
        OpRule("linear", (c.module_form(),)),
        OpRule("matmul", (c.feature_map_operands(2),)),
        OpRule("relu"),
        OpRule("relu6"),
        OpRule("leaky_relu"),
        OpRule("add", (c.rank_between(2, 5), c.max_constant_operands(1), c.feature_map_operands(1)), int16=True,
               skip_general=True),
        OpRule("sub", (c.rank_between(2, 5), c.max_constant_operands(1), c.feature_map_operands(1)), int16=True,
               skip_general=True),
        OpRule("mul", (c.rank_between(2, 5), c.max_constant_operands(1), c.feature_map_operands(1)), int16=True,
               skip_general=True),
        OpRule("div", (c.feature_map_operands(2), c.true_division())),
        OpRule("cat", (c.not_along_batch(),), int16=True),
        OpRule("max_pool2d", (c.pool_limits(kernel=256, stride=256, pad=256), c.pool_semantics())),
        OpRule("avg_pool2d", (c.pool_limits(kernel=256, stride=256, pad=256), c.pool_semantics())),
        OpRule("adaptive_avg_pool2d", (c.global_pool(),)),
        OpRule("mean", (c.global_pool(),)),
        OpRule("interpolate", (c.resize_hw(nearest_pow2=True),)),
        OpRule("sigmoid", int16=True),
        OpRule("tanh", int16=True),
        OpRule("exp", int16=True),
        OpRule("silu", int16=True),
        OpRule("batch_norm", (c.batch_norm_affine(),)),
        OpRule("reshape", (c.static_arguments(),)),
        OpRule("flatten", (c.static_arguments(),)),
        OpRule("transpose", (c.static_arguments(),)),
        OpRule("permute", (c.static_arguments(),)),
    ),
)
