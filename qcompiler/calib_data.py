"""Calibration and evaluation data from real sources, as the batches qcompiler takes.

A source is one of:

- an ``.npz`` file: one array per positional model input (``np.savez(path, x0, x1)``, or
  ``np.savez(path, name=x)`` with the forward's parameter names), samples along the first axis;
- an ``.npy`` file: one array, the one input of a one-input model (``np.save(path, x)``);
- a ``torch.save`` file, read with ``torch.load(weights_only=True)`` (never runs pickled code):
  a tensor, a tuple/list of tensors (one per input) or a dict ``{input name: tensor}``;
- a folder of images (searched recursively, sorted by path), turned into one float32 input
  by an :class:`ImagePreprocess` (resize, center crop, scale, mean/std, channel order, layout);
- in the API, a tensor or numpy array of samples, or any iterable of batches (a list, a
  ``torch.utils.data.DataLoader``), each batch a tensor or a tuple/list of the inputs.

:func:`load_batches` turns any of them into a :class:`CalibData`: the batches, checked against
the example inputs (qcompiler.batches.check_inputs) so a wrong shape or dtype is reported
before any work, and a description of the data ("12 images in calib/"), which every printed
SQNR quotes so a number measured on random data is never mistaken for one on real data.
Errors are ConfigErrors naming the file, key or image and saying how to fix it.
"""

from __future__ import annotations

import inspect
import pickle
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from qcompiler.batches import as_args, check_inputs, input_signature
from qcompiler.errors import ConfigError

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty zip (np.savez of nothing)
PICKLE_MAGIC = b"\x80"  # torch.save(..., _use_new_zipfile_serialization=False): a bare pickle
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
CHANNEL_ORDERS = ("rgb", "bgr", "gray")
LAYOUTS = ("nchw", "nhwc")
PIXEL_MAXES = (1.0, 255.0)
HOW_TO_WRITE = ("write it with np.savez(path, input0, input1, ...), np.save(path, x) for a one-input model, "
                "or torch.save(x | (x0, x1) | {'name': x}, path)")

Size = Union[int, tuple[int, int]]


@dataclass(frozen=True)
class CalibData:
    """Batches ready for ``calib_data=`` and what they are, for the messages quoting a measurement."""

    batches: list
    description: str
    samples: int
    random: bool = False


# ----------------------------------------------------------------------------- image preprocessing


def _size(value: Optional[Size], name: str) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    sizes = (value,) if isinstance(value, int) else tuple(value)
    if len(sizes) not in (1, 2) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ConfigError(f"ImagePreprocess {name}={value!r}: give a positive int N or (height, width)")
    return sizes


@dataclass(frozen=True)
class ImagePreprocess:
    """The preprocessing a deployment applies to an image, in this order:

    1. ``resize``: N scales the shorter side to N (keeping the aspect ratio), (H, W) resizes to
       exactly that; bilinear (Pillow). None: keep the size.
    2. ``crop``: N or (H, W) cut from the center (N: a square). None: no crop.
    3. ``channel_order``: "rgb", "bgr" (channels reversed, as OpenCV reads images) or "gray" (one channel).
    4. ``pixel_max``: 1.0 scales the 0..255 pixels to [0, 1]; 255.0 keeps them as read.
    5. ``mean`` / ``std``: one value, or one per channel in the order of step 3, in the units of
       step 4: ``(x - mean) / std``. None: 0 and 1.
    6. ``layout``: "nchw" (channels first, PyTorch's) or "nhwc".

    Calling it on a PIL image returns a float32 array, CHW or HWC (no batch axis).
    """

    resize: Optional[Size] = None
    crop: Optional[Size] = None
    mean: Optional[Sequence[float]] = None
    std: Optional[Sequence[float]] = None
    channel_order: str = "rgb"
    layout: str = "nchw"
    pixel_max: float = 1.0
    _checked: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        resize, crop = _size(self.resize, "resize"), _size(self.crop, "crop")
        if self.channel_order not in CHANNEL_ORDERS:
            raise ConfigError(f"ImagePreprocess channel_order={self.channel_order!r}: one of {', '.join(CHANNEL_ORDERS)}")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"ImagePreprocess layout={self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.pixel_max not in PIXEL_MAXES:
            raise ConfigError(f"ImagePreprocess pixel_max={self.pixel_max!r}: 1 (pixels scaled to [0, 1]) or 255 "
                              "(pixels as read)")
        channels = 1 if self.channel_order == "gray" else 3
        stats = []
        for name, values, default in (("mean", self.mean, 0.0), ("std", self.std, 1.0)):
            values = [default] if values is None else list(values)
            if len(values) not in (1, channels):
                raise ConfigError(f"ImagePreprocess {name}={self.mean if name == 'mean' else self.std!r}: give 1 value "
                                  f"or {channels} (one per {self.channel_order} channel)")
            if name == "std" and any(v == 0 for v in values):
                raise ConfigError(f"ImagePreprocess std={self.std!r}: a standard deviation of 0 divides by zero")
            stats.append(np.asarray(values, dtype=np.float32))
        object.__setattr__(self, "_checked", (resize, crop, stats[0], stats[1]))

    def __call__(self, image, where: str = "image") -> np.ndarray:
        from PIL import Image

        resize, crop, mean, std = self._checked
        image = image.convert("L" if self.channel_order == "gray" else "RGB")
        if resize is not None:
            w, h = image.size
            if len(resize) == 2:
                size = (resize[1], resize[0])
            elif w <= h:
                size = (resize[0], int(resize[0] * h / w))
            else:
                size = (int(resize[0] * w / h), resize[0])
            image = image.resize(size, Image.BILINEAR)
        if crop is not None:
            ch, cw = (crop[0], crop[0]) if len(crop) == 1 else crop
            w, h = image.size
            if ch > h or cw > w:
                raise ConfigError(f"{where}: is {w}x{h} (width x height) after resizing, smaller than the crop "
                                  f"{cw}x{ch}; resize it to at least the crop size first")
            top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
            image = image.crop((left, top, left + cw, top + ch))
        x = np.asarray(image, dtype=np.float32)
        x = x[:, :, None] if x.ndim == 2 else x
        if self.channel_order == "bgr":
            x = x[:, :, ::-1]
        if self.pixel_max == 1.0:
            x = x / np.float32(255.0)
        x = (x - mean) / std
        if self.layout == "nchw":
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x, dtype=np.float32)


