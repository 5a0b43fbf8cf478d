"""Command-line flags made from RuntimeConfig's fields (config.py), so a flag
and the option it sets cannot drift: ``--max-model-len``, ``--threads``/``-t``,
``--kernels {fast,a16,reference}``, ``--fuse``/``--no-fuse``, ... with each
field's help and default. Used by every command that runs a model (cli.py)
and by the evaluation tools (eval/)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Iterable

from llamajet.config import RuntimeConfig

_PREFIX = "rt_"  # argparse dest of a runtime flag: rt_<field>


def _kind(f: dataclasses.Field):
    t = str(f.type)
    return bool if t.startswith("bool") else int if t.startswith("int") else str


def runtime_flags(name: str) -> tuple[str, ...]:
    """The command-line flags of RuntimeConfig field `name` (README's options table shows them)."""
    f = next(f for f in dataclasses.fields(RuntimeConfig) if f.name == name)
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)


def add_runtime_args(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                     skip: Iterable[str] = (), defaults: dict | None = None) -> None:
    """Adds a flag for every RuntimeConfig field (or those in `only`, less
    `skip`); `defaults` overrides a field's default for this command."""
    only, skip, defaults = (set(only) if only is not None else None), set(skip), defaults or {}
    g = p.add_argument_group("runtime options (RuntimeConfig)")
    for f in dataclasses.fields(RuntimeConfig):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        flags = runtime_flags(f.name)
        kw: dict = {"dest": _PREFIX + f.name, "default": default}
        if _kind(f) is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _kind(f)
            kw["metavar"] = "N" if _kind(f) is int else "NAME"
            if "choices" in f.metadata:
                kw["choices"], kw["metavar"] = f.metadata["choices"], None
        help = f.metadata["help"]
        if default is not None and (f.name in defaults or "default" not in help):
            help += f" (default: {'on' if default is True else 'off' if default is False else default})"
        g.add_argument(*flags, help=help, **kw)


def runtime_config(a: argparse.Namespace, **override) -> RuntimeConfig:
    """The RuntimeConfig the parsed runtime flags describe (fields without a
    flag keep their defaults), with `override` on top."""
    given = {k[len(_PREFIX):]: v for k, v in vars(a).items() if k.startswith(_PREFIX)}
    return RuntimeConfig().with_options(**{**given, **override})
