"""The fast conv2d: the native GEMM and depthwise layers, oneDNN's int8 convolution, else exact
integer/float GEMMs on im2col tiles (:class:`_FastConv`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from qcompiler.backends.bpu.native.kernels import abs_sums
from qcompiler.backends.bpu.program import BpuOp, ValueSpec
from qcompiler.backends.bpu.sim.bounds import AMAX, F32_EXACT, I32, STORAGE
from qcompiler.backends.bpu.sim.epilogue import TILE, Epilogue
from qcompiler.backends.bpu.sim.gemm import float_plan, gemm_mode, int_mm
from qcompiler.backends.bpu.sim.memory import Workspace
from qcompiler.backends.bpu.sim.native_depthwise import _NativeDepthwiseLayer
from qcompiler.backends.bpu.sim.native_gemm import _NativeGemmLayer
from qcompiler.backends.bpu.sim.onednn_layer import _OnednnConvLayer
from qcompiler.backends.bpu.sim.reference import fixed_point_weight_layer
from qcompiler.backends.bpu.sim.registry import KernelSpec, fast_kernel
from qcompiler.quantization import fixed_point as fp

# bytes of one integer im2col tile
_COL_BYTES = 8 << 20


@fast_kernel("conv2d")
def _fast_conv(k: KernelSpec) -> Callable:
    if k.native:
        layer = _NativeDepthwiseLayer.build(k) or _NativeGemmLayer.build(k)
        if layer is not None:
            return layer
    if k.onednn:
        layer = _OnednnConvLayer.build(k)
        if layer is not None:
            return layer
    return _FastConv(k.op, k.in_specs, k.name, k.ws, k.int8_gemm)


class _FastConv:
    """conv2d: exact integer/float GEMMs on im2col tiles that stay in cache, then the float64 epilogue.

    The input is staged once as integers (zero-padded, channel-major).  Each
    tile of output positions (a block of images, or of rows of one image)
    gathers its im2col columns in the integer type (rows ordered (c, i, j)
    like the weight), multiplies them by the weight -- one int8 x int8 ->
    int32 GEMM when verified exact (see :func:`int8_gemm_available`), else
    float32 GEMMs over input-channel chunks whose partial sums stay below
    2**24 (float64 when no chunking works) -- and runs the epilogue on the
    tile.  1x1 convs without padding read the input directly.  Depthwise
    convs multiply-add the shifted windows per channel block (float32).
    Grouped (non-depthwise) convs use the fixed_point kernels.
    """

    def __init__(self, op: BpuOp, in_specs: list[ValueSpec], name: str, ws: Workspace, int8_gemm: bool) -> None:
        a, T = op.attrs, op.tensors
        self.name, self.ws = name, ws
        w = T["weight"]
        self.w_i8 = w
        O, Cg, kh, kw = w.shape
        self.O, self.Cg, self.kh, self.kw = O, Cg, kh, kw
        self.stride, self.padding = tuple(a["stride"]), tuple(a["padding"])
        self.dilation, self.groups = tuple(a["dilation"]), int(a["groups"])
        self.in_dtype = in_specs[0].dtype
        self.static_amax = AMAX[self.in_dtype] if self.in_dtype == "qint8" else None
        self.l1 = abs_sums(w, (2, 3)).numpy()  # (O, Cg)
        self.l1_row = int(self.l1.sum(axis=1).max(initial=0))  # max_o sum |w_o|
        self.depthwise = Cg == 1 and self.groups == O
        self.grouped = self.groups > 1 and not self.depthwise
        self.taps = [(i, j) for i in range(kh) for j in range(kw)]
        # int8 x int8 -> int32 GEMM: exact when the true sums fit int32 (wrap-around arithmetic
        # then gives the exact result); proven statically from the L1 bound. int16 weights (a
        # weight_dtype="qint16" qconfig) take the float GEMMs: torch._int_mm reads int8 only
        self.int8 = (int8_gemm and not self.depthwise and not self.grouped and self.in_dtype == "qint8"
                     and w.dtype == torch.int8 and AMAX["qint8"] * self.l1_row < I32)
        self.w_mat = w.reshape(O, -1).contiguous()  # (O, Cg*kh*kw), K ordered (c, i, j)
        self._plans: dict = {}
        self._fw: dict = {}
        self.with_add = bool(a["with_add"])
        self.hp = bool(a["high_precision"])
        self.out_storage = torch.int32 if self.hp else STORAGE[a["out_dtype"]]
        self.epi = Epilogue(op, name, True, in_specs[1] if self.with_add else None, ws)
        self.fallback = fixed_point_weight_layer(op, name)

    def _amax(self, x: torch.Tensor) -> int:
        if self.static_amax is not None:
            return self.static_amax
        return 1 << max(fp._extreme(x), 1).bit_length()  # a power of two above max|x|: few plans

    def _plan(self, amax: int):
        """(dtype, chunks) of the float GEMMs for inputs with |x| <= amax, or None (fixed_point)."""
        key = (amax, gemm_mode())
        if key not in self._plans:
            self._plans[key] = float_plan(self.l1, self.l1_row, amax, key[1])
        return self._plans[key]

    def _float_weights(self, dtype, chunks):
        key = (dtype, chunks)
        if key not in self._fw:
            kk = self.kh * self.kw
            wf = self.w_mat.to(dtype)
            if self.depthwise:
                self._fw[key] = [wf[:, t:t + 1].contiguous() for t in range(kk)]  # per tap (C, 1)
            else:
                self._fw[key] = [(wf[:, c0 * kk:c1 * kk].contiguous(), c0 * kk, c1 * kk) for c0, c1 in chunks]
        return self._fw[key]

    def __call__(self, x: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.grouped or x.dim() != 4:
            return self.fallback(x) if other is None else self.fallback(x, other)
        amax = self._amax(x)
        plan = None if self.int8 else self._plan(amax)
        if plan is None and not self.int8:
            return self.fallback(x) if other is None else self.fallback(x, other)
        N = x.shape[0]
        st, pad, dil, Ho, Wo = fp._conv_geometry(
            x.shape, self.w_i8.shape, self.stride, self.padding, self.dilation, self.groups, self.name)
        check = amax * self.l1_row + self.epi.max_bias >= I32
        out = torch.empty(self.O, N, Ho, Wo, dtype=self.out_storage)
        ot = None if other is None else other.transpose(0, 1)  # (O, N, Ho, Wo) view
        if self.depthwise:
            self._depthwise(x, plan[0], out, ot, check, st, pad, dil, Ho, Wo)
        else:
            self._gemm_conv(x, plan, out, ot, check, st, pad, dil, Ho, Wo)
        return out.permute(1, 0, 2, 3)

    def _padded(self, x: torch.Tensor, pad) -> torch.Tensor:
        """x as integers (C, N, H+2ph, W+2pw) with a zero border (a workspace view)."""
        N, C, H, W = x.shape
        ph, pw = pad
        if ph == pw == 0:
            return x.transpose(0, 1)
        xp = self.ws.get("xpad", (C, N, H + 2 * ph, W + 2 * pw), x.dtype)
        xp[:, :, :ph].zero_()
        xp[:, :, ph + H:].zero_()
        xp[:, :, ph:ph + H, :pw].zero_()
        xp[:, :, ph:ph + H, pw + W:].zero_()
        xp[:, :, ph:ph + H, pw:pw + W].copy_(x.transpose(0, 1))
        return xp

    def _gemm(self, col: torch.Tensor, plan, width: int) -> torch.Tensor:
        """(O, width) exact accumulator (int32 or float) of weight @ col."""
        ws = self.ws
        if plan is None:  # int8 GEMM
            acc = ws.get("acc", (self.O, width), torch.int32)
            int_mm(self.w_mat, col, acc)
            return acc
        dtype, chunks = plan
        xt = ws.get("xtile", (col.shape[0], width), dtype)
        xt.copy_(col)
        wts = self._float_weights(dtype, chunks)
        acc = ws.get("acc", (self.O, width), dtype)
        if len(wts) == 1:
            torch.mm(wts[0][0], xt, out=acc)
            return acc
        acc64 = ws.get("acc64", (self.O, width), torch.float64)
        for ci, (wm, r0, r1) in enumerate(wts):
            torch.mm(wm, xt[r0:r1], out=acc)
            if ci == 0:
                acc64.copy_(acc)
            else:
                acc64.add_(acc)
        return acc64

    def _add_bias(self, acc: torch.Tensor, check: bool) -> bool:
        """Add the bias to an int32 accumulator in place when acc + bias is proven in range."""
        if acc.dtype != torch.int32 or check or self.epi.bias_i32 is None:
            return False
        acc.add_(self.epi.bias_i32)
        return True

    def _gemm_conv(self, x, plan, out, ot, check, st, pad, dil, Ho, Wo) -> None:
        N, C = x.shape[:2]
        O, kh, kw = self.O, self.kh, self.kw
        (sh, sw), (dh, dw) = st, dil
        K = C * kh * kw
        ws = self.ws
        epi = self.epi
        out2 = out.view(O, -1)
        if kh == kw == 1 and pad == (0, 0):  # pointwise: the (strided) input is the im2col matrix
            src = x[:, :, ::sh, ::sw] if (sh, sw) != (1, 1) else x
            src = src.transpose(0, 1)
            if not src.is_contiguous():
                src = ws.get("stage", src.shape, x.dtype).copy_(src)
            src = src.reshape(C, -1)
            G = src.shape[1]
            other2 = None if ot is None else ot.reshape(O, -1)
            T = max(256, TILE // O)
            for p0 in range(0, G, T):
                p1 = min(G, p0 + T)
                acc = self._gemm(src[:, p0:p1], plan, p1 - p0)
                epi.tile(acc, out2[:, p0:p1], 0, O, None if other2 is None else other2[:, p0:p1], check,
                         self._add_bias(acc, check))
            return
        xp = self._padded(x, pad)
        HW = Ho * Wo
        T = max(Wo, min(TILE // O, _COL_BYTES // K))  # output positions per tile
        if HW <= T:
            tiles = [(n, min(N, n + T // HW), 0, Ho) for n in range(0, N, T // HW)]
        else:
            rb = max(1, T // Wo)
            tiles = [(n, n + 1, r, min(Ho, r + rb)) for n in range(N) for r in range(0, Ho, rb)]
        for n0, n1, r0, r1 in tiles:
            nb, rb = n1 - n0, r1 - r0
            width = nb * rb * Wo
            col = ws.get("col", (C, kh * kw, nb, rb, Wo), x.dtype)
            for t, (i, j) in enumerate(self.taps):
                col[:, t].copy_(xp[:, n0:n1, r0 * sh + i * dh: (r1 - 1) * sh + i * dh + 1: sh,
                                   j * dw: j * dw + sw * (Wo - 1) + 1: sw])
            acc = self._gemm(col.view(K, width), plan, width)
            o = out[:, n0:n1, r0:r1].reshape(O, width)  # a view (rows or whole images)
            other = None if ot is None else ot[:, n0:n1, r0:r1].reshape(O, width)
            epi.tile(acc, o, 0, O, other, check, self._add_bias(acc, check))

    def _depthwise(self, x, dtype, out, ot, check, st, pad, dil, Ho, Wo) -> None:
        """Per block of channels: cast the padded block, multiply-add its taps, run the epilogue."""
        N, C, H, W = x.shape
        (sh, sw), (ph, pw), (dh, dw) = st, pad, dil
        Hp, Wp = H + 2 * ph, W + 2 * pw
        ws = self.ws
        xp = self._padded(x, pad)  # (C, N, Hp, Wp) integers
        wts = self._float_weights(dtype, ((0, 1),))
        # stride 1: shifted windows of the flattened padded block (positions between rows and
        # images are computed and dropped; not when the int32 range must be checked on the data)
        flat = (sh, sw) == (1, 1) and not check
        bias = self.epi.bias_f32
        fold = (bias is not None and dtype == torch.float32 and not check
                and self.static_amax is not None and self.static_amax * self.l1_row + self.epi.max_bias < F32_EXACT)
        per = N * Hp * Wp
        cb = max(1, TILE // per)
        offs = [i * dh * Wp + j * dw for i, j in self.taps]
        # strided: split the block into its sh*sw phases (unit-stride windows for every tap)
        phase_hw = [((Hp - a + sh - 1) // sh, (Wp - b + sw - 1) // sw) for a in range(sh) for b in range(sw)]
        for c0 in range(0, C, cb):
            c1 = min(C, c0 + cb)
            if flat or (sh, sw) == (1, 1):
                xb = ws.get("xtile", (c1 - c0, N, Hp, Wp), dtype)
                xb.copy_(xp[c0:c1])
            else:
                phases = {}
                for k, (a, b) in enumerate((a, b) for a in range(sh) for b in range(sw)):
                    ph_ = ws.get(f"phase{k}", (c1 - c0, N) + phase_hw[k], dtype)
                    ph_.copy_(xp[c0:c1, :, a::sh, b::sw])
                    phases[(a, b)] = ph_
            if flat:
                fb = xb.view(c1 - c0, -1)
                cols = per - offs[-1]
                acc = ws.get("acc", (c1 - c0, per), dtype)
                part = acc[:, :cols]
                for k, off in enumerate(offs):
                    if k == 0 and fold:
                        torch.addcmul(bias[c0:c1], fb[:, off:off + cols], wts[k][c0:c1], out=part)
                    elif k == 0:
                        torch.mul(fb[:, off:off + cols], wts[k][c0:c1], out=part)
                    else:
                        part.addcmul_(fb[:, off:off + cols], wts[k][c0:c1])
                acc = acc.view(c1 - c0, N, Hp, Wp)[:, :, :Ho, :Wo]
            else:
                acc = ws.get("acc", (c1 - c0, N, Ho, Wo), dtype)
                for k, (i, j) in enumerate(self.taps):
                    if (sh, sw) == (1, 1):
                        xv = xb[:, :, i * dh: i * dh + Ho, j * dw: j * dw + Wo]
                    else:  # row i*dh + sh*r lies in phase (i*dh % sh) at row i*dh // sh + r
                        a, b = i * dh % sh, j * dw % sw
                        xv = phases[(a, b)][:, :, i * dh // sh: i * dh // sh + Ho, j * dw // sw: j * dw // sw + Wo]
                    wv = wts[k][c0:c1].view(-1, 1, 1, 1)
                    if k == 0 and fold:
                        torch.addcmul(bias[c0:c1].view(-1, 1, 1, 1), xv, wv, out=acc)
                    elif k == 0:
                        torch.mul(xv, wv, out=acc)
                    else:
                        acc.addcmul_(xv, wv)
            # (the epilogue's first copy drops the extra positions of the flat form)
            self.epi.tile(acc, out[c0:c1], c0, c1, None if ot is None else ot[c0:c1], check, fold)
