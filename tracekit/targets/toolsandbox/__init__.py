"""ToolSandbox (``benchmark.kind=toolsandbox``): the client and suite (``suite``) of the real apple/ToolSandbox behind
its environment server (``server``, run in ToolSandbox's venv), its interface as plain data (``interface``, with the
committed extracts in ``data/``), the reference labels and dictionary (``labels``, ``dictionary.yaml``) and the
ToolSandbox-shaped library environments (``library/``)."""
