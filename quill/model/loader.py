"""Loading a Llama-family model: Hugging Face safetensors, GGUF, or dummy weights from a config.

Weights arrive under Hugging Face names and are copied into quill's fused parameters (q/k/v into
one projection, gate/up into another). Every parameter must be filled exactly once with the right
shape; anything else stops the load with an error that names the tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quill.contract.errors import ModelLoadError
from quill.contract.kv_format import KVCacheFormat, parse_kv_cache_dtype
from quill.model.config import ModelConfig
from quill.model.llama import LlamaForCausalLM
from quill.model.quant import pack_blocks
from quill.model.registry import family
from quill.model.safetensors_file import SafetensorsFile
from quill.model.stored import StoredEmbedding, attach_stored, pack_tiles
from quill.ops.library import available as library_available
from quill.ops.library import cpu_flags

log = logging.getLogger(__name__)


def cpu_has_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    name = aliases.get(name, name)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    if name == "float16" and device.type == "cpu":
        raise ModelLoadError("float16 is only supported on GPU; use bfloat16 or float32 on CPU")
    return getattr(torch, name)


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device, dtype_asked: bool = False
) -> KVCacheFormat:
    """The cache's types for `--kv-cache-dtype` (one, or K,V apart). auto: the model's dtype
    when it was asked for by name (`dtype_asked`: float32 weights asked for mean float32
    arithmetic, the KV cache's too) or when it is 16-bit; else 16-bit, halving the bytes every
    long-context step reads against fp32: bf16 where the CPU has bf16 arithmetic (or on a GPU),
    fp16 (converted by F16C) where it has not. int8 is never chosen by auto: it measured within
    the logprob bound but below 95% agreement of free-running greedy continuations
    (docs/benchmarks.md, "The KV cache in 8 bits"), so it is asked for by name."""

    def one(side: str) -> str:
        if side != "auto":
            return side
        if dtype_asked or model_dtype in (torch.bfloat16, torch.float16):
            return str(model_dtype).removeprefix("torch.")
        return "bfloat16" if device.type == "cuda" or cpu_has_bf16() else "float16"

    key, value = parse_kv_cache_dtype(name)
    return KVCacheFormat(one(key), one(value))


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    hf_config: dict
    source: Path  # the directory or GGUF file the weights came from
    # Our parameter name -> (GGUF type, its blocks, decoded or already packed) where a GGUF file
    # stored it whole in Q8_0, Q4_0 or Q4_1 (`_block_params`).
    blocks: dict[str, tuple[str, tuple[torch.Tensor, ...]]] = field(default_factory=dict)
    # The parameters whose weights are only in `blocks` (never dequantized: quantize_model
    # makes them from their blocks); their float tensors are left empty, untouched.
    unloaded: frozenset[str] = frozenset()
    # The safetensors files some parameters are views of (their pages released once unused).
    mapped: list[SafetensorsFile] = field(default_factory=list)


def load_weights(
    model: LlamaForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    unloaded: frozenset[str] = frozenset(),
    in_place: bool = False,
) -> set[str]:
    """Fill the model's parameters from (Hugging Face name, tensor) pairs. With `in_place`, a
    tensor that is a whole parameter in its dtype (not one part of a merged projection, not
    converted) becomes the parameter itself, a view of the file's map. Returns the names so
    placed (every other tensor was copied, and its pages can go)."""
    params = dict(model.named_parameters())
    placed: set[str] = set()
    target_of = family(config).weight_target
    filled: dict[str, int] = {}  # elements filled, per parameter
    for name, tensor in weights:
        target = target_of(name, config)
        if target is None:
            continue
        if target.param not in params:
            raise ModelLoadError(f"tensor {name!r} has no place in the model")
        param = params[target.param]
        expected = (target.rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        whole = target.offset == 0 and target.rows == param.shape[0]
        if in_place and whole and tensor.dtype == param.dtype and tensor.device == param.device:
            params[target.param] = _replace_parameter(model, param, tensor)
            placed.add(name)
        else:
            with torch.no_grad():
                param[target.offset : target.offset + target.rows].copy_(tensor)
        filled[target.param] = filled.get(target.param, 0) + tensor.numel()
    for name, param in params.items():
        if filled.get(name, 0) != param.numel() and name not in unloaded:
            raise ModelLoadError(f"checkpoint is missing weights for {name!r}")
    return placed


def _replace_parameter(
    model: torch.nn.Module, old: torch.nn.Parameter, tensor: torch.Tensor
) -> torch.nn.Parameter:
    """`tensor` as the parameter wherever `old` is one (a tied weight is in two modules)."""
    new = torch.nn.Parameter(tensor, requires_grad=False)
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is old:
                module._parameters[key] = new
    return new


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {str(path)!r}")
    return files


def _open_safetensors(files: list[Path]) -> list[SafetensorsFile]:
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weight file {str(f)!r}")
    return [SafetensorsFile(f) for f in files]


def _mapped_weights(files: list[SafetensorsFile]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        for name in f.names():
            yield name, f.tensor(name)


def release_unused(model: torch.nn.Module, files: list[SafetensorsFile]) -> None:
    """Let go of the mapped pages of every tensor of `files` the model no longer holds (copied
    at load, or quantized since without a float copy): read once, they would stay counted."""
    held = {p.data_ptr() for p in model.parameters()}
    held |= {w.data_ptr() for m in model.modules()
             if isinstance(w := getattr(m, "float_weight", None), torch.Tensor)}  # fmt: skip
    for f in files:
        f.release_all_but(held)


def _build(
    config: ModelConfig, max_positions: int, dtype, device, stored: dict | None = None
) -> tuple[LlamaForCausalLM, set[str]]:
    """The model with empty weights (loading fills them): built on the meta device for its
    shapes, its modules whose weights are used as stored swapped in (`stored`: Hugging Face
    name -> StoredTensor), then given storage. Not by `Module.to_empty`: its `empty_like` runs
    torch's Python references, whose first use imports sympy, a third of a second of every
    start. Returns the model and the names of the tensors taken as stored."""
    with torch.device("meta"):
        model = family(config).model(config, max_positions)
    taken = attach_stored(model, stored, config, dtype) if stored else set()
    storage: dict[int, torch.nn.Parameter] = {}  # a tied weight gets one tensor
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in storage:
                kind = dtype if p.is_floating_point() else p.dtype
                empty = torch.empty(p.shape, dtype=kind, device=device)
                storage[id(p)] = torch.nn.Parameter(empty, requires_grad=p.requires_grad)
            if p is not None:
                module._parameters[name] = storage[id(p)]
    model.init_rope(max_positions)  # the only buffers: the rotary tables
    return model, taken


def _dummy_init(model: LlamaForCausalLM) -> None:
    """Seeded random weights. On a GPU they are drawn there, in the weights' dtype (an 8B
    model's 8 billion draws on one CPU core took minutes); so GPU and CPU weights differ."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif p.device.type == "cpu":
                gen = generators.setdefault(p.device, torch.Generator().manual_seed(0))
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                gen = generators.get(p.device)
                if gen is None:
                    gen = generators[p.device] = torch.Generator(p.device).manual_seed(0)
                p.normal_(0.0, 0.02, generator=gen)


def load_model(
    path: str | Path,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    keep_stored: bool = False,
    map_floats: bool = False,
) -> LoadedModel:
    """Load from a Hugging Face directory or a GGUF file (dummy weights need only config.json).
    `keep_stored`: a GGUF file's tensors of a type a native kernel reads are used where they lie
    (quill/model/stored.py), never dequantized. `map_floats`: a safetensors file's tensors in
    the dtype computed in that are whole parameters are the parameters, views of the file."""
    path = Path(path)
    hf_config, reader = _read_config(path, load_format)
    is_gguf = reader is not None
    config = ModelConfig.from_hf_dict(hf_config)
    positions = max_positions or config.max_position_embeddings
    stored = {}
    if is_gguf and keep_stored and load_format != "dummy" and device.type == "cpu":
        from quill.model import gguf_loader

        stored = gguf_loader.gguf_stored_tensors(reader, hf_config)
    model, taken = _build(config, positions, dtype, device, stored)
    blocks, unloaded, mapped = {}, frozenset(), []
    if load_format == "dummy":
        _dummy_init(model)
    elif is_gguf:
        from quill.model import gguf_loader

        if taken and library_available():
            # The tiles replace the file's pages they came from (quill/model/stored.py).
            views = {id(s.data): t.data for t in reader.tensors for s in stored.values()
                     if s.data.data_ptr() == t.data.ctypes.data}  # fmt: skip
            pack_tiles(model, lambda s: reader.release(views[id(s.data)]))
        found = gguf_loader.gguf_block_tensors(reader, hf_config)
        # Q8_0 and Q4_x tensors become int8 / int4 weights from their blocks alone (but an
        # embedding table looked up in floats), packed one parameter at a time as they are
        # read, the file's pages let go after each: the model's decoded blocks are never all
        # held at once.
        direct = keep_stored and library_available() and device.type == "cpu"
        blocks = _block_params(found, model, config, reader.release if direct else None)
        unloaded = frozenset(p for p in blocks if direct and _needs_no_floats(model, p))
        target_of = family(config).weight_target
        targets = {t.name: target_of(t.name, config) for t in found}
        skip = set(taken) | {n for n, t in targets.items() if t is not None and t.param in unloaded}
        weights = gguf_loader.gguf_tensors(reader, hf_config, frozenset(skip))
        load_weights(model, weights, config, unloaded)
        # Every tensor not read in place has been copied (floats, blocks): its pages go.
        in_place = {s.data.data_ptr() for s in stored.values() if s.tiles is None}
        for t in reader.tensors:
            if t.data.ctypes.data not in in_place:
                reader.release(t.data)
    else:
        # Weights in the dtype computed in are used where they lie (CPU): parameters that are
        # views of the files' maps; the rest (merged q/k/v and gate/up, converted) copied.
        mapped = _open_safetensors(_safetensors_files(path))
        in_place = map_floats and device.type == "cpu"
        load_weights(model, _mapped_weights(mapped), config, in_place=in_place)
        release_unused(model, mapped)
    model.eval()
    return LoadedModel(model, config, hf_config, path, blocks, unloaded, mapped)


def read_model_config(path: str | Path, load_format: str) -> ModelConfig:
    """The model's shape, without loading its weights."""
    return ModelConfig.from_hf_dict(_read_config(Path(path), load_format)[0])


def _read_config(path: Path, load_format: str) -> tuple[dict, object]:
    """The Hugging Face config, and the open GGUF reader when the model is a GGUF file."""
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    is_gguf = path.is_file() and (path.suffix == ".gguf" or load_format == "gguf")
    if path.is_file() and not is_gguf:
        raise ModelLoadError(f"{str(path)!r} is a file but not a .gguf model")
    if is_gguf:
        from quill.model import gguf_loader

        reader = gguf_loader.open_gguf(path)
        return gguf_loader.gguf_hf_config(reader), reader
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model directory {str(path)!r}")
    return json.loads((path / "config.json").read_text()), None


def _needs_no_floats(model: LlamaForCausalLM, param: str) -> bool:
    """Whether `param` can be its blocks alone: all but an embedding table looked up in floats."""
    return param != "embed_tokens.weight" or isinstance(model.embed_tokens, StoredEmbedding)


def _block_params(found, model: LlamaForCausalLM, config: ModelConfig, release=None) -> dict:
    """Our parameter name -> (GGUF type, its blocks) for each parameter whose rows are all
    stored in one of Q8_0 / Q4_0 / Q4_1 (`found`: gguf_loader.BlockTensor), assembled across the
    file's tensors (q/k/v, gate/up merged); a parameter only partly in one type (a file mixing
    types inside q/k/v) is left out, and gets quantized from its floats. Decoded one parameter
    at a time; with `release`, a parameter that needs no floats is packed for its product at
    once, and its tensors' pages of the file let go (`release(data)`)."""
    rows = {name: p.shape[0] for name, p in model.named_parameters()}
    if isinstance(model.embed_tokens, StoredEmbedding) and model.lm_head is None:
        rows["embed_tokens.weight"] = model.embed_tokens.table.rows  # the head's blocks
    target_of = family(config).weight_target
    groups: dict[str, list] = {}
    for tensor in found:
        target = target_of(tensor.name, config)
        if target is not None:
            groups.setdefault(target.param, []).append((target.offset, tensor))
    out = {}
    for param, pieces in groups.items():
        kinds = {tensor.kind for _, tensor in pieces}
        if len(kinds) != 1 or sum(tensor.rows for _, tensor in pieces) != rows.get(param):
            continue
        pieces.sort(key=lambda piece: piece[0])
        decoded = [tensor.decode() for _, tensor in pieces]
        merged = decoded[0] if len(decoded) == 1 else tuple(map(torch.cat, zip(*decoded)))
        del decoded
        kind = kinds.pop()
        if release is not None and _needs_no_floats(model, param):
            merged = pack_blocks(kind, merged)
            for _, tensor in pieces:
                release(tensor.data)
        out[param] = (kind, merged)
    return out
