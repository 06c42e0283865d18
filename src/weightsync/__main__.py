"""``python -m weightsync``: the same command line as the ``weightsync`` script."""

from weightsync.cli import main

raise SystemExit(main())
