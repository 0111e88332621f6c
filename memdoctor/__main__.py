from memdoctor.cli import main

raise SystemExit(main())
