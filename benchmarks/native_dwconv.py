"""The native depthwise int8 conv (``DepthwiseConv``) vs onnxruntime's ``QLinearConv`` on mobilenet_v2's shapes.

    python benchmarks/native_dwconv.py [--batches 1,8] [--repeat 30]

Each of mobilenet_v2's 17 depthwise layers at 224x224 (3x3, padding 1, stride 1 or 2) with random
int8 inputs and weights and the requantization of the real layers (``M`` near 2**31, ``n`` near 40,
relu6 clamped to [0, 127]): the VNNI kernel (``qc_dwconv4_*``) and the scalar native kernel
(``vnni=False``), both one call of ``DepthwiseConv`` (checks and the output allocation included,
``torch.equal`` to each other), and onnxruntime's int8 ``QLinearConv`` (``group = C``, per-channel
weight scales, NCHW int8 in and out, one intra-op thread, its default graph optimizations) on the
same integers (its float requantization is not the BPU's, so only its time is compared; a lone
NCHW ``QLinearConv`` also pays layout changes that ort's whole-model NHWC graph avoids).  Times are
the best of ``--repeat`` calls in rotation at one thread, per layer and summed over the model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.simulator import best_times, environment  # noqa: E402
from qcompiler.backends.bpu.native.kernels import DepthwiseConv, vnni_enabled  # noqa: E402

# mobilenet_v2 at 224x224: (input size, channels, stride) of its depthwise 3x3 convs, in order
MOBILENET_V2 = [(112, 32, 1), (112, 96, 2), (56, 144, 1), (56, 144, 2), (28, 192, 1), (28, 192, 1), (28, 192, 2),
                (14, 384, 1), (14, 384, 1), (14, 384, 1), (14, 384, 1), (14, 576, 1), (14, 576, 1), (14, 576, 2),
                (7, 960, 1), (7, 960, 1), (7, 960, 1)]


def _ort_session(w: torch.Tensor, bias: torch.Tensor, stride: int):
    """onnxruntime's QLinearConv over int8 NCHW, one thread."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    C = w.shape[0]
    inits = [numpy_helper.from_array(a, name) for name, a in [
        ("x_scale", np.array(0.05, np.float32)), ("x_zp", np.array(0, np.int8)), ("w", w.numpy().astype(np.int8)),
        ("w_scale", np.full(C, 0.01, np.float32)), ("w_zp", np.zeros(C, np.int8)),
        ("y_scale", np.array(0.04, np.float32)), ("y_zp", np.array(0, np.int8)), ("b", bias.numpy())]]
    node = helper.make_node("QLinearConv", ["x", "x_scale", "x_zp", "w", "w_scale", "w_zp", "y_scale", "y_zp", "b"],
                            ["y"], group=C, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
    graph = helper.make_graph([node], "dw", [helper.make_tensor_value_info("x", TensorProto.INT8, None)],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(environment())
    if not vnni_enabled():
        print("the VNNI depthwise kernel is not available here (no AVX512-VNNI build, or native kernels off)")
        return
    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        rows, total = [], {"vnni": 0.0, "scalar": 0.0, "ort": 0.0}
        for H, C, s in MOBILENET_V2:
            w = torch.randint(-127, 128, (C, 1, 3, 3), generator=g).to(torch.int8)
            bias = torch.randint(-(1 << 14), 1 << 14, (C,), generator=g).to(torch.int32)
            M, n = torch.randint(1 << 30, 1 << 31, (C,), generator=g), torch.randint(39, 43, (C,), generator=g)
            x = torch.randint(-128, 128, (batch, H, H, C), generator=g).to(torch.int8)
            fast, slow = (DepthwiseConv(w, bias, (s, s), (1, 1), (1, 1), M, n, 0, 127, torch.int8, vnni=v)
                          for v in (True, False))
            if not torch.equal(fast(x), slow(x)):
                raise SystemExit(f"the VNNI and scalar depthwise kernels differ on {H}x{H}x{C} stride {s}")
            sess, xn = _ort_session(w, bias, s), {"x": x.permute(0, 3, 1, 2).contiguous().numpy()}
            t = best_times({"vnni": lambda f=fast, x=x: f(x), "scalar": lambda f=slow, x=x: f(x),
                            "ort": lambda r=sess, xn=xn: r.run(None, xn)}, args.repeat)
            total = {k: total[k] + t[k] for k in total}
            rows.append([f"{H}x{H}x{C} s{s}", *(f"{t[k] * 1e3:.3f}" for k in total), f"{t['vnni'] / t['ort']:.2f}"])
        rows.append(["total (17 layers)", *(f"{total[k] * 1e3:.3f}" for k in total),
                     f"{total['vnni'] / total['ort']:.2f}"])
        print(f"\nbatch {batch}, 1 thread, ms (best of {args.repeat} in rotation)")
        print(tabulate(rows, headers=["layer", "VNNI", "scalar native", "ort QLinearConv", "VNNI / ort"],
                       tablefmt="github"))


if __name__ == "__main__":
    main()
