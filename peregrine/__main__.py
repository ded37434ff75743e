"""`python -m peregrine` = the `peregrine` command."""
from .cli import main

raise SystemExit(main())
