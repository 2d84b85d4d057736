"""QTensor: quantize/dequantize arithmetic, accessors, views, assignment, serialization, errors."""

import math
import pickle
import pickletools
import zipfile

import pytest
import torch

from qcompiler.errors import ArtifactError, ConfigError
from qcompiler.quantization.qtensor import (
    QDType,
    QTensor,
    _rebuild_qtensor,
    qint8,
    qint16,
    qint32,
    quantize_per_channel,
    quantize_per_tensor,
    quint8,
)

ALL_DTYPES = [qint8, quint8, qint16, qint32]
STORAGE = {qint8: torch.int8, quint8: torch.uint8, qint16: torch.int16, qint32: torch.int32}


def ints(qt):
    return qt.int_repr().tolist()


def per_channel_example():
    # columns: scale 0.5/zp 0, scale 0.25/zp -4, scale 2/zp 1
    x = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.3, 10.0]])
    return quantize_per_channel(x, [0.5, 0.25, 2.0], [0, -4, 1], axis=1, dtype=qint8)


# --------------------------------------------------------------------------- arithmetic


def test_per_tensor_values_and_clamping():
    x = torch.tensor([-1.0, -0.3, 0.0, 0.2, 0.3, 1.0, 100.0, -100.0])
    qt = quantize_per_tensor(x, 0.5, 3, qint8)
    # x / 0.5 = [-2, -0.6, 0, 0.4, 0.6, 2, 200, -200] -> round, +3, clamp to [-128, 127]
    assert ints(qt) == [1, 2, 3, 3, 4, 5, 127, -128]
    assert qt.int_repr().dtype == torch.int8
    assert qt.dequantize().tolist() == [-1.0, -0.5, 0.0, 0.0, 0.5, 1.0, 62.0, -65.5]
    assert qt.dequantize().dtype == torch.float32


def test_round_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])
    assert ints(quantize_per_tensor(x, 1.0, 0, qint8)) == [0, 2, 2, 0, -2, -2, 4]


def test_every_dtype_range_and_storage():
    qt = quantize_per_tensor(torch.tensor([-200.0, -128.0, 0.0, 127.0, 128.0, 300.0]), 1.0, 128, "quint8")
    assert ints(qt) == [0, 0, 128, 255, 255, 255]
    assert qt.int_repr().dtype == torch.uint8 and qt.dtype is quint8
    qt = quantize_per_tensor(torch.tensor([40000.0, -40000.0, 1.0]), 1.0, 0, qint16)
    assert ints(qt) == [32767, -32768, 1] and qt.int_repr().dtype == torch.int16
    x = torch.tensor([3e9, -3e9, 5.0, math.inf, -math.inf])
    qt = quantize_per_tensor(x, 1.0, 10, qint32)
    assert ints(qt) == [2**31 - 1, -(2**31), 15, 2**31 - 1, -(2**31)]
    assert qt.int_repr().dtype == torch.int32


def test_scale_as_tensor_and_float64_input():
    scale = torch.tensor(0.25)  # e.g. an observer's calculate_scale()
    qt = quantize_per_tensor(torch.tensor([1.0, -0.5], dtype=torch.float64), scale, 0, qint8)
    assert ints(qt) == [4, -2] and qt.q_scale() == 0.25


def test_per_channel_values():
    qt = per_channel_example()
    # col0: 1/0.5=2, -2/0.5=-4; col1: 1/0.25=4-4=0, 0.3/0.25=1.2->1-4=-3;
    # col2: 1/2=0.5->0 (tie to even)+1=1, 10/2=5+1=6
    assert ints(qt) == [[2, 0, 1], [-4, -3, 6]]
    assert qt.dequantize().tolist() == [[1.0, 1.0, 0.0], [-2.0, 0.25, 10.0]]


def test_per_channel_axis0_and_negative_axis():
    x = torch.tensor([[0.5, 2.5], [0.25, -0.75]])
    qt = quantize_per_channel(x, torch.tensor([1.0, 0.5]), torch.tensor([1, -1]), 0, qint8)
    assert ints(qt) == [[1, 3], [-1, -3]]
    qt = quantize_per_channel(x.t(), [1.0, 0.5], [1, -1], -1, qint8)
    assert qt.q_per_channel_axis() == 1
    assert ints(qt) == [[1, -1], [3, -3]]


# --------------------------------------------------------------------------- accessors


