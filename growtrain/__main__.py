import sys

from growtrain.cli import main

sys.exit(main())
