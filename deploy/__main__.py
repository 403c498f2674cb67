"""`python -m shoal.deploy ARGS`: the `shoal` command without the console script."""

from __future__ import annotations

import sys

from shoal.deploy.cli import main

sys.exit(main())
