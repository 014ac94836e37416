from pddgw.cli import main

raise SystemExit(main())
