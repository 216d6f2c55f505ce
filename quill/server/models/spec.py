"""The models a multi-model server offers: `--model NAME=PATH[:option=value...]` (repeated) and
`--model-dir DIR` (every .gguf file and every model directory in it, by its name), each with
its own engine options over the server's.

A model's options are the engine's flags without their dashes (`quantization=int4`,
`max_model_len=4096`, `kv_cache_memory=1GiB`, `dtype=float32`), parsed by the same parser as
`quill serve`'s own, so each is checked and typed as it would be there.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from quill.config import EngineConfig
from quill.engine_args import add_engine_arguments, engine_options
from quill.server.models.catalog import ModelEntry

# What a model of a multi-model server gets for its KV cache when nothing says otherwise: a
# single model's default takes a share of the free memory, which would starve the others.
DEFAULT_KV_MEMORY = 512 << 20


def parse_model_flag(text: str) -> ModelEntry:
    """`NAME=PATH[:option=value...]` -> its entry; ValueError naming what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--model {text!r}: expected NAME=PATH[:option=value...]")
    path, *pairs = rest.split(":")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--model {text!r}: option {pair!r} is not option=value")
        options[key.strip().replace("-", "_")] = value.strip()
    return ModelEntry(name.strip(), Path(path).expanduser(), options)


def scan_model_dir(directory: Path) -> list[ModelEntry]:
    """Every .gguf file and every directory holding a config.json, named by its stem / name."""
    if not directory.is_dir():
        raise ValueError(f"--model-dir {str(directory)!r} is not a directory")
    entries = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.suffix == ".gguf":
            entries.append(ModelEntry(path.stem, path))
        elif path.is_dir() and (path / "config.json").is_file():
            entries.append(ModelEntry(path.name, path))
    return entries


def model_entries(args: argparse.Namespace) -> list[ModelEntry]:
    """The server's models in the order given (the first is the default); names unique."""
    entries: list[ModelEntry] = []
    if args.model:
        path = Path(args.model).expanduser()
        entries.append(ModelEntry(path.stem if path.suffix == ".gguf" else path.name, path))
    entries += [parse_model_flag(text) for text in args.models or []]
    for directory in args.model_dirs or []:
        entries += scan_model_dir(Path(directory).expanduser())
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise ValueError(f"two models are named {entry.name!r}")
        seen.add(entry.name)
        if not entry.path.exists():
            raise ValueError(f"model {entry.name!r}: {str(entry.path)!r} does not exist")
        engine_config(entry, args)  # its options checked now, not at its first request
    if not entries:
        raise ValueError("no models: give --model NAME=PATH or --model-dir DIR")
    return entries


def engine_config(entry: ModelEntry, args: argparse.Namespace) -> EngineConfig:
    """The engine options of one model: the server's, its own over them."""
    parser = argparse.ArgumentParser(prog=f"model {entry.name}", add_help=False,
                                     exit_on_error=False)  # fmt: skip
    add_engine_arguments(parser)
    argv = []
    for key, value in entry.options.items():
        flag = f"--{key.replace('_', '-')}"
        action = parser._option_string_actions.get(flag)
        if action is not None and action.nargs == 0:  # a switch: true / false
            on = value.lower() in ("1", "true", "yes", "on")
            negated = f"--no-{key.replace('_', '-')}"
            argv += [flag] if on else [negated] if negated in parser._option_string_actions else []
        else:
            argv += [flag, value]
    try:
        ns = parser.parse_args(argv, namespace=copy.copy(args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"model {entry.name!r}: {e}") from None
    options = engine_options(ns)
    if options["kv_cache_memory"] is None:
        options["kv_cache_memory"] = DEFAULT_KV_MEMORY
    return EngineConfig(model=str(entry.path), seed=args.seed, **options)
