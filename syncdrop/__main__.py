from syncdrop.cli import main

raise SystemExit(main())
