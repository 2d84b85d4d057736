"""Calibration data from real sources (qcompiler/calib_data.py, issue 35): .npz, .npy, torch.save
files, a folder of images with declared preprocessing, iterables; the errors name the file or key;
the CLI takes them in compile and report, and every SQNR it prints says which data it was
measured on (and "random" when it was)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qcompiler.calib_data import ImagePreprocess, input_names, load_batches, read_arrays, read_images
from qcompiler.errors import ConfigError
from qcompiler.tools.cli import main

X = (torch.zeros(1, 3, 16, 16),)


class TwoInputs(torch.nn.Module):
    def forward(self, image, mask):
        return image * mask


TWO = (torch.zeros(1, 3, 4, 4), torch.zeros(1, 1, 4, 4))


def _samples(n=6, shape=(3, 16, 16), seed=0):
    return np.random.default_rng(seed).random((n, *shape), dtype=np.float32)


# ----------------------------------------------------------------------------- files


def test_npz_npy_and_torch_files_give_the_same_batches(tmp_path):
    x = _samples()
    np.savez(tmp_path / "a.npz", x)
    np.save(tmp_path / "a.npy", x)
    torch.save(torch.from_numpy(x), tmp_path / "t.pt")
    torch.save((torch.from_numpy(x),), tmp_path / "tuple.pt")
    torch.save([torch.from_numpy(x)], tmp_path / "list.pt")
    torch.save({"input": torch.from_numpy(x)}, tmp_path / "dict.pt")
    torch.save(torch.from_numpy(x), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("a.npz", "a.npy", "t.pt", "tuple.pt", "list.pt", "dict.pt", "legacy.pt"):
        data = load_batches(tmp_path / name, X, batch_size=4)
        assert [b[0].shape[0] for b in data.batches] == [4, 2], name
        assert torch.equal(torch.cat([b[0] for b in data.batches]), torch.from_numpy(x)), name
        assert data.samples == 6 and not data.random and str(tmp_path / name) in data.description


def test_files_keyed_by_input_name_are_ordered_by_the_forward(tmp_path):
    image, mask = torch.rand(5, 3, 4, 4), torch.rand(5, 1, 4, 4)
    names = input_names(TwoInputs())
    assert names == ["image", "mask"]
    torch.save({"mask": mask, "image": image}, tmp_path / "d.pt")
    np.savez(tmp_path / "d.npz", mask=mask.numpy(), image=image.numpy())
    for name in ("d.pt", "d.npz"):
        (batch,) = load_batches(tmp_path / name, TWO, batch_size=8, names=names).batches
        assert torch.equal(batch[0], image) and torch.equal(batch[1], mask), name


def test_a_key_that_names_no_input_is_named(tmp_path):
    torch.save({"image": torch.rand(2, 3, 4, 4), "masc": torch.rand(2, 1, 4, 4)}, tmp_path / "d.pt")
    with pytest.raises(ConfigError, match=r"d\.pt'?: key 'masc' names no model input; the inputs are 'image', 'mask'"):
        load_batches(tmp_path / "d.pt", TWO, names=["image", "mask"])


def test_limit_keeps_the_first_samples(tmp_path):
    x = _samples(10)
    np.save(tmp_path / "a.npy", x)
    data = load_batches(tmp_path / "a.npy", X, batch_size=4, limit=6)
    assert [b[0].shape[0] for b in data.batches] == [4, 2]
    assert torch.equal(torch.cat([b[0] for b in data.batches]), torch.from_numpy(x[:6]))


def test_torch_file_with_a_non_tensor_entry_names_it(tmp_path):
    torch.save({"input": 3}, tmp_path / "n.pt")
    with pytest.raises(ConfigError, match=r"n\.pt'?: entry 'input' is int, not a tensor; save tensors only"):
        read_arrays(tmp_path / "n.pt")


class Custom:
    pass


def test_torch_file_with_pickled_objects_is_refused_by_weights_only(tmp_path):
    torch.save({"input": Custom()}, tmp_path / "obj.pt")
    with pytest.raises(ConfigError, match=r"obj\.pt'?: torch\.load\(weights_only=True\) refuses it .*save plain "
                                          r"tensors"):
        read_arrays(tmp_path / "obj.pt")


def test_torch_file_is_not_read_as_an_npz(tmp_path):
    """Before: ``array 'calib/data.pkl' cannot be a tensor (expected np.ndarray (got bytes))``."""
    torch.save(torch.rand(2, 3, 16, 16), tmp_path / "calib.npz")  # a misleading suffix: the content decides
    (x,) = read_arrays(tmp_path / "calib.npz")
    assert x.shape == (2, 3, 16, 16)


@pytest.mark.parametrize("content, needle", [
    (b"", "empty file"),
    (b"hello", "not an .npz archive, .npy array or torch.save file; write it with np.savez"),
    (b"\x93NUMPY\x01\x00garbage", "cannot read it as an .npy file"),
])
def test_unreadable_files_name_the_file_and_how_to_write_it(tmp_path, content, needle):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        read_arrays(path, where=f"--calib-data {path}")
    assert str(info.value).startswith(f"--calib-data {path}: ") and needle in str(info.value)


def test_object_npy_is_refused(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ConfigError, match="holds Python objects"):
        read_arrays(tmp_path / "o.npy")


def test_shape_mismatch_names_the_input_and_the_expected_shape(tmp_path):
    np.save(tmp_path / "a.npy", _samples(shape=(3, 9, 9)))
    with pytest.raises(ConfigError, match=r"input 0 has shape \(6, 3, 9, 9\); the example input has \(1, 3, 16, 16\)"):
        load_batches(tmp_path / "a.npy", X)


# ----------------------------------------------------------------------------- image folders


def _write_images(folder, sizes, seed=0, fmt="png"):
    rng = np.random.default_rng(seed)
    pixels = []
    for i, (h, w) in enumerate(sizes):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        sub = folder / ("b" if i % 2 else "a")  # ImageFolder-style class folders: searched recursively
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a).save(sub / f"{i:02d}.{fmt}")
        pixels.append(a)
    return pixels


def _reference(a: np.ndarray, resize: int, crop: int, mean, std, bgr: bool, nhwc: bool) -> np.ndarray:
    """The preprocessing spelled out in numpy (Pillow only for the bilinear resize)."""
    h, w = a.shape[:2]
    size = (resize, resize * h // w) if w <= h else (resize * w // h, resize)  # (width, height)
    r = np.asarray(Image.fromarray(a).resize(size, Image.BILINEAR))
    top, left = round((r.shape[0] - crop) / 2), round((r.shape[1] - crop) / 2)
    c = r[top:top + crop, left:left + crop].astype(np.float32)
    if bgr:
        c = c[..., [2, 1, 0]]
    c = (c / np.float32(255) - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return c if nhwc else c.transpose(2, 0, 1)


@pytest.mark.parametrize("bgr, nhwc", [(False, False), (True, False), (True, True)])
def test_image_folder_preprocessing_matches_a_numpy_reference(tmp_path, bgr, nhwc):
    sizes = [(30, 40), (40, 30), (24, 24), (50, 37)]
    pixels = _write_images(tmp_path / "imgs", sizes)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pre = ImagePreprocess(resize=20, crop=16, mean=mean, std=std, channel_order="bgr" if bgr else "rgb",
                          layout="nhwc" if nhwc else "nchw")
    got = read_images(tmp_path / "imgs", pre)
    order = sorted(range(len(sizes)), key=lambda i: ("b" if i % 2 else "a", i))  # sorted by path
    want = np.stack([_reference(pixels[i], 20, 16, mean, std, bgr, nhwc) for i in order])
    assert got.dtype == torch.float32 and got.shape == ((4, 16, 16, 3) if nhwc else (4, 3, 16, 16))
    np.testing.assert_array_equal(got.numpy(), want)
    if bgr:  # the channels really are reversed: the rgb run differs exactly by the flip
        rgb = read_images(tmp_path / "imgs", ImagePreprocess(resize=20, crop=16, layout=pre.layout))
        axis = 3 if nhwc else 1
        raw = read_images(tmp_path / "imgs", ImagePreprocess(resize=20, crop=16, channel_order="bgr", layout=pre.layout))
        assert torch.equal(raw, rgb.flip(axis)) and not torch.equal(raw, rgb)


def test_exact_resize_gray_and_raw_pixels(tmp_path):
    (a,) = _write_images(tmp_path / "g", [(10, 14)])
    got = read_images(tmp_path / "g", ImagePreprocess(resize=(6, 8), channel_order="gray", pixel_max=255.0))
    gray = np.asarray(Image.fromarray(a).convert("L").resize((8, 6), Image.BILINEAR), dtype=np.float32)
    assert got.shape == (1, 1, 6, 8)
    np.testing.assert_array_equal(got.numpy()[0, 0], gray)


def test_image_folder_as_batches(tmp_path):
    _write_images(tmp_path / "imgs", [(20, 20)] * 5)
    data = load_batches(tmp_path / "imgs", X, batch_size=2, preprocess=ImagePreprocess(crop=16))
    assert [b[0].shape for b in data.batches] == [(2, 3, 16, 16)] * 2 + [(1, 3, 16, 16)]
    assert data.description == f"5 images in {tmp_path / 'imgs'}"
    assert len(load_batches(tmp_path / "imgs", X, preprocess=ImagePreprocess(crop=16), limit=3).batches[0][0]) == 3


def test_image_folder_errors_name_the_image(tmp_path):
    _write_images(tmp_path / "mixed", [(20, 20), (24, 30)])
    with pytest.raises(ConfigError, match=r"image '.*01\.png' gives shape \(3, 24, 30\), image '.*00\.png' gave "
                                          r"\(3, 20, 20\); give a crop"):
        read_images(tmp_path / "mixed", ImagePreprocess())
    with pytest.raises(ConfigError, match=r"image '.*00\.png': is 20x20 \(width x height\) after resizing, smaller than the "
                                          r"crop 28x28"):
        read_images(tmp_path / "mixed", ImagePreprocess(crop=28))
    (tmp_path / "mixed" / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ConfigError, match=r"cannot read image '.*broken\.jpg'"):
        read_images(tmp_path / "mixed", ImagePreprocess(crop=16))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds no image files"):
        read_images(tmp_path / "empty", ImagePreprocess())
    with pytest.raises(ConfigError, match="needs its preprocessing"):
        load_batches(tmp_path / "mixed", X)


@pytest.mark.parametrize("kwargs, needle", [
    ({"mean": (0.1, 0.2)}, "give 1 value or 3"),
    ({"std": (0.0,)}, "divides by zero"),
    ({"channel_order": "rbg"}, "one of rgb, bgr, gray"),
    ({"layout": "chw"}, "one of nchw, nhwc"),
    ({"resize": 0}, "give a positive int N or (height, width)"),
    ({"pixel_max": 2.0}, "1 (pixels scaled to [0, 1]) or 255"),
])
def test_bad_preprocessing_is_a_config_error(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        ImagePreprocess(**kwargs)
    assert needle in str(info.value)


# ----------------------------------------------------------------------------- iterables


def test_dataloader_of_inputs_and_labels(tmp_path):
    ds = torch.utils.data.TensorDataset(torch.rand(10, 3, 16, 16), torch.arange(10))
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    data = load_batches(loader, X, inputs_of=lambda b: b[0])
    assert [b[0].shape[0] for b in data.batches] == [4, 4, 2] and data.samples == 10
    assert "3 batches (10 samples) from a DataLoader" == data.description
    with pytest.raises(ConfigError, match="batch 0: the model takes 1 inputs, got 2") as info:
        load_batches(loader, X)
    assert "inputs_of=lambda b: b[0]" in " ".join(info.value.__notes__)
    assert len(load_batches(loader, X, inputs_of=lambda b: b[0], limit=2).batches) == 2


def test_tensor_source_is_cut_into_batches():
    data = load_batches(torch.rand(5, 3, 16, 16), X, batch_size=2)
    assert [b[0].shape[0] for b in data.batches] == [2, 2, 1]
    with pytest.raises(ConfigError, match="got int"):
        load_batches(3, X)


# ----------------------------------------------------------------------------- command line


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


HYB = ("zoo:hybrid", "--input-shape", "1,3,16,16")


def test_report_takes_calib_data_and_says_what_it_measured_on(capsys, tmp_path):
    torch.save(torch.rand(4, 3, 16, 16), tmp_path / "calib.pt")
    code, out, err = _run(capsys, "report", *HYB, "--calib-data", tmp_path / "calib.pt", "--calib-batch-size", "2",
                          "--advise", "0", "--out", tmp_path / "qa")
    assert code == 0, err
    assert f"measured on the calibration data, 4 samples from {tmp_path / 'calib.pt'}: every metric" in out
    assert "random" not in out
    assert (tmp_path / "qa" / "report.html").exists()


def test_report_on_random_data_says_random(capsys, tmp_path):
    code, out, err = _run(capsys, "report", *HYB, "--calib-random", "2", "--advise", "0", "--out", tmp_path / "qa")
    assert code == 0, err
    assert "measured on random data (2 seeded batches of uniform noise, --calib-random; not real inputs" in out


def test_compile_on_an_image_folder(capsys, tmp_path):
    _write_images(tmp_path / "imgs", [(30, 40), (40, 30), (20, 20)])
    code, out, err = _run(capsys, "compile", *HYB, "--calib-images", tmp_path / "imgs", "--resize", "18",
                          "--crop", "16", "--mean", "0.5", "--std", "0.25", "--channel-order", "bgr",
                          "--out", tmp_path / "o")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("output SQNR vs float on "))
    assert line.startswith(f"output SQNR vs float on the calibration data, 3 images in {tmp_path / 'imgs'}: ")
    assert (tmp_path / "o" / "model.qc").exists()


def test_compile_on_random_data_says_random(capsys, tmp_path):
    code, out, err = _run(capsys, "compile", *HYB, "--calib-random", "1", "--out", tmp_path / "o")
    assert code == 0, err
    assert "output SQNR vs float on random data (1 seeded batches of uniform noise, --calib-random; not real " \
           "inputs: give --calib-data FILE or --calib-images DIR): " in out
    assert "calibration inputs" not in out


@pytest.mark.parametrize("flags, message", [
    (("--resize", "256"), "error: --resize is image preprocessing: it applies to --calib-images DIR only"),
    (("--calib-random", "2", "--mean", "0.5"), "error: --mean is image preprocessing"),
    (("--calib-images", "d", "--mean", "0.1,0.2"), "error: --mean has 2 values; give 1 or 3 (one per rgb channel"),
    (("--calib-images", "d", "--std", "0"), "error: --std has a 0"),
    (("--calib-images", "d", "--crop", "2,3,4"), "malformed size '2,3,4': expected N or HEIGHT,WIDTH"),
    (("--calib-random", "2", "--calib-limit", "3"), "error: --calib-limit applies to --calib-data or --calib-images"),
    (("--calib-data", "a.npz", "--calib-images", "d"), "not allowed with argument"),
])
@pytest.mark.parametrize("command", ["compile", "report"])
def test_calibration_flag_mistakes_are_usage_errors(capsys, tmp_path, monkeypatch, command, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "a.npz").write_bytes(b"")
    code, out, err = _run(capsys, command, *HYB, *flags, "--out", tmp_path / "o")
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_calib_images_error_names_the_folder(capsys, tmp_path):
    (tmp_path / "none").mkdir()
    code, out, err = _run(capsys, "compile", *HYB, "--calib-images", tmp_path / "none", "--out", tmp_path / "o")
    assert code == 2
    assert err.startswith(f"error: --calib-images {tmp_path / 'none'}: holds no image files")
