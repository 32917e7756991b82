"""The package's version, as SGLang's `/server_info` reports its own."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """The installed distribution's version; "unknown" for a tree that is not installed."""
    try:
        return metadata.version("mpprefill")
    except metadata.PackageNotFoundError:
        return "unknown"
