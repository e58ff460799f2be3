"""The targets: one folder per ``benchmark.kind`` (``tracekit/targets/<kind>/``: its Target and settings, its suite, its
plain-data interface, its library environments, its labels and dictionary), found through
:mod:`tracekit.target_index`. The registry (the ``benchmark`` group, target lookups) is
:mod:`tracekit.targets.registry`. Nothing is imported here, so a sandbox that reads one world's plain-data interface
loads that module alone."""
