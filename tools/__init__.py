"""User-facing tools on top of the compiler: review dumps (:mod:`.graph_dump`), the numeric
debugging tools (:mod:`.numeric_suite`, :mod:`.quant_analysis` with its HTML :mod:`.report`,
:mod:`.model_check`, :mod:`.profiler`) and the ``qcompiler`` command line (:mod:`.cli`, not
imported here so ``python -m qcompiler.tools.cli`` runs cleanly).

The names below are imported on first use (module ``__getattr__``): the command line lives in
this package and answers ``--help`` without importing torch (issue 35).
"""

import importlib

_EXPORTS = {
    "DumpResult": "qcompiler.ir.dump", "dump_partitioned": "qcompiler.ir.dump",
    "partition_table": "qcompiler.ir.dump", "to_dot": "qcompiler.ir.dump", "to_json": "qcompiler.ir.dump",
    "ModelCheckResult": "qcompiler.quantization.model_check", "check_qat_model": "qcompiler.quantization.model_check",
    "numeric_suite": "qcompiler.tools.numeric_suite",
    "ModelProfiler": "qcompiler.tools.profiler", "OpRunningInfoManager": "qcompiler.tools.profiler",
    "CompiledModelProfiler": "qcompiler.tools.profiler", "HbirModelProfiler": "qcompiler.tools.profiler",
    "METRICS": "qcompiler.tools.quant_analysis", "QuantAnalysis": "qcompiler.tools.quant_analysis",
    "compute_metric": "qcompiler.tools.quant_analysis",
    "write_report": "qcompiler.tools.report",
}


def __getattr__(name: str):
    """A public name of ``_EXPORTS``, imported from its module on first use."""
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if _EXPORTS[name].endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


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
