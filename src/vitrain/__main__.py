from vitrain.cli import main

raise SystemExit(main())
