"""`python -m pagekv ...` is the `pagekv` command."""

import sys

from pagekv.kvnode.pod.cli import main

sys.exit(main())
