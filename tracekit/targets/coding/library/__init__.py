"""The coding family of library environments over a generated package (``common``): fault localization, minimal
edit, test before submit."""
