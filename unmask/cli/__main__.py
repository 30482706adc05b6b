import sys

from unmask.cli import main

sys.exit(main())
