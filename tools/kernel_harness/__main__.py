"""`python -m tools.kernel_harness`: the harness's command line (`tools.kernel_harness.cli`)."""

import sys

from tools.kernel_harness.cli import main

sys.exit(main())
