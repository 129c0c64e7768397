import sys

from fxflops.cli import main

sys.exit(main())