def test_per_tensor_accessors():
    qt = quantize_per_tensor(torch.zeros(2, 3), 0.5, 3, qint8)
    assert qt.q_scale() == 0.5 and isinstance(qt.q_scale(), float)
    assert qt.q_zero_point() == 3 and isinstance(qt.q_zero_point(), int)
    assert qt.qscheme() == "per_tensor_affine"
    assert qt.dtype is qint8 and qt.dtype == "qint8" and isinstance(qt.dtype, QDType)
    assert qt.shape == torch.Size([2, 3]) and qt.size() == torch.Size([2, 3]) and qt.size(1) == 3
    assert qt.dim() == 2 and qt.numel() == 6 and qt.is_quantized is True
    assert quantize_per_tensor(torch.zeros(1), 1.0, 0, qint8).qscheme() == "per_tensor_symmetric"
    assert quantize_per_tensor(torch.zeros(1), 1.0, 128, quint8).qscheme() == "per_tensor_symmetric"
    assert quantize_per_tensor(torch.zeros(1), 1.0, 0, quint8).qscheme() == "per_tensor_affine"
    assert quantize_per_tensor(torch.tensor([0.7]), 0.5, 0, qint8)[0].item() == 0.5
    for name, instead in [
        ("q_per_channel_scales", "q_scale"),
        ("q_per_channel_zero_points", "q_zero_point"),
        ("q_per_channel_axis", "q_scale"),
    ]:
        with pytest.raises(ConfigError, match=instead):
            getattr(qt, name)()


def test_per_channel_accessors():
    qt = per_channel_example()
    assert qt.q_per_channel_scales().tolist() == [0.5, 0.25, 2.0]
    assert qt.q_per_channel_scales().dtype == torch.float64
    assert qt.q_per_channel_zero_points().tolist() == [0, -4, 1]
    assert qt.q_per_channel_zero_points().dtype == torch.int64
    assert qt.q_per_channel_axis() == 1
    assert qt.qscheme() == "per_channel_affine"
    sym = quantize_per_channel(torch.zeros(2, 2), [1.0, 2.0], [0, 0], 0, qint8)
    assert sym.qscheme() == "per_channel_symmetric"
    # python floats stay exact doubles
    assert quantize_per_channel(torch.zeros(2), [0.1, 0.01], [0, 0], 0, qint8).q_per_channel_scales().tolist() == [
        0.1,
        0.01,
    ]
    with pytest.raises(ConfigError, match="q_scale.*q_per_channel_scales"):
        qt.q_scale()
    with pytest.raises(ConfigError, match="q_zero_point.*q_per_channel_zero_points"):
        qt.q_zero_point()


def test_repr():
    qt = quantize_per_tensor(torch.tensor([[1.0, -2.0], [0.5, 3.0]]), 0.5, 3, qint8)
    r = repr(qt)
    assert r.startswith("QTensor([[ 1.0000, -2.0000],\n         [ 0.5000,  3.0000]]")
    for part in ["size=(2, 2)", "dtype=qint8", "quantization_scheme=per_tensor_affine", "scale=0.5", "zero_point=3"]:
        assert part in r
    r = repr(per_channel_example())
    for part in ["dtype=qint8", "per_channel_affine", "scale=tensor([0.5000, 0.2500, 2.0000]", "axis=1"]:
        assert part in r
    assert "size=(0, 3)" in repr(quantize_per_tensor(torch.empty(0, 3), 1.0, 0, qint16))
    assert "size=()" in repr(quantize_per_tensor(torch.tensor(1.0), 1.0, 0, qint32))


def test_equal():
    a = quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, qint8)
    assert a.equal(a.clone())
    assert not a.equal(quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.25, 0, qint8))
    assert not a.equal(quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 1, qint8))
    assert not a.equal(quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.5, 0, qint16))
    assert not a.equal(quantize_per_tensor(torch.tensor([1.0, 2.5]), 0.5, 0, qint8))
    assert not a.equal(a.int_repr())
    p = per_channel_example()
    assert p.equal(p.clone()) and not p.equal(p.transpose(0, 1))


# --------------------------------------------------------------------------- views


def test_per_tensor_indexing_keeps_qparams_and_shares_memory():
    qt = quantize_per_tensor(torch.arange(6.0).view(2, 3), 0.5, 3, qint8)
    row = qt[1]
    assert isinstance(row, QTensor) and row.q_scale() == 0.5 and row.q_zero_point() == 3
    assert row.dequantize().tolist() == [3.0, 4.0, 5.0]
    assert qt[0, 2].shape == () and qt[0, 2].item() == 2.0
    assert qt[:, 1:].dequantize().tolist() == [[1.0, 2.0], [4.0, 5.0]]
    row[0] = 0.0  # a view, like torch
    assert qt.int_repr()[1, 0].item() == 3


