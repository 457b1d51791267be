"""``python -m kvstrata`` is the ``kvstrata`` command."""

import sys

from kvstrata.cli import main

sys.exit(main())