def image_files(folder: Path, where: str) -> list[Path]:
    """The image files under ``folder`` (recursively, by suffix), sorted by path."""
    if not folder.is_dir():
        raise ConfigError(f"{where}: is not a folder" if folder.exists() else f"{where}: does not exist")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"{where}: holds no image files ({', '.join(IMAGE_SUFFIXES)}, searched recursively)")
    return files


def read_images(folder: Union[str, Path], preprocess: ImagePreprocess, *, limit: Optional[int] = None,
                where: Optional[str] = None) -> torch.Tensor:
    """The images of ``folder`` (the first ``limit`` by path), preprocessed and stacked on a new first axis."""
    from PIL import Image, UnidentifiedImageError

    folder = Path(folder)
    where = where or f"image folder {str(folder)!r}"
    files = image_files(folder, where)[:limit]
    arrays: list[np.ndarray] = []
    for path in files:
        try:
            with Image.open(path) as image:
                array = preprocess(image, where=f"{where}: image {str(path)!r}")
        except ConfigError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ConfigError(f"{where}: cannot read image {str(path)!r} ({exc}); remove it or convert it to "
                              "PNG/JPEG") from None
        if arrays and array.shape != arrays[0].shape:
            raise ConfigError(f"{where}: image {str(path)!r} gives shape {array.shape}, image {str(files[0])!r} "
                              f"gave {arrays[0].shape}; give a crop (--crop / ImagePreprocess(crop=...)) or an "
                              "exact resize (H,W) so every image comes out the same size")
        arrays.append(array)
    return torch.from_numpy(np.stack(arrays))


# ----------------------------------------------------------------------------- array files


def _ordered(items: list[tuple[str, Any]], names: Optional[Sequence[str]], where: str) -> list[Any]:
    """The values of ``(key, value)`` pairs in input order: by the forward's parameter ``names`` when the
    keys name inputs, else as stored (np.savez's positional arr_0, arr_1... keep their order)."""
    keys = [k for k, _ in items]
    if names and any(k in names for k in keys):
        unknown = [k for k in keys if k not in names]
        if unknown:
            raise ConfigError(f"{where}: key {unknown[0]!r} names no model input; the inputs are "
                              f"{', '.join(map(repr, names))}")
        missing = [n for n in names if n not in keys]
        values = dict(items)
        order = [n for n in names if n in values]
        if missing and order != list(names[:len(order)]):
            raise ConfigError(f"{where}: has no entry for input {missing[0]!r} (it has {', '.join(map(repr, keys))})")
        return [values[n] for n in order]
    return [v for _, v in items]


def _holds_objects(data, key: str) -> bool:
    """Whether the .npz member ``key`` is an object array (pickled; np.load refuses it), read from
    its header; False if the header cannot be read (loading the array reports that)."""
    try:
        with data.zip.open(f"{key}.npy") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            return read(f)[2].hasobject
    except (KeyError, OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error):
        return False


