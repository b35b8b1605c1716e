from kvloom.cli import main

raise SystemExit(main())
