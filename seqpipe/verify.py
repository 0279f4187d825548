"""`python -m seqpipe.verify` is `python -m seqpipe.tools.verify`: a config's pipeline
against the un-pipelined reference on one real batch."""

import sys

from seqpipe.tools.verify import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
