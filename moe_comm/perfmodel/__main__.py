"""`python -m moe_comm.perfmodel ...`: see cli.py."""
import sys

from .cli import main

sys.exit(main())
