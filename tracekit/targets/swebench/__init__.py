"""SWE-bench Verified (``benchmark.kind=swebench``): instances from the hub or JSONL in local clones, predictions in
the official format, the official harness (``suite``); the coding target's tools, jail and labels."""
