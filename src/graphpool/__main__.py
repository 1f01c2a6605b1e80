"""``python -m graphpool``: runs the command line of graphpool.tools.cli."""

import sys

from graphpool.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
