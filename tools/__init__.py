"""User-facing tools on top of the compiler: review dumps (:mod:`.graph_dump`), the numeric
debugging tools (:mod:`.numeric_suite`, :mod:`.quant_analysis` with its HTML :mod:`.report`,
:mod:`.model_check`, :mod:`.profiler`) and the ``qcompiler`` command line (:mod:`.cli`, not
imported here so ``python -m qcompiler.tools.cli`` runs cleanly)."""

from qcompiler.ir.dump import DumpResult, dump_partitioned, partition_table, to_dot, to_json
from qcompiler.quantization.model_check import ModelCheckResult, check_qat_model
from qcompiler.tools import numeric_suite
from qcompiler.tools.profiler import CompiledModelProfiler, HbirModelProfiler, ModelProfiler, OpRunningInfoManager
from qcompiler.tools.quant_analysis import METRICS, QuantAnalysis, compute_metric
from qcompiler.tools.report import write_report

__all__ = [
    "DumpResult",
    "dump_partitioned",
    "partition_table",
    "to_dot",
    "to_json",
    "numeric_suite",
    "QuantAnalysis",
    "compute_metric",
    "METRICS",
    "write_report",
    "check_qat_model",
    "ModelCheckResult",
    "ModelProfiler",
    "CompiledModelProfiler",
    "HbirModelProfiler",
    "OpRunningInfoManager",
]
