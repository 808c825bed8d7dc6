"""``python -m pool`` is the ``llm-pool`` command."""

import sys

from pool.cli import main

sys.exit(main())
