"""``python -m szformat``: the same as the ``szconvert`` console script."""

import sys

from .cli import main

sys.exit(main())
