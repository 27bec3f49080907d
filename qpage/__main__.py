"""``python -m qpage`` (and ``torchrun ... -m qpage``): the ``qpage`` command."""

import sys

from qpage.cli import main

sys.exit(main())
