"""Accuracy of transformers on nash against bayes and torch.ao, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/nash_accuracy.py [--models transformer_block vit_small BERT GPT-2 ViT]

Per model: the output SQNR against the float model of ``qcompiler.compile`` for bayes, for nash, and
for nash with ``int16_budget=0.1``, each with the number of BPU partitions; and of torch.ao FX PTQ
(x86 default qconfig mapping, ``benchmarks/simulator.py``'s ``torch_ao_model``) where torch.fx can
trace the model. The Hugging Face models are ``benchmarks/architecture_zoo.py``'s cases (random small
configs, keyword inputs); ``transformer_block`` is the zoo's, ``vit_small`` a 4-layer, 192-wide ViT
on 64 x 64 images (``benchmarks/vit.py``). Eight seeded calibration batches; one more batch measured
(batch 0 for the Hugging Face cases, as the zoo page does). docs/marches.md shows the table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompiler  # noqa: E402
from benchmarks import architecture_zoo as hf  # noqa: E402
from benchmarks.simulator import torch_ao_model  # noqa: E402
from benchmarks.vit import vit_b16  # noqa: E402
from qcompiler import zoo  # noqa: E402

CALIBRATION_BATCHES = 8
RUNS = (("bayes", None), ("nash", None), ("nash", 0.1))


def _positional(name: str) -> tuple[torch.nn.Module, Callable[[int], torch.Tensor]]:
    """A model that takes one tensor, and seeded input batches for it."""
    if name == "transformer_block":
        model, shape = zoo.get("transformer_block").eval(), (4, 16, 64)
    else:
        model, shape = vit_b16(image=64, width=192, layers=4, heads=3, mlp=768), (4, 3, 64, 64)
    return model, lambda i: torch.randn(*shape, generator=torch.Generator().manual_seed(i))


def measure(name: str) -> list[Any]:
    keywords = name in hf.BY_NAME
    if keywords:
        case = hf.BY_NAME[name]
        model, batches = case.model().eval(), [case.inputs(i) for i in range(CALIBRATION_BATCHES)]
        x = batches[0]
    else:
        model, make = _positional(name)
        batches, x = [make(i) for i in range(CALIBRATION_BATCHES)], make(CALIBRATION_BATCHES)

    def call(m):
        with torch.no_grad():
            return m(**copy.deepcopy(x)) if keywords else m(x)

    ref = call(model)
    row: list[Any] = [name]
    for march, budget in RUNS:
        extra = {} if budget is None else {"int16_budget": budget}
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            example = batches[0] if keywords else (batches[0],)
            cm = qcompiler.compile(model, example, march=march, calib_data=batches, progress=False, **extra)
            out = call(cm)
        parts = sum(p["placement"] == "bpu" for p in cm.partitions)
        row.append(f"{hf.sqnr(ref, out):.1f} ({parts} / {len(cm.partitions)})")
    if keywords:
        row.append("cannot trace")
    else:
        row.append(f"{hf.sqnr(ref, call(torch_ao_model(model, batches[0], batches))):.1f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["transformer_block", "vit_small", "BERT", "GPT-2", "ViT"],
                        choices=["transformer_block", "vit_small", *hf.BY_NAME], metavar="MODEL")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure(name))
        print("  ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "bayes dB (BPU parts / all)", "nash", "nash, int16_budget=0.1",
                                  "torch.ao FX dB"], tablefmt="github"))


if __name__ == "__main__":
    main()