def _tensor(array: np.ndarray, key: str, where: str) -> torch.Tensor:
    if array.dtype.hasobject:
        raise ConfigError(f"{where}: array {key!r} holds Python objects (dtype object), not numbers; save numeric "
                          "arrays, one per model input")
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: array {key!r} cannot be a tensor ({exc}); save numeric arrays, one per "
                          "model input") from None


def _read_npz(path: Path, where: str, names: Optional[Sequence[str]]) -> list:
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{where}: cannot read it as an .npz file ({exc or 'empty file'}); {HOW_TO_WRITE}") from None
    items = []
    with data:
        for key in data.files:
            if _holds_objects(data, key):
                raise ConfigError(f"{where}: array {key!r} holds Python objects (dtype object), not numbers; save "
                                  "numeric arrays, one per model input")
            try:
                array = data[key]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # a damaged member
                raise ConfigError(f"{where}: array {key!r} is damaged ({exc or 'truncated'}); {HOW_TO_WRITE}") from None
            items.append((key, _tensor(array, key, where)))
    return _ordered(items, names, where)


def _read_npy(path: Path, where: str) -> list:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc):
            raise ConfigError(f"{where}: the array holds Python objects (dtype object), not numbers; save a "
                              "numeric array") from None
        raise ConfigError(f"{where}: cannot read it as an .npy file ({exc}); {HOW_TO_WRITE}") from None
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{where}: cannot read it as an .npy file ({exc or 'truncated'}); {HOW_TO_WRITE}") from None
    return [_tensor(array, "the array", where)]


def _torch_value(value: Any, key: str, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)  # a tuple input of the model
    raise ConfigError(f"{where}: entry {key} is {type(value).__name__}, not a tensor; save tensors only: "
                      "torch.save(x | (x0, x1) | {'name': x}, path)")


def _read_torch(path: Path, where: str, names: Optional[Sequence[str]]) -> list:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message is a paragraph on its weights_only default; what matters here is what to save
        raise ConfigError(f"{where}: torch.load(weights_only=True) refuses it (it holds Python objects other "
                          f"than tensors, e.g. a pickled model or a custom class); save plain tensors, "
                          "a tuple/list of them or a dict of them (no custom classes)") from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{where}: cannot read it as a torch.save file ({exc}); {HOW_TO_WRITE}") from None
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        if not obj:
            raise ConfigError(f"{where}: the saved dict is empty; save {{input name: tensor}}")
        items = [(k, _torch_value(v, repr(k), where)) for k, v in obj.items()]
        if not all(isinstance(k, str) for k, _ in items):
            raise ConfigError(f"{where}: dict keys must be input names (str), got {type(items[0][0]).__name__}")
        return _ordered(items, names, where)
    if isinstance(obj, (tuple, list)):
        return [_torch_value(v, f"[{i}]", where) for i, v in enumerate(obj)]
    raise ConfigError(f"{where}: holds a {type(obj).__name__}; save a tensor, a tuple/list of tensors (one per "
                      "input) or a dict {input name: tensor}")


def read_arrays(path: Union[str, Path], *, names: Optional[Sequence[str]] = None,
                where: Optional[str] = None) -> list:
    """The inputs stored in an .npz, .npy or torch.save file (told apart by content, not by suffix),
    one tensor (or list of tensors, for a tuple input) per model input, samples on the first axis.

    ``names``: the model's input names, to order a file keyed by them."""
    path = Path(path)
    where = where or f"calibration file {str(path)!r}"
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a folder; for a folder of images use --calib-images "
                          "(API: ImagePreprocess with load_batches)") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    if not magic:
        raise ConfigError(f"{where}: cannot read it as an .npz file (empty file); {HOW_TO_WRITE}")
    if magic.startswith(NPY_MAGIC):
        return _read_npy(path, where)
    if magic.startswith(ZIP_MAGICS):
        try:
            with zipfile.ZipFile(path) as z:
                members = z.namelist()
        except (zipfile.BadZipFile, OSError):
            members = []
        if any(m.endswith("/data.pkl") or m == "data.pkl" for m in members):  # torch.save's zip layout
            return _read_torch(path, where, names)
        return _read_npz(path, where, names)
    if magic.startswith(PICKLE_MAGIC):
        return _read_torch(path, where, names)
    raise ConfigError(f"{where}: not an .npz archive, .npy array or torch.save file; {HOW_TO_WRITE}")


# ----------------------------------------------------------------------------- batches


