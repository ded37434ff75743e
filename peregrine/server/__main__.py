"""`python -m peregrine.server serve|bench-serve ...` (same options as `peregrine serve` / `peregrine bench serve`)."""
import sys

from .cli import main

sys.exit(main())
