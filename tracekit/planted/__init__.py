"""A planted-deficit testbed (issue 21): a base agent with known strengths and gaps, to score TRACE's analysis
against the gaps it was given and to measure what training on them gains.

The base agent is the planted warm start (:mod:`tracekit.warmstart.planted`, a backbone source below ``validate``;
:mod:`tracekit.warmstart.shipped`: the warm starts shipped in the repository).

The experiment tools, each a thin ``main`` over library functions the tests call; every run they make goes through
the pipeline and the stage cache (the app's stages, or :func:`tracekit.runs.cached_rollout`'s episodes), so a
second call, or one after the app, recomputes nothing:

- :mod:`tracekit.planted.gain`: Base / Single / TRACE on the held-out target per variant and training seed (runs of
  the app), as a table with paired intervals, the GRPO curves and the gate report;
- :mod:`tracekit.planted.score`: precision and recall of the selected capabilities against the planted set, over
  seeds and a delta/rho grid (only ``select`` reruns), as a table and a figure;
- :mod:`tracekit.planted.rung_a`: each capability's adapter against Base on held-out instances of its environment;
- :mod:`tracekit.planted.bands`: where the warm start's capabilities land against the official calibration gate;
- :mod:`tracekit.planted.curves`: the per-capability GRPO learning curves (reward, informative-group rate).
"""