PC_INDICES = [
    # (index, expected axis or None for per-tensor, expected channel selection)
    (0, 0, [0, 1, 2]),
    (torch.tensor(1), 0, [0, 1, 2]),
    ((slice(None), 1), None, [1]),
    ((slice(None), -1), None, [2]),
    ((0, 2), None, [2]),
    ((slice(None), slice(1, 3)), 1, [1, 2]),
    ((slice(None), slice(None, None, 2)), 1, [0, 2]),
    ((Ellipsis, 0), 1, [0, 1, 2]),
    ((Ellipsis, None), 1, [0, 1, 2]),
    ((None, 0), 1, [0, 1, 2]),
    ((None, slice(None), slice(0, 1)), 2, [0]),
    ((slice(None), [2, 0]), 1, [2, 0]),
    ((slice(None), torch.tensor([True, False, True])), 1, [0, 2]),
    ([1, 0], 1, [0, 1, 2]),
    ((0, Ellipsis, [0, 2]), 0, [0, 1, 2]),
    ((slice(None), slice(None), 1), 1, [0, 1, 2]),
]


@pytest.mark.parametrize("idx,axis,channels", PC_INDICES, ids=[repr(i[0]) for i in PC_INDICES])
def test_per_channel_indexing(idx, axis, channels):
    torch.manual_seed(0)
    scales = torch.tensor([0.1, 0.02, 0.5], dtype=torch.float64)
    zps = torch.tensor([-3, 0, 7])
    qt = quantize_per_channel(torch.randn(2, 3, 4), scales, zps, axis=1, dtype=qint8)
    out = qt[idx]
    assert torch.equal(out.int_repr(), qt.int_repr()[idx])
    assert torch.equal(out.dequantize(), qt.dequantize()[idx])
    if axis is None:  # channel axis removed -> per-tensor with that channel's qparams
        (c,) = channels
        assert out.qscheme().startswith("per_tensor")
        assert out.q_scale() == scales[c].item() and out.q_zero_point() == zps[c].item()
    else:
        assert out.q_per_channel_axis() == axis
        assert out.q_per_channel_scales().tolist() == scales[channels].tolist()
        assert out.q_per_channel_zero_points().tolist() == zps[channels].tolist()


@pytest.mark.parametrize("idx", [([0, 1], [0, 1]), (slice(None), torch.tensor([[0, 1], [1, 2]]))])
def test_per_channel_indexing_that_mixes_the_channel_axis_raises(idx):
    qt = quantize_per_channel(torch.zeros(2, 3, 4), [1.0, 1.0, 1.0], [0, 0, 0], 1, qint8)
    with pytest.raises(ConfigError, match="per-channel"):
        qt[idx]


def test_transpose_permute_contiguous_clone():
    torch.manual_seed(0)
    qt = quantize_per_channel(torch.randn(2, 3, 4), [0.1, 0.2, 0.3], [1, 2, 3], 1, qint8)
    for (a, b), axis in [((0, 1), 0), ((1, 2), 2), ((0, 2), 1), ((-1, -2), 2)]:
        t = qt.transpose(a, b)
        assert t.q_per_channel_axis() == axis
        assert torch.equal(t.dequantize(), qt.dequantize().transpose(a, b))
        assert t.q_per_channel_scales().tolist() == qt.q_per_channel_scales().tolist()
    for dims, axis in [((2, 0, 1), 2), ([1, 2, 0], 0), ((0, 1, 2), 1)]:
        p = qt.permute(*dims) if isinstance(dims, tuple) else qt.permute(dims)
        assert p.q_per_channel_axis() == axis
        assert torch.equal(p.dequantize(), qt.dequantize().permute(*dims))
    c = qt.transpose(0, 2).contiguous()
    assert c.int_repr().is_contiguous() and c.q_per_channel_axis() == 1
    assert c.equal(qt.transpose(0, 2))
    k = qt.clone()
    assert k.equal(qt)
    k[0] = 100.0
    assert not k.equal(qt)  # the clone owns its integers

    pt = quantize_per_tensor(torch.arange(6.0), 1.0, 2, quint8)
    for v in (pt.reshape(2, 3), pt.view(3, 2), pt.reshape((3, 2)), pt.view(2, 3).transpose(0, 1), pt.permute(0)):
        assert v.q_scale() == 1.0 and v.q_zero_point() == 2 and v.dtype is quint8
    assert pt.reshape(2, 3).dequantize().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(ConfigError, match="reshape.*per-channel"):
        qt.reshape(6, 4)
    with pytest.raises(ConfigError, match="view.*per-channel"):
        qt.view(-1)


