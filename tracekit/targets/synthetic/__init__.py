"""Library-instance targets (``benchmark.kind=synthetic``, ``conf/benchmark/tau2_mini.yaml``): held-out instances of
library environments of any family (``suite``); each family's own analysis labels them."""
