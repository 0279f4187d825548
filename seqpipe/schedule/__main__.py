"""`python -m seqpipe.schedule`."""

import sys

from seqpipe.schedule.cli import main

sys.exit(main())
