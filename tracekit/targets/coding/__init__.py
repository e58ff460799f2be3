"""The coding target (issue 20; paper Table 2): SWE-smith-style local tasks.

- :mod:`tracekit.targets.coding.tasks`: bugs injected into an installed package by swesmith's procedural modifiers,
  validated by the package's own tests, split train / test, cached.
- :mod:`tracekit.targets.coding.repo`: snapshots, private copies with an outside git directory, patches, test runs.
- :mod:`tracekit.targets.coding.reward`: the test-based reward and SWE-bench's prediction record.
- :mod:`tracekit.targets.coding.suite`: the EnvSuite (bash tool, submit).
- :mod:`tracekit.targets.coding.reference`: the reference labeler of the three coding capabilities.
- :mod:`tracekit.targets.coding.config`: ``benchmark.coding`` settings and the suites they build.
- :mod:`tracekit.targets.coding.target`: the Target; :mod:`tracekit.targets.coding.interface`: its tools and policy as
  plain data; ``library/``: the coding family of library environments; ``dictionary.yaml``.

Every command runs in the jail (:mod:`tracekit.coding.sandbox`); SWE-bench Verified is ``tracekit/targets/swebench/``.
"""
