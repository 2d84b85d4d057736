"""The nash march: its spellings, its table's rows beside bayes's (positive and negative placement)."""

import pytest
import torch
import torch.nn as nn

from qcompiler.backends.bpu import TABLES, op_table
from qcompiler.errors import ConfigError
from qcompiler.ir import propagate_shapes, trace
from qcompiler.ir.meta import META_PLACEMENT, META_REASON
from qcompiler.march import March, to_march
from qcompiler.passes.base import CompileContext
from qcompiler.passes.place import place


def placed(model, x, march):
    gm = trace(model)
    propagate_shapes(gm, x)
    place(gm, CompileContext(march=March(march), example_inputs=(x,)))
    return {n.name: (n.meta[META_PLACEMENT], n.meta[META_REASON]) for n in gm.graph.nodes if META_PLACEMENT in n.meta}


@pytest.mark.parametrize("spelling", ["nash", "NASH", "Nash", "nash_m", "NASH_E", March.NASH_M, March.NASH_E])
def test_the_guide_spellings_name_one_march_and_one_table(spelling):
    assert to_march(spelling) is March.NASH
    assert op_table(spelling) is TABLES[March.NASH]


def test_aliases_are_not_listed_as_marches_of_their_own():
    assert [m.value for m in March] == ["bernoulli2", "bayes", "nash"]
    with pytest.raises(ConfigError, match="allowed: bernoulli2, bayes, nash"):
        to_march("nosh_x")


def test_every_nash_row_allows_int16():
    assert all(rule.int16 for rule in TABLES[March.NASH].rules.values())
    assert not all(rule.int16 for rule in TABLES[March.BAYES].rules.values())


def test_nash_runs_every_op_bayes_runs():
    assert set(TABLES[March.BAYES].rules) <= set(TABLES[March.NASH].rules)


class Prelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.act = nn.Conv2d(4, 4, 1), nn.PReLU()

    def forward(self, x):
        return self.act(self.conv(x))


class FiveD(nn.Module):
    """A 5-D element-wise add and a permute of up to 5 dims."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return (y + y).permute(0, 2, 1, 3, 4)


class SixD(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y.sigmoid()


def test_prelu_runs_on_nash_and_not_on_bayes():
    x = torch.rand(1, 4, 8, 8)
    assert placed(Prelu(), x, "nash")["act"] == ("bpu", "prelu supported on nash")
    assert placed(Prelu(), x, "bayes")["act"] == ("cpu", "prelu is not supported on bayes")


def test_five_dim_tensors_run_on_nash_and_six_do_not():
    p = placed(FiveD(), torch.rand(1, 2, 3, 4, 8), "nash")
    assert p["permute"] == ("bpu", "permute supported on nash")
    assert placed(FiveD(), torch.rand(1, 2, 3, 4, 8), "bayes")["permute"][0] == "cpu"
    six = placed(SixD(), torch.rand(1, 2, 3, 4, 5, 8), "nash")
    assert six["sigmoid"] == ("cpu", "sigmoid: tensor (1,2,3,4,5,8) is 6-D, not 1..5-D on nash")


def test_spatial_ops_keep_the_nchw_form_on_nash():
    class Pool3(nn.Module):
        def forward(self, x):
            return torch.nn.functional.max_pool2d(x.relu(), 2)

    assert placed(Pool3(), torch.rand(1, 4, 8, 8), "nash")["max_pool2d"][0] == "bpu"


def test_cat_along_the_batch_stays_on_cpu_on_nash():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return torch.cat([y, y], 0), torch.cat([y, y], 1)

    p = placed(Cat(), torch.rand(2, 8), "nash")
    assert p["cat"] == ("cpu", "cat: concat along N (dim 0) on nash")
    assert p["cat_1"] == ("bpu", "cat supported on nash")
