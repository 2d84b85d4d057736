"""A GeneralizedRCNN-shaped detector without torchvision: a list of images (List[Tensor[C, H, W]]),
a transform with data-dependent sizes, a conv backbone and head, and a Python postprocess returning a
list of dicts (boxes, labels, scores), as torchvision's detectors do in eval mode.

What compiles where: the statements of the top-level forward that iterate the list, and the
postprocess, are eager-torch islands (qcompiler.ir.glue); the transform is a leaf (its resize needs
the images' sizes as Python numbers); the backbone and head convs are traced into the graph and run
on the BPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qcompiler
from qcompiler.errors import ConfigError, QCompilerWarning
from qcompiler.ir.meta import placement


class ImageList:
    """torchvision.models.detection.image_list.ImageList's shape: the padded batch and the sizes."""

    def __init__(self, tensors, image_sizes):
        self.tensors, self.image_sizes = tensors, image_sizes


class Transform(nn.Module):
    """GeneralizedRCNNTransform's shape: normalize, resize each image to a fixed short side (its size
    depends on the image's), pad to a batch divisible by 8."""

    def __init__(self, min_size=32, divisible=8):
        super().__init__()
        self.min_size, self.divisible = min_size, divisible
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1))

    def forward(self, images):
        out = []
        for img in images:
            img = (img - self.mean) / self.std
            h, w = img.shape[-2:]
            scale = self.min_size / min(int(h), int(w))
            out.append(F.interpolate(img[None], scale_factor=scale, mode="bilinear", recompute_scale_factor=True,
                                     align_corners=False)[0])
        sizes = [tuple(o.shape[-2:]) for o in out]
        height = -(-max(s[0] for s in sizes) // self.divisible) * self.divisible
        width = -(-max(s[1] for s in sizes) // self.divisible) * self.divisible
        batch = out[0].new_zeros(len(out), 3, height, width)
        for padded, image in zip(batch, out):
            padded[:, :image.shape[1], :image.shape[2]].copy_(image)
        return ImageList(batch, sizes)


def conv(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout), nn.ReLU())


class Detector(nn.Module):
    """List of images -> transform -> backbone -> head -> Python postprocess -> list of dicts."""

    stride = 4

    def __init__(self, classes=3):
        super().__init__()
        self.transform = Transform()
        self.backbone = nn.Sequential(conv(3, 8, 2), conv(8, 16, 2), conv(16, 16))
        self.cls_head = nn.Conv2d(16, classes, 1)
        self.box_head = nn.Conv2d(16, 4, 1)

    def forward(self, images):
        original_sizes = [tuple(img.shape[-2:]) for img in images]
        batch = self.transform(images)
        features = self.backbone(batch.tensors)
        logits, deltas = self.cls_head(features), self.box_head(features)
        return self.postprocess(logits, deltas, batch.image_sizes, original_sizes)

    def postprocess(self, logits, deltas, sizes, original_sizes):
        """Decode a box per cell inside each image, scaled back to the original image's size."""
        detections = []
        for lg, dl, (h, w), (oh, ow) in zip(logits, deltas, sizes, original_sizes):
            lg, dl = lg[:, :-(-h // self.stride), :-(-w // self.stride)], dl[:, :-(-h // self.stride), :-(-w // self.stride)]
            scores, labels = lg.sigmoid().flatten(1).max(0)
            ys, xs = torch.meshgrid(torch.arange(lg.shape[1]), torch.arange(lg.shape[2]), indexing="ij")
            cx, cy = (xs.flatten() + 0.5) * self.stride, (ys.flatten() + 0.5) * self.stride
            d = dl.flatten(1).clamp(-2, 2).exp() * self.stride
            boxes = torch.stack([cx - d[0], cy - d[1], cx + d[2], cy + d[3]], 1)
            boxes = boxes * torch.tensor([ow / w, oh / h, ow / w, oh / h])
            detections.append({"boxes": boxes, "labels": labels, "scores": scores})
        return detections


# symbolic tracing with its fallback (the subject here); capture="auto" tries torch.export before it
FX = {"capture": "fx"}


def _images(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, 40, 48, generator=g), torch.rand(3, 36, 30, generator=g)]


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = Detector().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = qcompiler.compile(model, (_images(0),), march="bayes", calib_data=[(_images(s),) for s in range(4)],
                               prepare_custom_config_dict=FX, progress=False)
    return model, cm, [str(w.message) for w in caught if issubclass(w.category, QCompilerWarning)]


def test_backbone_and_head_convs_run_on_the_bpu_the_rest_in_torch():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QCompilerWarning)
        gm = qcompiler.partition(Detector().eval(), (_images(0),), march="bayes", prepare_custom_config_dict=FX)
    where = {n.target: placement(n) for n in gm.graph.nodes if n.op == "call_module"}
    convs = ["backbone.0.0", "backbone.1.0", "backbone.2.0", "cls_head", "box_head"]
    assert {c: where[c] for c in convs} == dict.fromkeys(convs, "bpu")
    assert {t: where[t] for t in ("_qc_glue_0", "transform", "_qc_glue_1")} == dict.fromkeys(
        ("_qc_glue_0", "transform", "_qc_glue_1"), "cpu")


def test_the_list_of_dicts_matches_the_float_models_boxes(compiled):
    model, cm, messages = compiled
    assert any("Done automatically: 'transform' is a leaf" in m for m in messages)
    assert sum("run as one eager-torch island" in m for m in messages) == 2  # the two statements
    for seed in (0, 7):  # a calibration batch and another
        images = _images(seed)
        with torch.no_grad():
            want = model(images)
        got = cm(images)
        assert isinstance(got, list) and [sorted(d) for d in got] == [["boxes", "labels", "scores"]] * 2
        for g, w in zip(got, want):
            assert g["boxes"].shape == w["boxes"].shape
            # int8 backbone and head: box corners within 0.1 px of float on 40x48 and 36x30 images
            # (measured: 0.02 px), scores within 0.005 (measured: 0.0007)
            assert (g["boxes"] - w["boxes"]).abs().max() <= 0.1
            assert (g["scores"] - w["scores"]).abs().max() <= 0.005
            assert (g["labels"] == w["labels"]).float().mean() >= 0.9  # near-ties of random logits may flip


def test_images_of_other_sizes_are_refused_with_the_sizes_to_pass(compiled):
    """The BPU part is compiled for the example's padded batch: other image sizes are a ConfigError
    naming the image and the size the example had (resize them to it first)."""
    _, cm, _ = compiled
    with pytest.raises(ConfigError, match=r"input 0 \('images'\)\[0\] has shape \(3, 50, 40\); the example "
                                          r"input has \(3, 40, 48\)"):
        cm([torch.rand(3, 50, 40), torch.rand(3, 36, 30)])
