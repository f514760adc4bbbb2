import sys

from moelab.cli import main

sys.exit(main())
