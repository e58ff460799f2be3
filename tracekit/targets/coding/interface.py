"""The coding target's agent interface: its two tools and its policy text (plain data, no imports: the
synthesized coding environments read it inside the synthesis sandbox, where loading a native library is refused)."""

BASH_TOOL = {"type": "function", "function": {
    "name": "bash",
    "description": ("Run one bash command in the repository root and return its output and exit code. Every call "
                    "is a fresh shell (cd and variables do not persist); there is no network; long outputs are cut."),
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "the bash command line, e.g. grep -n 'def f' pkg/mod.py"}},
        "required": ["command"]}}}
SUBMIT_TOOL = {"type": "function", "function": {
    "name": "submit",
    "description": "Submit the repository as it is now as your fix; this ends the task.",
    "parameters": {"type": "object", "properties": {
        "answer": {"type": "string", "description": "optional: one line on what you fixed (e.g. the function)"}},
        "required": []}}}
TOOLS = [BASH_TOOL, SUBMIT_TOOL]
GENERIC_POLICY = ("You are a software engineer fixing a bug in a Python package (its source and its tests are in "
                  "the current directory). Use the `bash` tool to read files, edit them and run the tests; make the "
                  "smallest change that fixes the bug, do not edit the tests, check that the tests pass, then call "
                  "`submit`.")


def coding_tools() -> dict[str, dict]:
    """The coding target's tool schemas by name (the interface every environment of the family keeps)."""
    return {t["function"]["name"]: t for t in TOOLS}


def coding_policy() -> str:
    return GENERIC_POLICY
