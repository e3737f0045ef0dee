"""``python -m engine.client``: see `engine.client.cli`."""

import sys

from engine.client.cli import main

raise SystemExit(main(sys.argv[1:]))
