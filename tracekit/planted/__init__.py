"""A planted-deficit testbed (issue 21): a base agent with known strengths and gaps, to score TRACE's analysis
against the gaps it was given and to measure what training on them gains.

- :mod:`tracekit.planted.warmstart`: the warm start. SFT of the bundled backbone on ground-truth
  demonstrations of the library environments of the *strong* capabilities (and few or none of the *weak*
  ones, the planted set), merged into the weights and cached as a backbone folder with its record
  (``planted.json``: the planted set, the demonstrations' seeds and counts, the SFT seed and settings).
  ``backbone.planted`` in the config selects it; every stage's key holds it (``wiring.backbone_dict``).
- :mod:`tracekit.planted.score`: precision and recall of the selected capabilities against the planted set,
  over seeds and a delta/rho grid (only ``select`` reruns), as a table and a figure.
- :mod:`tracekit.planted.curves`: the per-capability GRPO learning curves (reward, informative-group rate).
"""
