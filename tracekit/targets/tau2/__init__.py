"""tau^2-bench (``benchmark.kind=tau2``): the real airline and retail domains (``suite``, ``users``), their
interface as the synthesized environments keep it (``interface``), the reference labels and dictionary (``labels``,
``replay``, ``dictionary.yaml``) and the tau^2 family of library environments (``library/``)."""
