"""`python -m llamajet ...`: the `llamajet` command (where the console script is not on PATH)."""

from llamajet.cli import main

raise SystemExit(main())
