"""`python -m burstrl.cli`: the same as the `burstrl` console script."""

import sys

from burstrl.cli import main

sys.exit(main())