# --------------------------------------------------------------------------- assignment


def test_assignment_requantizes_per_tensor():
    qt = quantize_per_tensor(torch.zeros(4), 0.5, 0, qint8)
    qt[1] = 1.26  # 2.52 -> 3
    qt[0] = 100  # 200 -> clamped to 127
    qt[2:] = torch.tensor([-0.75, 0.25])  # -1.5 -> -2, 0.5 -> 0
    assert ints(qt) == [127, 3, -2, 0]
    # a QTensor with other qparams: requantized from its dequantized values
    other = quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.25, 5, qint16)
    qt[:2] = other
    assert ints(qt) == [2, 4, -2, 0]
    # same qparams: the integers are copied as they are
    same = quantize_per_tensor(torch.tensor([-3.0]), 0.5, 0, qint8)
    qt[3] = same[0]
    assert ints(qt) == [2, 4, -2, -6]
    with pytest.raises(ConfigError, match="value"):
        qt[0] = float("nan")


def test_assignment_requantizes_per_channel():
    qt = quantize_per_channel(torch.zeros(2, 3), [0.5, 0.25, 2.0], [0, -4, 1], 1, qint8)
    qt[1] = torch.tensor([1.0, 1.0, 1.0])  # [2, 4-4, 0.5->0 +1]
    assert ints(qt) == [[0, -4, 1], [2, 0, 1]]
    qt[:, 2] = 10.0  # 5 + 1 in both rows
    qt[0, 1] = 0.3  # 1.2 -> 1 - 4
    assert ints(qt) == [[0, -3, 6], [2, 0, 6]]
    qt[:, [2, 0]] = torch.tensor([[4.0, 1.5]])  # col2: 2+1, col0: 3
    assert ints(qt) == [[3, -3, 3], [3, 0, 3]]
    qt[0] = quantize_per_tensor(torch.tensor([1.0, 1.0, 1.0]), 0.1, 0, qint8)
    assert ints(qt)[0] == [2, 0, 1]
    # assignment through a view of the channel axis uses that view's channels
    view = qt[:, 1:]
    view[1] = torch.tensor([0.5, 4.0])
    assert ints(qt)[1] == [3, -2, 3]


# --------------------------------------------------------------------------- serialization


def _examples(dtype):
    lo = -8.0 if dtype is not quint8 else 0.0
    x = torch.linspace(lo, 8.0, 24).view(2, 3, 4)
    zp = 3 if dtype is not quint8 else 130
    yield quantize_per_tensor(x, 0.07, zp, dtype)
    yield quantize_per_channel(x, [0.1, 0.05, 0.3], [zp, 0 if dtype is not quint8 else 1, zp], 1, dtype)
    yield quantize_per_channel(x, [0.1, 0.05, 0.3], [zp, zp, zp], 1, dtype).transpose(0, 2)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_save_load_weights_only_roundtrip(tmp_path, dtype):
    for i, qt in enumerate(_examples(dtype)):
        path = tmp_path / f"qt{i}.pt"
        torch.save({"w": qt, "n": 1}, path)
        loaded = torch.load(path, weights_only=True)["w"]
        assert isinstance(loaded, QTensor) and loaded.equal(qt)
        assert loaded.int_repr().dtype == STORAGE[dtype]
        assert loaded.int_repr().stride() == qt.int_repr().stride()
        assert loaded.qscheme() == qt.qscheme()
        if qt.qscheme().startswith("per_channel"):
            assert loaded.q_per_channel_axis() == qt.q_per_channel_axis()
        else:
            assert loaded.q_scale() == qt.q_scale() and loaded.q_zero_point() == qt.q_zero_point()
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []


