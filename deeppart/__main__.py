from deeppart.tools.cli import main

raise SystemExit(main())
