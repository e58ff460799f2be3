"""Capability-targeted synthetic environments (paper section 3.3, Definition 2, Appendices E, J, K).

- :mod:`.protocol`   the environment protocol (generator, transition logic, verifier, difficulty knob)
- :mod:`.library`    hand-written reference environments, one per capability the paper names
- :mod:`.targets`    the target environments' tool schemas and policies (interface-preservation reference)
- :mod:`.sandbox`    running untrusted generated modules in a limited subprocess
- :mod:`.validate`   load / interface / determinism / diversity / solvability / non-triviality checks
- :mod:`.calibrate`  reward-table statistics, pass@k, difficulty calibration
- :mod:`.agent`      the LLM generation agent (prompts in ``prompts/``, versioned)
- :mod:`.stage`      the synthesize stage: one environment package per selected capability

:mod:`tracekit.synthesis.suite` turns any of these environments into an :class:`~tracekit.envs.base.EnvSuite`.
"""
