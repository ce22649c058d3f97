"""`python -m sandbox.reap` runs sandbox.runtime.reap's `main`, under the name docs and `t1` use."""

import sys

from sandbox.runtime.reap import main

if __name__ == "__main__":
    sys.exit(main())
