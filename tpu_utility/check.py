"""``python -m tpu_utility.check``: the command; the checks live in ``tpu_utility.diagnostics.check``."""

import sys

from .diagnostics.check import main

if __name__ == "__main__":
    sys.exit(main())
