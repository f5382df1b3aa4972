"""``python -m stowaway`` is the ``stowaway`` command."""

import sys

from stowaway.cli import main

sys.exit(main())
