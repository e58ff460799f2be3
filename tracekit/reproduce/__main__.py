"""``python -m tracekit.reproduce table1 [overrides]``: see :mod:`tracekit.reproduce.runner`."""

import sys

from tracekit.reproduce.runner import main

sys.exit(main())
