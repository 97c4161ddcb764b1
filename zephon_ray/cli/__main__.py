"""``python -m zephon_ray.cli``: the ``zephon-ray`` command in this interpreter (tests run it this way)."""

import sys

from zephon_ray.cli import main

sys.exit(main())
