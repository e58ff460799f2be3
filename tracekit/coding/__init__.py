"""The jail every coding command and test run goes through (issue 20): :mod:`tracekit.coding.sandbox`, one fresh,
limited, network-less jail per command (it sees its task copy and the interpreter, nothing else;
:mod:`tracekit.coding._jail` builds it, :mod:`tracekit.coding.runtime` lays out what it sees). The coding target itself
is ``tracekit/targets/coding/`` and ``tracekit/targets/swebench/``."""