def test_checkpoint_holds_only_allowlisted_globals(tmp_path):
    path = tmp_path / "qt.pt"
    torch.save([quantize_per_tensor(torch.ones(3), 0.5, 0, qint8), per_channel_example()], path)
    with zipfile.ZipFile(path) as zf:
        (pkl,) = [n for n in zf.namelist() if n.endswith("data.pkl")]
        data = zf.read(pkl)
    globals_ = {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    ours = {g for g in globals_ if not g.startswith(("torch", "collections"))}
    assert ours == {"qcompiler.quantization.qtensor _rebuild_qtensor"}


def test_plain_pickle_and_deepcopy():
    import copy

    qt = per_channel_example()
    assert pickle.loads(pickle.dumps(qt)).equal(qt)
    dc = copy.deepcopy(qt)
    assert dc.equal(qt) and dc.int_repr().data_ptr() != qt.int_repr().data_ptr()


def test_rebuild_rejects_bad_checkpoints():
    q = torch.zeros(2, dtype=torch.int8)
    with pytest.raises(ArtifactError, match="version"):
        _rebuild_qtensor(99, q, "qint8", 1.0, 0, None)
    with pytest.raises(ArtifactError, match="dtype"):
        _rebuild_qtensor(1, q, "quint8", 1.0, 0, None)
    with pytest.raises(ArtifactError, match="scale"):
        _rebuild_qtensor(1, q, "qint8", -1.0, 0, None)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("dtype", ["int8", torch.qint8, torch.int8, None, "QINT8"])
def test_unknown_dtype(dtype):
    for call in (
        lambda: quantize_per_tensor(torch.zeros(2), 1.0, 0, dtype),
        lambda: quantize_per_channel(torch.zeros(2), [1.0, 1.0], [0, 0], 0, dtype),
    ):
        with pytest.raises(ConfigError, match=r"dtype.*allowed: qint8, quint8, qint16, qint32"):
            call()


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e40, "1", True])
def test_bad_scale(scale):
    with pytest.raises(ConfigError, match="scale"):
        quantize_per_tensor(torch.zeros(2), scale, 0, qint8)


@pytest.mark.parametrize("scales", [[1.0, 0.0], [1.0, float("nan")], [-1.0, 1.0], [1.0, 1e-50]])
def test_bad_per_channel_scales(scales):
    with pytest.raises(ConfigError, match="scales"):
        quantize_per_channel(torch.zeros(3, 2), scales, [0, 0], 1, qint8)


def test_scales_and_zero_points_length():
    with pytest.raises(ConfigError, match="scales has 3 entries.*2 channels along axis 1"):
        quantize_per_channel(torch.zeros(3, 2), [1.0, 1.0, 1.0], [0, 0], 1, qint8)
    with pytest.raises(ConfigError, match="zero_points has 1 entries"):
        quantize_per_channel(torch.zeros(3, 2), [1.0, 1.0], [0], 1, qint8)
    with pytest.raises(ConfigError, match="scales must be a 1-D"):
        quantize_per_channel(torch.zeros(3, 2), torch.ones(2, 1), [0, 0], 1, qint8)
    with pytest.raises(ConfigError, match="zero_points must be a 1-D integer"):
        quantize_per_channel(torch.zeros(3, 2), [1.0, 1.0], [0.0, 0.5], 1, qint8)


@pytest.mark.parametrize("axis", [2, -3, 1.0, None])
def test_bad_axis(axis):
    with pytest.raises(ConfigError, match="axis"):
        quantize_per_channel(torch.zeros(3, 2), [1.0, 1.0], [0, 0], axis, qint8)


@pytest.mark.parametrize(
    "dtype,zp", [(qint8, 128), (qint8, -129), (quint8, -1), (quint8, 256), (qint16, 40000), (qint32, 2**31)]
)
def test_zero_point_out_of_range(dtype, zp):
    with pytest.raises(ConfigError, match=f"zero_point {zp} is outside the {dtype.value} range"):
        quantize_per_tensor(torch.zeros(2), 1.0, zp, dtype)
    with pytest.raises(ConfigError, match=f"zero_points {zp} is outside"):
        quantize_per_channel(torch.zeros(2), [1.0, 1.0], [0 if dtype is not quint8 else 1, zp], 0, dtype)


@pytest.mark.parametrize("zp", [0.5, "0", None, torch.tensor(1.0)])
def test_zero_point_not_an_integer(zp):
    with pytest.raises(ConfigError, match="zero_point must be an integer"):
        quantize_per_tensor(torch.zeros(2), 1.0, zp, qint8)


def test_bad_input_and_constructor():
    with pytest.raises(ConfigError, match="x contains NaN"):
        quantize_per_tensor(torch.tensor([1.0, float("nan")]), 1.0, 0, qint8)
    with pytest.raises(ConfigError, match="x must be a torch.Tensor"):
        quantize_per_tensor([1.0], 1.0, 0, qint8)
    with pytest.raises(ConfigError, match="int_repr"):
        QTensor(torch.zeros(2), 1.0, 0)
    with pytest.raises(ConfigError, match="int_repr"):
        QTensor(torch.zeros(2, dtype=torch.int64), 1.0, 0)
    qt = QTensor(torch.tensor([[1, 2]], dtype=torch.uint8), [0.5, 1.0], [0, 1], axis=1)
    assert qt.dtype is quint8 and qt.dequantize().tolist() == [[0.5, 1.0]]
    with pytest.raises(ConfigError, match="zero_point"):
        QTensor(torch.tensor([1], dtype=torch.uint8), 1.0, -1)
