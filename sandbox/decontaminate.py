"""`python -m sandbox.decontaminate` runs sandbox.tasks.decontaminate's `main`, under the name docs and `t1` use."""

import sys

from sandbox.tasks.decontaminate import main

if __name__ == "__main__":
    sys.exit(main())
