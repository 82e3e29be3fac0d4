"""The `moetier` command line (moetier.cli.app); `main` is the console script's entry point."""

from moetier.cli.app import main

__all__ = ["main"]
