"""Command-line flags from a frozen dataclass, and the dataclass back from parsed flags.

Each field is one flag, `--field-name`, so a flag is defined once: its default is the
field's, its help and choices come from the field's metadata (`option`), and its type from the
annotation: `bool` is a switch (store_true); `int`, `float` and `str` parse as such, and so
does `X | None` as X. Metadata `aliases` names older spellings of the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection
from typing import Any, TypeVar

T = TypeVar("T")
_PARSERS = {"int": int, "float": float, "str": str}


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that is also a flag; `kw` (e.g. `choices`) joins its metadata."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def add_flags(ap: argparse.ArgumentParser, cls: type, skip: Collection[str] = ()) -> None:
    """One flag per field of dataclass `cls`, except the fields named in `skip`."""
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            _add_flag(ap, f)


def from_namespace(cls: type[T], ns: object, **overrides: Any) -> T:
    """`cls` from parsed flags, then `overrides`. Attributes that are no field of `cls` are
    ignored; a field missing from `ns`, or None there, keeps its default."""
    names = [f.name for f in dataclasses.fields(cls)]
    values = {n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None}
    return cls(**{**values, **overrides})


def _add_flag(ap: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
    help = f.metadata.get("help", "")
    kind = _flag_type(f)
    if kind == "bool":
        ap.add_argument(*flags, action="store_true", default=f.default, help=help)
        return
    choices = f.metadata.get("choices")
    ap.add_argument(*flags, type=_PARSERS[kind], default=f.default, choices=choices, help=help)


def _flag_type(f: dataclasses.Field) -> str:
    """The field's annotation without its `| None`: one of bool, int, float, str."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kinds = [part.strip() for part in text.split("|") if part.strip() != "None"]
    if len(kinds) != 1 or kinds[0] not in ("bool", *_PARSERS):
        raise TypeError(f"field {f.name}: no flag for the annotation {text!r}")
    return kinds[0]
