"""``python -m adaptrain …``: the ``adaptrain`` command (same as the installed script)."""

import sys

from adaptrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
