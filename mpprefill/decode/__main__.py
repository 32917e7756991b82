"""`python -m mpprefill.decode`: the decode receiver alone (as `mpprefill decode`)."""

from __future__ import annotations

from mpprefill.decode.command import main

if __name__ == "__main__":
    raise SystemExit(main())
