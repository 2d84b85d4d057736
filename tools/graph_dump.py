"""Review dumps of a partitioned graph, under the path the README and the CLI use.

The implementation is :mod:`qcompiler.ir.dump`: ``CompiledModel.dump`` (one layer below the
tools) writes the same dumps, so they live with the IR they print (docs/design.md, "Layers").
"""

from qcompiler.ir.dump import *  # noqa: F401,F403  (the public names, re-exported)
from qcompiler.ir.dump import __all__  # noqa: F401
