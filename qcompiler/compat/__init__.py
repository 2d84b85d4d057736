"""The only places qcompiler touches torch APIs that torch deprecates or keeps private.

* :mod:`.torch_ao` -- ``torch.ao.quantization`` (deprecated FX-mode quantization, planned for
  deletion) and ``torch.ao.nn.quantized.FloatFunctional``: the classes a user's model may carry,
  accepted as inputs while torch ships them, replaced by ours when it stops.
* :mod:`.torch_private` -- torch's private names with no public equivalent yet
  (``torch.utils._pytree``, ``torch._ops``, ``torch._int_mm`` ...).

Everything else imports these names from here, so a torch release that moves or drops one
breaks one module and its test (tests/test_compat.py), not the passes. docs/compatibility.md
lists what is kept and why.
"""
