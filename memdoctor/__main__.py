"""`python -m memdoctor`: the same as the `memdoctor` command."""
from memdoctor.cli import main

raise SystemExit(main())
