import sys

from orthoptim.cli import main

sys.exit(main())
