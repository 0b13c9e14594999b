import sys

from qerl.cli import main

sys.exit(main())
