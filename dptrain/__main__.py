import sys

from dptrain.cli import main

sys.exit(main())
