"""The warm start (issue 21, 50): a backbone source below ``validate``, so the checks and the app use it without an
import up the layers.

- :mod:`tracekit.warmstart.planted`: the planted warm start. SFT of the bundled backbone on ground-truth
  demonstrations of the library environments of the *strong* capabilities (and few or none of the *weak* ones, the
  planted set), merged into the weights and cached as a backbone folder with its record (``planted.json``).
  ``backbone.planted`` in the config selects it; every stage's key holds it (``wiring.backbone_dict``). It registers
  itself with :func:`tracekit.llm.backbones.register_backbone_source` when imported.
- :mod:`tracekit.warmstart.shipped`: a shipped copy of a warm start (``warm_start=<name>``, ``warmstarts/<name>/``),
  checked against the planted key and installed into the planted cache before the stages load it.
"""
