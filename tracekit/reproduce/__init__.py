"""Paper tables and figures by one command each: ``python -m tracekit.reproduce table1 [scale=embedded]``.

- :mod:`tracekit.reproduce.spec`: the specs in ``experiments/`` (rows, columns, the paper's numbers), each row's
  Hydra overrides, and the check before any work (a row whose method, target, strategy or config key is not
  built is named in one line);
- :mod:`tracekit.reproduce.runner`: every row as a job of the app through a Hydra launcher (rows share the stage
  cache), then the side-by-side rendering and one W&B run per table;
- :mod:`tracekit.reproduce.render`: ours, the paper's and the difference per cell, 95% CIs where there are
  seeds; Markdown, CSV, LaTeX and PNG;
- :mod:`tracekit.report.paper`: the paper's setting value by value, and what a run cuts relative to it (the
  first log line and summary of every ``python -m tracekit`` run).
"""
