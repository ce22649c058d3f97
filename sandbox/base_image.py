"""`python -m sandbox.base_image` runs sandbox.images.base_image's `main`, under the name docs and `t1` use."""

import sys

from sandbox.images.base_image import main

if __name__ == "__main__":
    sys.exit(main())
