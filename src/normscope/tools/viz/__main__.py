import sys

from .figures import main

sys.exit(main())
