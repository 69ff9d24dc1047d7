"""``python -m dflash2_hf.cli``: the ``dflash2-hf`` command."""

import sys

from . import main

sys.exit(main())
