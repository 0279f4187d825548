"""`python -m seqpipe.bench` is `python -m seqpipe.tools.bench` (the spelling issue 14 uses)."""

import sys

from seqpipe.tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
