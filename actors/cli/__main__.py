"""``python -m actors.cli``: the same as the ``evobus`` command."""

import sys

from actors.cli.main import main

sys.exit(main())
