"""The `memdoctor` command line: main.py registers the commands, one module per command,
common.py holds what they share. `main` is the console script's entry point."""
from memdoctor.cli.main import main

__all__ = ["main"]
