"""The HTTP front's process never loads torch: it parses, tokenizes and relays only."""

import subprocess
import sys


def test_the_front_and_the_request_protocol_load_without_torch():
    code = (
        "import sys, mpprefill.http.__main__, mpprefill.http.app, mpprefill.protocol; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
