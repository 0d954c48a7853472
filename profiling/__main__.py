"""`python -m profiling ...`: see profiling/cli.py."""

from profiling.cli import main

main()
