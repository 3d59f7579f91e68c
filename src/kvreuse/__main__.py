from kvreuse.cli import main

raise SystemExit(main())
