"""`python -m kvscope.cli` is the `kvscope` command (the demo starts its engine this way)."""

from kvscope.cli.main import main

raise SystemExit(main())
