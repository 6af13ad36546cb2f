import sys

from .clients.cli import main

sys.exit(main())
