"""Loss functions, distances and similarities as element-wise graphs plus a reduction: mse_loss, l1_loss,
soft_margin_loss, margin_ranking_loss, binary_cross_entropy_with_logits, kl_div, huber_loss,
smooth_l1_loss, poisson_nll_loss, hinge_embedding_loss; cosine_similarity, pairwise_distance, dist.

``reduction`` is ``'mean'`` (ReduceMean over every dim, a 0-d result), ``'sum'`` or ``'none'``; the
deprecated ``size_average`` / ``reduce`` flags are refused (the island runs them in torch)."""

from __future__ import annotations

from onnx import TensorProto

from qcompiler.backends.onnx.context import FLOAT_TYPES, NodeContext, Tensor
from qcompiler.backends.onnx.registry import emits
from qcompiler.backends.onnx.rules.common import F32, _as_tensor
from qcompiler.ir.ops import REQUIRED

REDUCE = {"mean": "ReduceMean", "sum": "ReduceSum"}


def _reduced(ctx: NodeContext, loss: Tensor, kw: dict) -> Tensor:
    if kw.get("size_average") is not None or kw.get("reduce") is not None:
        raise ctx.unsupported("the deprecated size_average / reduce arguments (use reduction=)")
    reduction = kw["reduction"]
    if reduction == "none":
        return ctx.make("Identity", [loss])
    if reduction not in REDUCE:
        raise ctx.unsupported(f"reduction={reduction!r} ('mean', 'sum' or 'none')")
    return ctx.make(REDUCE[reduction], [loss], keepdims=0)


def _float(ctx: NodeContext, a, tag: str) -> Tensor:
    dt = ctx.out_dtype() if ctx.out_dtype() in FLOAT_TYPES else F32
    return _as_tensor(ctx, ctx.value(a), dt, tag)


