"""`python -m optimizer.cli`: the `nightshift` command."""

import sys

from optimizer.cli import main

if __name__ == "__main__":  # imported (as the layering test does), it runs nothing
    sys.exit(main())
