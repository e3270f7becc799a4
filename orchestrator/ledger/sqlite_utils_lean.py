"""sqlite-utils, imported without numpy.

sqlite-utils imports numpy when it is installed, only to map numpy values to column
types; the ledger never stores numpy values, and numpy's import is most of a read
command's start-up (~0.1 s of ~0.5). So numpy is hidden while sqlite-utils loads and
is importable as before afterwards.
"""

from __future__ import annotations

import sys

if "sqlite_utils" in sys.modules or "numpy" in sys.modules:
    import sqlite_utils
else:
    sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` raises ImportError meanwhile
    try:
        import sqlite_utils
    finally:
        del sys.modules["numpy"]

__all__ = ["sqlite_utils"]
