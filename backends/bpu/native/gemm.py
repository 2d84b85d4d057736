"""Exact int8 GEMM with the requantization fused (native, AVX512-VNNI): 1x1 convs and linear layers.

:class:`Int8Gemm` computes, for int8 rows ``x`` (P, K) and int8 weights ``w`` (O, K),
``out[p, o] = clamp(round_half_even((x[p] . w[o] + bias[o]) * M[o] / 2**n[o] [+ b[p, o] * Mb / 2**nb]), lo, hi)``
as int8 or int16, bit for bit what ``fixed_point.requantize`` (and ``round_scaled_sum`` for the fused
add) give, in one native pass: a register-blocked ``vpdpbusd`` micro-kernel whose int32 tiles are
requantized in int64 (``round_clamp`` of ``backends/bpu/native/requant.h``) before they leave the cache.

Exactness, checked once per layer here (:meth:`Int8Gemm.refusal` says why a layer is refused; the
caller keeps its other path then):

* the activations enter as ``x + 128`` (unsigned bytes); ``bias32[o] = bias[o] - 128 * sum_k w[o, k]``
  removes the offset exactly.  ``128 * max_o sum_k |w[o, k]| + max |bias| < 2**31`` bounds both
  ``bias32`` and the true accumulator, and ``vpdpbusd`` wraps modulo 2**32 (never saturates), so
  the final int32 is the true sum whatever the order;
* ``|M|, |Mb| < 2**31`` (exact 32 x 32-bit products), ``|acc| * max |M| < 2**62`` (the int64
  product), shifts in [0, 62]; when ``|acc| * max |M| < 2**53`` and there is no fused add, the epilogue
  runs in float64 instead: ``acc * (M * 2**-n)`` is exact (an integer below 2**53 times a power of two),
  the clamp to integer bounds commutes with rounding, and the conversion rounds half to even; with a fused add the sum
  over the common denominator ``2**max(n, nb)`` stays below 2**62 (layers that would need
  128-bit sums are refused);
* ``f64 == 2`` (no fused add, ``|acc| * M / 2**n < 2**31 - 1`` on every channel) and ``f64 == 3`` (a fused
  add whose sum over ``2**s``, ``s = max(n, nb)``, is below 2**53 and below ``(2**31 - 1) * 2**s``): the
  packed float64 epilogue of ``backends/bpu/native/gemm_vnni.c`` (exact conversions, fma, rounding half to
  even by adding 1.5 * 2**52, the result read from the low 32 bits, saturating packs).

Available where the CPU has AVX512-VNNI (with BW, VL and VBMI), which the library checks at run time
(:func:`gemm_available`); ``QCOMPILER_NATIVE_VNNI=0`` turns it off (benchmarks compare both paths).
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.nn.functional as F

from qcompiler.backends.bpu.native.kernels import (
    ENV_VNNI,
    F64_EXACT,
    INT64_LIMIT,
    MAX_SHIFT,
    _ok,
    abs_sums,
    amx_enabled,
    f64_epilogue,
    int8_acc_bound,
    prepared_constants,
    vnni_enabled,
)
from qcompiler.backends.bpu.native.plan import StepSpec
from qcompiler.errors import ConfigError
from qcompiler.native.kernels import _check, _fn

__all__ = ["Int8Gemm", "ConvGeometry", "gemm_available", "ENV_VNNI", "ENV_THREADS", "SPLIT_MIN_WORK", "row_parts"]

_I64, _P = ctypes.c_int64, ctypes.c_void_p
_INT = {torch.int8: "i8", torch.int16: "i16"}
_ARGS = (_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int, _P, _P, _P)
_ARGS_MT = _ARGS + (ctypes.c_int,)
_I32 = 1 << 31


ENV_THREADS = "QCOMPILER_NATIVE_THREADS"  # "1": never split one call's rows over threads
# rows * K * O (multiply-adds) below which a call stays on one thread: starting and joining a thread
# costs about 5 microseconds with the helpers spinning, more when they sleep (docs/performance.md,
# "Batch 1 at 2 threads": measured break-even near 1M)
SPLIT_MIN_WORK = 1 << 20


def row_parts(budget: int, work: int) -> int:
    """How many threads one native call of ``work`` multiply-adds may split its output rows over:
    ``budget`` (``qcompiler.parallel.part_budget()`` of the calling thread) when the work passes
    :data:`SPLIT_MIN_WORK` and ``QCOMPILER_NATIVE_THREADS`` is not ``1``, else 1."""
    if budget <= 1 or work < SPLIT_MIN_WORK or os.environ.get(ENV_THREADS, "").strip() == "1":
        return 1
    return budget


class ConvGeometry(ctypes.Structure):
    """A conv's geometry as the GEMM reads it: ``qc_conv_geometry`` of ``backends/bpu/native/conv_geometry.h``,
    the same fields in the same order (``qc_conv_geometry_layout`` reports the C side's; a test compares).
    An (N, H, W, C) input, a kh x kw kernel, its stride, padding and dilation, the Ho x Wo output, and the
    layer's weights repacked for the tail layout (``tail_w``) and for AMX's sliding layout (``slide_w``),
    each None where the kernel repacks them per call or needs none."""
    _fields_ = [(f, ctypes.c_int64) for f in ("H", "W", "C", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw", "Ho",
                                              "Wo")]
    _fields_ += [("tail_w", ctypes.c_void_p), ("slide_w", ctypes.c_void_p)]


def gemm_available() -> bool:
    """Whether the kernel can run here: :func:`~qcompiler.backends.bpu.native.kernels.vnni_enabled` (the library has
    AVX512-VNNI kernels for this CPU, ``QCOMPILER_NATIVE_VNNI`` not 0)."""
    return vnni_enabled()


class Int8Gemm:
    """A prepared exact int8 GEMM + requantization (see the module docstring).

    ``w`` (O, K) int8 values, ``bias`` (O,) integers or None, ``M``/``n`` (O,) or one value,
    ``[lo, hi]`` the output clamp (the integer type's range narrowed by a fused relu / relu6),
    ``out_dtype`` int8 / int16, ``add`` ``(Mb, nb, other_dtype)`` for a fused add or None.
    Raises ConfigError for a layer it cannot compute exactly; test :meth:`refusal` first.
    """

    def __init__(self, w: torch.Tensor, bias: Optional[torch.Tensor], M: torch.Tensor, n: torch.Tensor, lo: int,
                 hi: int, out_dtype: torch.dtype, add: Optional[tuple[int, int, torch.dtype]] = None) -> None:
        why = self.refusal(w, bias, M, n, lo, hi, out_dtype, add)
        if why is not None:
            raise ConfigError(f"Int8Gemm: {why}")
        O, K = w.shape
        self.O, self.K, self.out_dtype, self.lo, self.hi = O, K, out_dtype, int(lo), int(hi)
        b64 = torch.zeros(O, dtype=torch.int64) if bias is None else bias.to(torch.int64).reshape(O)
        Op, Kp = -(-O // 16) * 16, -(-K // 4) * 4
        b32 = torch.zeros(Op, dtype=torch.int32)
        b32[:O] = (b64 - 128 * abs_sums(w, signed=True)).to(torch.int32)  # in range: refusal() checked the bound
        self.bias32 = b32
        wp = F.pad(w.to(torch.int8), (0, Kp - K, 0, Op - O))  # zero weights beyond O and K
        # [ob][kq][16][4]: a zmm of 16 channels x 4 consecutive k per group of 4
        self.wpack = wp.view(Op // 16, 16, Kp // 4, 4).permute(0, 2, 1, 3).contiguous()
        self.M = M.to(torch.int64).reshape(-1).expand(O).contiguous()
        self.n = n.to(torch.int64).reshape(-1).expand(O).contiguous()
        self.add = add
        # without a fused add: the float64 epilogues where their bounds hold (f64_epilogue: 1 with
        # |acc| * |M| < 2**53, 2 with |acc| * |M| / 2**n < 2**31 - 1 on every channel as well), else int64
        bound = self.acc_bound(w, bias)
        self.f64 = f64_epilogue(bound, self.M, self.n) if add is None else 0
        # with a fused add whose sum over the common denominator 2**s stays below 2**53 and below (2**31 - 1) * 2**s
        # on every channel: the float64 epilogue with the add (f64 == 3; exact sums, one rounding to an integer)
        if add is not None and all(x < F64_EXACT and x < (_I32 - 1) << s for x, s in self._fused_bounds(bound, add)):
            self.f64 = 3
        name = f"qc_gemm_{_INT[out_dtype]}" if add is None else f"qc_gemm_add_{_INT[add[2]]}_{_INT[out_dtype]}"
        self._f, self._fmt = _fn(name, _ARGS), _fn(name + "_mt", _ARGS_MT)
        self._fstep = _fn(name + "_step", (_P, _P) + _ARGS)
        self.Mb, self.nb = (0, 0) if add is None else (int(add[0]), int(add[1]))
        # the constant arguments, once (a call's Python overhead matters on small layers)
        self._consts = (self.K, self.O, self.wpack.data_ptr(), self.bias32.data_ptr(), self.M.data_ptr(),
                        self.n.data_ptr())
        # the per-channel constants the kernel would otherwise build on every call (and in every part of a
        # split one): qc_gemm_prep, once
        self._pre = prepared_constants(self.bias32, self.M, self.n, O, add is not None, self.nb)
        # (kh, kw, C, dh, dw) -> the weights repacked for the tail layout (conv_geometry), None where it does not apply
        self._tail_w: dict[tuple[int, ...], Optional[torch.Tensor]] = {}
        # (kh, kw, C, sh, sw, dw) -> the weights in the AMX sliding layout's order (conv_geometry), None where not needed
        self._slide_w: dict[tuple[int, ...], Optional[torch.Tensor]] = {}

    acc_bound = staticmethod(int8_acc_bound)

    def _fused_bounds(self, bound: int, add: tuple[int, int, torch.dtype]) -> list[tuple[int, int]]:
        """Per channel ``(X, s)``: the bound on ``|acc * M * 2**(s - n) + b * Mb * 2**(s - nb)|``, the fused
        sum over the common denominator ``2**s``, ``s = max(n, nb)``."""
        Mb, nb = abs(int(add[0])), int(add[1])
        b_bound = 1 << (8 * torch.empty(0, dtype=add[2]).element_size() - 1)
        out = []
        for m, n in zip(self.M.tolist(), self.n.tolist()):
            s = max(n, nb)
            out.append(((bound * abs(m) << (s - n)) + (b_bound * Mb << (s - nb)), s))
        return out

    @staticmethod
    def refusal(w: torch.Tensor, bias: Optional[torch.Tensor], M: torch.Tensor, n: torch.Tensor, lo: int, hi: int,
                out_dtype: torch.dtype, add: Optional[tuple[int, int, torch.dtype]] = None) -> Optional[str]:
        """Why this layer cannot run exactly in the kernel (None: it can)."""
        if w.dim() != 2 or not w.numel():
            return f"weight must be a non-empty (O, K) matrix, got {tuple(w.shape)}"
        if out_dtype not in _INT:
            return f"out_dtype must be torch.int8 or torch.int16, got {out_dtype}"
        if w.is_floating_point() or int(w.min()) < -128 or int(w.max()) > 127:
            return "weights must be int8 values"
        O = w.shape[0]
        if M.numel() not in (1, O) or n.numel() != M.numel():
            return f"M and n need one value or one per output channel ({O}), got {M.numel()} and {n.numel()}"
        bound = Int8Gemm.acc_bound(w, bias)
        if bound >= _I32:
            return f"the accumulator bound {bound} reaches 2**31"
        n_lo, n_hi = int(n.min()), int(n.max())
        m_max = int(M.to(torch.int64).abs().max())
        if n_lo < 0 or n_hi > MAX_SHIFT:
            return f"shifts must be in [0, {MAX_SHIFT}], got [{n_lo}, {n_hi}]"
        if m_max >= _I32:
            return f"multipliers must be below 2**31 (a 32 x 32-bit product), got {m_max}"
        if bound * m_max >= INT64_LIMIT:
            return f"|acc| <= {bound} times M up to {m_max} may reach 2**62"
        if not -(1 << 31) <= lo <= hi < 1 << 31:
            return f"bad clamp range [{lo}, {hi}]"
        if add is not None:
            Mb, nb, bdt = add
            if bdt not in _INT:
                return f"the fused operand's dtype {bdt} is not int8 or int16"
            if abs(int(Mb)) >= _I32:
                return f"the fused operand's multiplier {Mb} is not below 2**31"
            if not 0 <= nb <= MAX_SHIFT:
                return f"the fused operand's shift {nb} is not in [0, {MAX_SHIFT}]"
            b_bound = 1 << (8 * torch.empty(0, dtype=bdt).element_size() - 1)
            s = max(n_hi, nb)
            if bound * m_max * 2 ** (s - n_lo) + b_bound * abs(int(Mb)) * 2 ** (s - nb) >= INT64_LIMIT:
                return "the fused sum over the common denominator may reach 2**62 (needs 128-bit integers)"
        return None

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None, other: Optional[torch.Tensor] = None,
                 m0: int = 0, m1: Optional[int] = None, parts: int = 1) -> torch.Tensor:
        """``x`` (P, K) int8 with unit column stride; rows ``m0:m1`` of ``out`` (P, O) are written
        (a new tensor when None); ``other`` (P, O) contiguous of the fused add's dtype, exactly when
        the layer has one.  ``parts > 1``: the rows are split over that many native threads (the
        caller's included; disjoint rows of the same computation, so the same bits)."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int8 or x.dim() != 2 or x.shape[1] != self.K:
            raise ConfigError(f"Int8Gemm: x must be an int8 (rows, {self.K}) matrix, got "
                              f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        # (the stride of a 1-sized dim is never used: torch may give it any value)
        if x.device.type != "cpu" or (self.K > 1 and x.stride(1) != 1) or (x.shape[0] > 1 and x.stride(0) < self.K):
            raise ConfigError("Int8Gemm: x must be on the CPU with unit column stride and rows of at least K")
        P = x.shape[0]
        m1 = P if m1 is None else m1
        if not 0 <= m0 <= m1 <= P:
            raise ConfigError(f"Int8Gemm: row range [{m0}, {m1}) is not within [0, {P}]")
        if out is None:
            out = torch.empty(P, self.O, dtype=self.out_dtype)
        _check(out, "Int8Gemm: out", (self.out_dtype,), (P, self.O))
        if (other is None) != (self.add is None):
            raise ConfigError("Int8Gemm: other must be given exactly when the layer has a fused add")
        if other is not None:
            _check(other, "Int8Gemm: other", (self.add[2],), (P, self.O))
        self.run_rows(x, x.stride(0) if P > 1 else self.K, None, out, other, m0, m1, parts=parts)
        return out

    def run_rows(self, x: torch.Tensor, ldx: int, geo: Optional[ConvGeometry], out: torch.Tensor,
                 other: Optional[torch.Tensor], m0: int, m1: int, parts: int = 1) -> None:
        """The kernel on output rows ``m0:m1`` with NO checks: what ``__call__`` and ``conv`` run after
        theirs, for a caller that has made the same checks once (the simulator's layers, per input
        shape).  ``x``: rows of stride ``ldx`` (``geo`` None) or the NHWC input of ``geo``
        (:meth:`conv_geometry`); ``out``/``other`` contiguous (rows, O).  Only the row range against
        ``out``'s size is checked (a cheap guard against writing past it).  ``out`` must not overlap ``x``:
        the kernel reads ``x`` in place while it writes ``out``."""
        if m1 <= m0:
            return
        args = self._args(x, ldx, geo, out, other, m0, m1)
        _ok(self._fmt(*args, int(parts)) if parts > 1 else self._f(*args))

    def _args(self, x, ldx, geo, out, other, m0, m1) -> tuple:
        if m0 < 0 or out.numel() < m1 * self.O or out.dtype != self.out_dtype or x.dtype != torch.int8:
            raise ConfigError(f"Int8Gemm.run_rows: rows [{m0}, {m1}) do not fit out {tuple(out.shape)} {out.dtype} "
                              f"(x {x.dtype})")
        return (x.data_ptr(), ldx, m0, m1, *self._consts, None if other is None else other.data_ptr(), self.Mb,
                self.nb, self.lo, self.hi, self.f64, None if geo is None else ctypes.addressof(geo), out.data_ptr(),
                self._pre.data_ptr())

    def step(self, x: torch.Tensor, ldx: int, geo: Optional[ConvGeometry], out: torch.Tensor,
             other: Optional[torch.Tensor], m0: int, m1: int) -> StepSpec:
        """:meth:`run_rows` as a plan step (:class:`~qcompiler.backends.bpu.native.plan.NativeSteps`): the same
        arguments and the same guard, run later, on the same buffers."""
        return StepSpec(self._fstep, self._args(x, ldx, geo, out, other, m0, m1), (self, x, geo, out, other))

    def conv(self, x: torch.Tensor, kernel_size, stride, padding, dilation, other: Optional[torch.Tensor] = None,
             m0: int = 0, m1: Optional[int] = None, out: Optional[torch.Tensor] = None, parts: int = 1) -> torch.Tensor:
        """A conv2d (groups 1) whose weight ``(O, C, kh, kw)`` was given as ``w.permute(0, 2, 3, 1)``
        reshaped to ``(O, kh * kw * C)``: ``x`` (N, H, W, C) int8 contiguous (channels-last), the result
        (N, Ho, Wo, O); the kernel gathers each output position's taps itself (zero padding).  Rows
        ``m0:m1`` of the N * Ho * Wo output positions are written; ``other`` as ``out``, contiguous;
        ``parts`` as for ``__call__``."""
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.int8 or x.dim() != 4 or x.device.type != "cpu"
                or not x.is_contiguous()):
            raise ConfigError(f"Int8Gemm.conv: x must be an int8 contiguous (N, H, W, C) tensor, got "
                              f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        geo, (N, Ho, Wo) = self.conv_geometry(tuple(x.shape), kernel_size, stride, padding, dilation)
        P = N * Ho * Wo
        m1 = P if m1 is None else m1
        if not 0 <= m0 <= m1 <= P:
            raise ConfigError(f"Int8Gemm.conv: row range [{m0}, {m1}) is not within [0, {P}]")
        if out is None:
            out = torch.empty((N, Ho, Wo, self.O), dtype=self.out_dtype)
        _check(out, "Int8Gemm.conv: out", (self.out_dtype,), (N, Ho, Wo, self.O))
        if (other is None) != (self.add is None):
            raise ConfigError("Int8Gemm.conv: other must be given exactly when the layer has a fused add")
        if other is not None:
            _check(other, "Int8Gemm.conv: other", (self.add[2],), (N, Ho, Wo, self.O))
        self.run_rows(x, self.K, geo, out, other, m0, m1, parts=parts)
        return out

    def conv_layout(self, shape: tuple, kernel_size, stride, padding, dilation) -> str:
        """How the kernel reads a conv's input (``gemm_vnni.c``, ``gemm_src_open``): ``"direct"`` (each kernel
        row's ``kw * C`` bytes in place: a multiple of 4, no dilation along W unless ``kw`` is 1; the windows
        that cross the left or right edge copied), ``"tail"`` (``kw * C`` one past a multiple of 4, no
        dilation unless the kernel is 1 wide / high, the weights within ``GEMM_TAIL_MAX_W``: from a copy of
        the rows padded left and right, the kernel rows' last bytes from a transposed plane of the last
        channel), ``"im2col"`` (every output's window copied) or, on AMX tiles (the calls they take:
        ``set_amx``), ``"slide"`` (no dilation along W: the input copied once with its padding, 16 outputs read
        in place as one tile, walking the padded grid at stride 1 or output rows at any stride; the positions
        computed and dropped are weighed against the copies saved, ``gemm_slide_mode``).  For tests and
        benchmarks."""
        geo, (N, Ho, Wo) = self.conv_geometry(shape, kernel_size, stride, padding, dilation)
        return self.conv_layout_of(geo, N * Ho * Wo)

    def conv_layout_of(self, geo: ConvGeometry, rows: int) -> str:
        """:meth:`conv_layout` of a call over ``rows`` output rows with a geometry from :meth:`conv_geometry`."""
        return {1: "direct", 2: "tail", 3: "im2col", 4: "slide"}[
            _fn("qc_gemm_conv_layout", (_P, _I64, _I64))(ctypes.addressof(geo), self.O, int(rows))]

    def conv_geometry(self, shape: tuple, kernel_size, stride, padding, dilation) -> tuple[ConvGeometry, tuple]:
        """For a conv of an (N, H, W, C) input ``shape``: the kernel's geometry argument and the output's
        (N, Ho, Wo), after checking that the layer's K is C * kh * kw and the geometry is valid
        (ConfigError otherwise, e.g. an input smaller than the kernel)."""
        kh, kw = (int(v) for v in kernel_size)
        sh, sw, ph, pw, dh, dw = (int(v) for v in (*stride, *padding, *dilation))
        if len(shape) != 4 or shape[3] * kh * kw != self.K:
            raise ConfigError(f"Int8Gemm.conv: x must be (N, H, W, C) with C * {kh} * {kw} = {self.K}, got {shape}")
        if min(sh, sw, dh, dw) < 1 or min(ph, pw) < 0:
            raise ConfigError(f"Int8Gemm.conv: bad geometry stride {stride}, padding {padding}, dilation {dilation}")
        N, H, W, C = shape
        Ho, Wo = (H + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (W + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        if Ho <= 0 or Wo <= 0:
            raise ConfigError(f"Int8Gemm.conv: input {H}x{W} is smaller than the kernel")
        geo = ConvGeometry(H, W, C, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo)
        # a conv read in the tail layout: its weights in that layout's order, repacked once per kernel shape
        # and passed by address in geo.tail_w (the kernel repacks them per call when it is None)
        wt = self._tail_w.get((kh, kw, C, dh, dw), False)
        if wt is False:
            wt = torch.empty(self.wpack.numel(), dtype=torch.int8)
            repack = _fn("qc_gemm_tail_weights", (_P, _I64, _P, _P))
            wt = wt if repack(self.wpack.data_ptr(), self.O, ctypes.addressof(geo), wt.data_ptr()) == 0 else None
            # (None: not the tail layout for this kernel shape.)  setdefault: threads that build the same
            # layer's first plan at once (the batch split) all keep the first tensor stored, so no geo.tail_w
            # points at a repack another thread's store dropped
            wt = self._tail_w.setdefault((kh, kw, C, dh, dw), wt)
        if wt is not None:
            geo.tail_w = wt.data_ptr()
        # a conv the AMX tiles read in place (gemm_vnni.c, GEMM_SLIDE): its weights with each kernel row padded to
        # 64-byte chunks, once per kernel shape, in geo.slide_w (none needed when kw * C is a multiple of 64); only
        # while the tiles are on (a geometry built with them off reads the input another way)
        ws = self._slide_w.get((kh, kw, C, sh, sw, dw), False) if amx_enabled() else None
        if ws is False:
            L = -(-kw * C // 64) * 64
            ws = torch.empty(-(-self.O // 16) * 16 * kh * L, dtype=torch.int8)
            repack = _fn("qc_gemm_slide_weights", (_P, _I64, _P, _P))
            ws = ws if repack(self.wpack.data_ptr(), self.O, ctypes.addressof(geo), ws.data_ptr()) == 0 else None
            ws = self._slide_w.setdefault((kh, kw, C, sh, sw, dw), ws)
        if ws is not None:
            geo.slide_w = ws.data_ptr()
        return geo, (N, Ho, Wo)
