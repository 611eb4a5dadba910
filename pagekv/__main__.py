"""`python -m pagekv ...` is the `pagekv` command."""

import sys

from pagekv.cli import main

sys.exit(main())
