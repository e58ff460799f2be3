"""The ToolSandbox-shaped library environments (``common``): permission error recovery, datetime reasoning."""
