"""A small model with BatchNorms, and its prepared/converted versions, for the tools' train-mode tests."""

import copy

import torch
from torch import nn

from qcompiler.quantization import convert_fx, prepare_calibration_fx, prepare_qat_fx, set_state

X = (torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


class BNNet(nn.Module):
    """A BN on the input (stays a BN when prepared) and a conv+bn+relu (fused when prepared)."""

    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(self.bn0(x)))).mean((2, 3)))


def build():
    """(float, QAT, converted), BNs with non-default statistics; in eval mode, observers off."""
    torch.manual_seed(0)
    fm = BNNet()
    with torch.no_grad():
        for _ in range(3):
            fm(torch.rand(4, 3, 8, 8) * 2 + 1)
    fm.eval()
    cal = prepare_calibration_fx(fm, example_inputs=X, march="bayes").eval()
    with torch.no_grad():
        cal(*X)
    qat = set_state(prepare_qat_fx(cal), "validation").eval()
    return fm, qat, convert_fx(qat)


def training(fm, qat):
    """Copies of the float model in train mode and of the QAT model training (observers on)."""
    return copy.deepcopy(fm).train(), set_state(copy.deepcopy(qat), "qat").train()
