"""``python -m agck``: the ``agck`` command."""

import sys

from .cli import main

sys.exit(main())
