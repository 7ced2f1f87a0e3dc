"""``python -m normscope.tools.bench``: the same as ``normscope bench``."""

import sys

from . import main

sys.exit(main())
