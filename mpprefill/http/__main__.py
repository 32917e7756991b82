"""`python -m mpprefill.http`: the HTTP front alone, in front of a running `mpprefill serve`."""

from __future__ import annotations

from mpprefill.http.front_main import main

if __name__ == "__main__":
    raise SystemExit(main())
