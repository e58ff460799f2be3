"""The coding target (issue 20; paper Table 2): SWE-smith-style local tasks and a SWE-bench Verified adapter.

- :mod:`tracekit.coding.tasks`: bugs injected into an installed package by swesmith's procedural modifiers,
  validated by the package's own tests, split train / test, cached.
- :mod:`tracekit.coding.sandbox`: one fresh, limited, network-less jail per command (it sees its task copy and the
  interpreter, nothing else; :mod:`tracekit.coding._jail` builds it).
- :mod:`tracekit.coding.repo`: snapshots, private copies with an outside git directory, patches, test runs.
- :mod:`tracekit.coding.reward`: the test-based reward and SWE-bench's prediction record.
- :mod:`tracekit.coding.suite`: the EnvSuite (bash tool, submit).
- :mod:`tracekit.coding.swebench`: SWE-bench Verified instances, predictions, the official harness.
- :mod:`tracekit.coding.reference`: the reference labeler of the three coding capabilities.
- :mod:`tracekit.coding.config`: ``benchmark.coding`` settings and the suites they build.
"""
