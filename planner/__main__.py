import sys

from planner.cli import console_main

sys.exit(console_main())
