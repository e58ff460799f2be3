"""The micro world (``benchmark.kind=micro``, issue 42): its target and labels (``target``), its five library
environments and multi-capability task kinds (``library``), its interface (``interface``) and its dictionary
(``dictionary.yaml``)."""
