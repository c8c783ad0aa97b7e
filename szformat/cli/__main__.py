"""``python -m szformat.cli``: the same as the ``szconvert`` console script."""

import sys

from . import main

sys.exit(main())
