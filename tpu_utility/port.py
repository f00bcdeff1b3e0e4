"""``python -m tpu_utility.port IN [-o OUT] [--diff]``: the command; the porter lives in ``tpu_utility.diagnostics.port``."""

import sys

from .diagnostics.port import main

if __name__ == "__main__":
    sys.exit(main())
