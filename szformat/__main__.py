"""``python -m szformat``: the same as the ``szconvert`` console script."""

import sys

from .cli.main import main

sys.exit(main())
