"""Calibration batches of a model prepared with keyword example inputs are dicts, like the example."""

import warnings

import pytest
import torch
import torch.nn as nn

import qcompiler
from qcompiler.errors import ConfigError


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, pixels, mask):
        return self.conv(pixels) * mask


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"pixels": torch.randn(2, 3, 6, 6, generator=g), "mask": torch.rand(2, 1, 6, 6, generator=g)}


def _compile(calib):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qcompiler.compile(TwoInputs().eval(), _batch(0), march="bayes", calib_data=calib, progress=False)


def test_dict_batches_calibrate_like_the_same_batches_as_tuples_in_the_examples_order():
    torch.manual_seed(0)
    by_dict = _compile([_batch(1), {"mask": _batch(2)["mask"], "pixels": _batch(2)["pixels"]}])  # any key order
    torch.manual_seed(0)
    by_tuple = _compile([(b["pixels"], b["mask"]) for b in (_batch(1), _batch(2))])
    x = _batch(3)
    assert torch.equal(by_dict(**x), by_tuple(**x))


@pytest.mark.parametrize("batch, message", [({"pixels": torch.randn(2, 3, 6, 6)}, "input 'mask' missing"),
                                            ({**_batch(1), "extra": torch.ones(1)},
                                             "keyword argument 'extra' names no input")])
def test_a_dict_batch_with_other_keys_is_refused_naming_the_key(batch, message):
    with pytest.raises(ConfigError, match=rf"calib_data batch 0: {message}"):
        _compile([batch])
