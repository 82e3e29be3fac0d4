"""`python -m moetier.cli`: the same command line as the `moetier` script."""

from moetier.cli.app import main

main()