@emits("mse_loss", "l1_loss", since=11)
def mse_loss(ctx: NodeContext) -> Tensor:
    """(x - y)^2 / |x - y|, reduced."""
    kw = ctx.kw(target=REQUIRED, size_average=None, reduce=None, reduction="mean", weight=None)
    if kw["weight"] is not None:
        raise ctx.unsupported("a weight")
    d = ctx.make("Sub", [_float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")], tag="diff")
    loss = ctx.make("Mul", [d, d], tag="square") if ctx.op == "mse_loss" else ctx.make("Abs", [d], tag="abs")
    return _reduced(ctx, loss, kw)


@emits("soft_margin_loss", since=11)
def soft_margin_loss(ctx: NodeContext) -> Tensor:
    """log(1 + exp(-y x)), reduced (Softplus of -y x)."""
    kw = ctx.kw(target=REQUIRED, size_average=None, reduce=None, reduction="mean")
    yx = ctx.make("Mul", [_float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")], tag="yx")
    loss = ctx.make("Softplus", [ctx.make("Neg", [yx], tag="neg")], tag="softplus")
    return _reduced(ctx, loss, kw)


@emits("margin_ranking_loss", since=11)
def margin_ranking_loss(ctx: NodeContext) -> Tensor:
    """max(0, -y (x1 - x2) + margin), reduced."""
    kw = ctx.kw(input2=REQUIRED, target=REQUIRED, margin=0.0, size_average=None, reduce=None, reduction="mean")
    x1, x2 = _float(ctx, ctx.arg(0, "input1"), "x1"), _float(ctx, kw["input2"], "x2")
    y = _float(ctx, kw["target"], "target")
    dt = ctx.dtype(x1)
    v = ctx.make("Neg", [ctx.make("Mul", [y, ctx.make("Sub", [x1, x2], tag="diff")], tag="y_diff")], tag="neg")
    v = ctx.make("Add", [v, ctx.const("margin", float(kw["margin"]), dt)], tag="plus_margin")
    return _reduced(ctx, ctx.make("Relu", [v], tag="relu"), kw)


@emits("binary_cross_entropy_with_logits", since=11)
def bce_with_logits(ctx: NodeContext) -> Tensor:
    """(1 - y) x + (1 + (p - 1) y) softplus(-x), times weight, reduced (p = pos_weight, 1 without)."""
    kw = ctx.kw(target=REQUIRED, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None)
    x, y = _float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")
    dt = ctx.dtype(x)
    one = ctx.const("one", 1.0, dt)
    sp = ctx.make("Softplus", [ctx.make("Neg", [x], tag="neg_x")], tag="softplus")
    if kw["pos_weight"] is not None:
        p1 = ctx.make("Sub", [_float(ctx, kw["pos_weight"], "pos_weight"), one], tag="p_minus_1")
        sp = ctx.make("Mul", [sp, ctx.make("Add", [one, ctx.make("Mul", [p1, y], tag="p1_y")], tag="coef")],
                      tag="weighted_sp")
    loss = ctx.make("Add", [ctx.make("Mul", [ctx.make("Sub", [one, y], tag="one_minus_y"), x], tag="lin"), sp],
                    tag="loss")
    if kw["weight"] is not None:
        loss = ctx.make("Mul", [loss, _float(ctx, kw["weight"], "weight")], tag="weighted")
    return _reduced(ctx, loss, kw)


@emits("kl_div", since=11)
def kl_div(ctx: NodeContext) -> Tensor:
    """target (log target - input) (0 where target is 0), or exp(t) (t - input) with log_target;
    reduction 'batchmean' divides the sum by the batch size."""
    kw = ctx.kw(target=REQUIRED, size_average=None, reduce=None, reduction="mean", log_target=False)
    x, t = _float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")
    dt = ctx.dtype(x)
    if kw["log_target"]:
        loss = ctx.make("Mul", [ctx.make("Exp", [t], tag="exp_t"), ctx.make("Sub", [t, x], tag="diff")], tag="loss")
    else:
        zero = ctx.const("zero", 0.0, dt)
        v = ctx.make("Mul", [t, ctx.make("Sub", [ctx.make("Log", [t], tag="log_t"), x], tag="diff")], tag="value")
        loss = ctx.make("Where", [ctx.make("Greater", [t, zero], tag="positive", dtype=TensorProto.BOOL), v, zero],
                        tag="loss", dtype=dt)
    if kw["reduction"] == "batchmean":
        shape = ctx.shape()
        if not shape:
            raise ctx.unsupported("reduction='batchmean' of a 0-d input")
        s = ctx.make("ReduceSum", [loss], tag="sum", keepdims=0)
        return ctx.make("Div", [s, ctx.const("batch", float(shape[0]), dt)])
    return _reduced(ctx, loss, kw)


@emits("cosine_similarity", since=11)
def cosine_similarity(ctx: NodeContext) -> Tensor:
    """sum(x1 x2) / sqrt(max(|x1|^2 |x2|^2, eps^2)) along ``dim`` (torch's formula)."""
    kw = ctx.kw(x2=REQUIRED, dim=1, eps=1e-8)
    x1, x2 = _float(ctx, ctx.arg(0, "x1"), "x1"), _float(ctx, kw["x2"], "x2")
    dt = ctx.dtype(x1)
    rank = max(ctx.rank(ctx.arg(0, "x1")), ctx.rank(kw["x2"]))
    axis = int(kw["dim"]) % rank if rank else 0
    # broadcast both first (the norms are of the broadcast operands)
    x1b = ctx.make("Add", [x1, ctx.make("Mul", [x2, ctx.const("zero", 0.0, dt)], tag="x2_zeros")], tag="x1b")
    x2b = ctx.make("Add", [x2, ctx.make("Mul", [x1, ctx.const("zero2", 0.0, dt)], tag="x1_zeros")], tag="x2b")
    dot = ctx.make("ReduceSum", [ctx.make("Mul", [x1b, x2b], tag="prod")], tag="dot", axes=[axis], keepdims=0)
    n1 = ctx.make("ReduceSumSquare", [x1b], tag="n1", axes=[axis], keepdims=0)
    n2 = ctx.make("ReduceSumSquare", [x2b], tag="n2", axes=[axis], keepdims=0)
    eps2 = ctx.const("eps2", float(kw["eps"]) ** 2, dt)
    denom = ctx.make("Sqrt", [ctx.make("Max", [ctx.make("Mul", [n1, n2], tag="n1n2"), eps2], tag="clamped")],
                     tag="denom")
    return ctx.make("Div", [dot, denom])


@emits("huber_loss", "smooth_l1_loss", since=11)
def huber_loss(ctx: NodeContext) -> Tensor:
    """|d| < delta: 0.5 d^2 (/ beta for smooth_l1), else delta (|d| - 0.5 delta) (|d| - 0.5 beta), reduced."""
    if ctx.op == "huber_loss":
        kw = ctx.kw(target=REQUIRED, reduction="mean", delta=1.0, weight=None)
        t, scale = float(kw["delta"]), None
    else:
        kw = ctx.kw(target=REQUIRED, size_average=None, reduce=None, reduction="mean", beta=1.0)
        t, scale = float(kw["beta"]), 1.0 / float(kw["beta"]) if float(kw["beta"]) > 0 else None
    if kw.get("weight") is not None or t <= 0:
        raise ctx.unsupported("a weight, or a threshold <= 0")
    d = ctx.make("Abs", [ctx.make("Sub", [_float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"],
                                                                                        "target")], tag="diff")],
                 tag="abs")
    dt = ctx.dtype(d)
    quad = ctx.make("Mul", [ctx.make("Mul", [d, d], tag="sq"), ctx.const("half", 0.5 * (scale or 1.0), dt)],
                    tag="quadratic")
    lin = ctx.make("Sub", [d, ctx.const("half_t", 0.5 * t, dt)], tag="linear")
    if ctx.op == "huber_loss":
        lin = ctx.make("Mul", [lin, ctx.const("delta", t, dt)], tag="linear_scaled")
    small = ctx.make("Less", [d, ctx.const("t", t, dt)], tag="small", dtype=TensorProto.BOOL)
    return _reduced(ctx, ctx.make("Where", [small, quad, lin], tag="loss", dtype=dt), kw)


@emits("pairwise_distance", since=11)
def pairwise_distance(ctx: NodeContext) -> Tensor:
    """||x1 - x2 + eps||_p over the last dim (p = 1, 2 or inf)."""
    kw = ctx.kw(x2=REQUIRED, p=2.0, eps=1e-6, keepdim=False)
    p = float(kw["p"])
    d = ctx.make("Add", [ctx.make("Sub", [_float(ctx, ctx.arg(0, "x1"), "x1"), _float(ctx, kw["x2"], "x2")],
                                  tag="diff"), ctx.const("eps", float(kw["eps"]))], tag="diff_eps")
    keep = int(bool(kw["keepdim"]))
    if p == 2:
        return ctx.make("ReduceL2", [d], axes=[-1], keepdims=keep)
    if p == 1:
        return ctx.make("ReduceL1", [d], axes=[-1], keepdims=keep)
    if p == float("inf"):
        return ctx.make("ReduceMax", [ctx.make("Abs", [d], tag="abs")], axes=[-1], keepdims=keep)
    raise ctx.unsupported(f"p={kw['p']!r} (1, 2 or inf)")


@emits("poisson_nll_loss", since=11)
def poisson_nll_loss(ctx: NodeContext) -> Tensor:
    """exp(x) - y x (log_input), else x - y log(x + eps); full=False only; reduced."""
    kw = ctx.kw(target=REQUIRED, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None,
                reduction="mean")
    if kw["full"]:
        raise ctx.unsupported("full=True (the Stirling term)")
    x, y = _float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")
    if kw["log_input"]:
        loss = ctx.make("Sub", [ctx.make("Exp", [x], tag="exp"), ctx.make("Mul", [y, x], tag="yx")], tag="loss")
    else:
        log = ctx.make("Log", [ctx.make("Add", [x, ctx.const("eps", float(kw["eps"]))], tag="x_eps")], tag="log")
        loss = ctx.make("Sub", [x, ctx.make("Mul", [y, log], tag="y_log")], tag="loss")
    return _reduced(ctx, loss, kw)


@emits("hinge_embedding_loss", since=11)
def hinge_embedding_loss(ctx: NodeContext) -> Tensor:
    """x where y == 1, max(0, margin - x) where y == -1 (both terms, as torch, for other y), reduced."""
    kw = ctx.kw(target=REQUIRED, margin=1.0, size_average=None, reduce=None, reduction="mean")
    x, y = _float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["target"], "target")
    dt = ctx.dtype(x)
    zero = ctx.const("zero", 0.0, dt)
    hinge = ctx.make("Relu", [ctx.make("Sub", [ctx.const("margin", float(kw["margin"]), dt), x], tag="m_minus_x")],
                     tag="hinge")
    pos = ctx.make("Where", [ctx.make("Equal", [y, ctx.const("one", 1.0, dt)], tag="is_pos", dtype=TensorProto.BOOL),
                             x, zero], tag="pos", dtype=dt)
    neg = ctx.make("Where", [ctx.make("Equal", [y, ctx.const("minus_one", -1.0, dt)], tag="is_neg",
                                      dtype=TensorProto.BOOL), hinge, zero], tag="neg", dtype=dt)
    return _reduced(ctx, ctx.make("Add", [pos, neg], tag="loss"), kw)


@emits("dist", since=11)
def dist(ctx: NodeContext) -> Tensor:
    """||a - b||_p over every element (p = 1, 2 or inf), a 0-d result."""
    kw = ctx.kw(other=REQUIRED, p=2)
    p = float(kw["p"])
    d = ctx.make("Sub", [_float(ctx, ctx.arg(0, "input"), "input"), _float(ctx, kw["other"], "other")], tag="diff")
    op = {1.0: "ReduceL1", 2.0: "ReduceL2"}.get(p)
    if op is not None:
        return ctx.make(op, [d], keepdims=0)
    if p == float("inf"):
        return ctx.make("ReduceMax", [ctx.make("Abs", [d], tag="abs")], keepdims=0)
    raise ctx.unsupported(f"p={kw['p']!r} (1, 2 or inf)")
