"""``python -m backfill_assets.ops.cli``: the ``backfill-assets`` command."""

import sys

from backfill_assets.ops.cli import main

sys.exit(main())
