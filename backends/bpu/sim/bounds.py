"""What the kernels prove their bounds against: each integer type's storage and largest magnitude,
and the limits below which int32 and the float types hold integers exactly."""

import torch

# the storage of each integer type
STORAGE = {"qint8": torch.int8, "qint16": torch.int16, "qint32": torch.int32}
# largest |value| of each integer type (for static bounds)
AMAX = {"qint8": 128, "qint16": 1 << 15, "qint32": 1 << 31}
# an int32 accumulator holds |values| below this
I32 = 1 << 31
# float32 and float64 hold every integer of magnitude below these exactly
F32_EXACT = 1 << 24
F64_EXACT = 1 << 53
