"""`python -m t1cli ...`: the `t1` command without the installed console script."""

from t1cli.main import main

raise SystemExit(main())
