import sys

from seqpipe.plan.cli import main

sys.exit(main(sys.argv[1:]))