def input_names(model) -> Optional[list[str]]:
    """The positional parameter names of ``model.forward`` (None when it has no plain signature)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds] or None


def _split(arrays: list, batch_size: int, limit: Optional[int]) -> list[tuple]:
    """The samples (along dim 0 of every input; of each tensor of a tuple input) cut into batches
    of ``batch_size``, the first ``limit`` samples only when given."""
    lead = arrays[0][0] if isinstance(arrays[0], list) else arrays[0]
    total = int(lead.shape[0]) if lead.dim() else 0
    stop = total if limit is None else min(total, limit)

    def cut(a, i: int):
        j = min(i + batch_size, stop)
        return [t[i:j] for t in a] if isinstance(a, list) else a[i:j]

    return [tuple(cut(a, i) for a in arrays) for i in range(0, stop, batch_size)]


def _check_count(name: str, value: Optional[int]) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


def load_batches(source: Any, example_inputs: Sequence[Any], *, batch_size: int = 8,
                 preprocess: Optional[ImagePreprocess] = None, limit: Optional[int] = None,
                 names: Optional[Sequence[str]] = None, inputs_of: Optional[Callable[[Any], Any]] = None,
                 where: Optional[str] = None) -> CalibData:
    """``source`` (see the module docstring) as checked batches for ``qcompiler.compile(calib_data=...)``
    or QuantAnalysis.

    A file or array is cut into batches of ``batch_size`` samples along the first axis; an image
    folder needs ``preprocess``; an iterable's batches are kept as they come (``inputs_of(batch)``
    picks the model inputs from each, e.g. ``lambda b: b[0]`` for a DataLoader of (images, labels)).
    ``limit``: use at most this many samples (files, arrays, folders) or batches (iterables).
    """
    _check_count("batch_size", batch_size)
    _check_count("limit", limit)
    signature = input_signature(tuple(example_inputs))
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir() or preprocess is not None:
            label = where or f"image folder {str(path)!r}"
            if preprocess is None:
                raise ConfigError(f"{label}: a folder of images needs its preprocessing: pass "
                                  "preprocess=ImagePreprocess(resize=..., crop=..., mean=..., std=...)")
            arrays = [read_images(path, preprocess, limit=limit, where=label)]
            what = f"{arrays[0].shape[0]} images in {path}"
        else:
            label = where or f"calibration file {str(path)!r}"
            arrays = read_arrays(path, names=names, where=label)
            what = None
        try:
            checked = check_inputs(arrays, signature, where=label)
        except ConfigError as exc:
            exc.add_note(f"{label} holds one array per model input, samples along the first axis; "
                         + ("the preprocessing sets the size and layout of each image"
                            if what else HOW_TO_WRITE))
            raise
        batches = _split(list(checked), batch_size, limit)
        count = sum(int(_first_tensor(b).shape[0]) for b in batches)
        return CalibData(batches, what or f"{count} samples from {path}", count)
    if isinstance(source, (torch.Tensor, np.ndarray)):
        label = where or "calibration data"
        tensor = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
        checked = check_inputs([tensor], signature, where=label)
        batches = _split(list(checked), batch_size, limit)
        count = sum(int(_first_tensor(b).shape[0]) for b in batches)
        return CalibData(batches, f"{count} samples of a {type(source).__name__}", count)
    if not isinstance(source, Iterable):
        raise ConfigError(f"calibration data must be a file, an image folder, an array or an iterable of batches "
                          f"(e.g. a DataLoader), got {type(source).__name__}")
    batches = []
    label = where or "calibration data"
    for i, batch in enumerate(source):
        if limit is not None and i >= limit:
            break
        if inputs_of is not None:
            batch = inputs_of(batch)
        try:
            batches.append(check_inputs(as_args(batch), signature, where=f"{label} batch {i}"))
        except ConfigError as exc:
            if isinstance(batch, (tuple, list)) and len(batch) == len(signature) + 1:
                exc.add_note("a DataLoader of (inputs, labels)? pass inputs_of=lambda b: b[0]")
            raise
    if not batches:
        raise ConfigError(f"{label} is empty: it gave no batch")
    count = sum(int(_first_tensor(b).shape[0]) if _first_tensor(b).dim() else 1 for b in batches)
    return CalibData(batches, f"{len(batches)} batches ({count} samples) from a {type(source).__name__}", count)


def _first_tensor(batch: tuple) -> torch.Tensor:
    a = batch[0]
    return a[0] if isinstance(a, (tuple, list)) else a


__all__ = ["CalibData", "ImagePreprocess", "load_batches", "read_arrays", "read_images", "image_files",
           "input_names", "IMAGE_SUFFIXES"]
