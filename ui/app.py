"""`python ui/app.py [--host ...] [--port ...]`: the same as `difftune ui`."""

import sys

from difftune.cli import main

if __name__ == "__main__":
    sys.exit(main(["ui", *sys.argv[1:]]))
