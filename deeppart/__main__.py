from deeppart.cli import main

raise SystemExit(main())
