"""A machine without the RDMA libraries: importing `mooncake.engine` fails the way the
dynamic loader makes it fail there. As a plugin (`pytest -p tests.no_rdma`) it holds for
the whole run."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

MESSAGE = "libibverbs.so.1: cannot open shared object file: No such file or directory"


class NoRdma(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mooncake.engine":
            raise ImportError(MESSAGE, name=fullname)
        return None


def pytest_configure(config) -> None:
    sys.modules.pop("mooncake.engine", None)
    sys.meta_path.insert(0, NoRdma())
