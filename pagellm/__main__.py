"""`python -m pagellm ...`: the `pagellm` command line."""

import sys

from pagellm.frontend.cli import main

sys.exit(main())
