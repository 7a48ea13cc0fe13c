"""Checkpoint weights: the files a directory holds them in (one file, or the shards of an index;
safetensors, else pytorch_model.bin), read whole or, for tensor parallelism, a rank's slices only;
checked against the model's own keys and shapes and filled into it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..models.parallel import TensorParallel
from .formats import read_json

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _read_weight_file(file: Path) -> dict:
    try:
        if file.name.endswith(".safetensors"):
            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{file} could not be read: {exc}") from exc


def _weight_files(path: Path) -> tuple[Path, list[Path]]:
    """The file that names a checkpoint's weights (the index of a sharded one) and the files
    holding them, each checked to exist."""
    for name in WEIGHT_FILES:
        file = path / name
        if not file.exists():
            continue
        if not name.endswith(".index.json"):
            return file, [file]
        weight_map = read_json(file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{file}: missing or empty 'weight_map'")
        shards = [path / shard for shard in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.exists():
                raise FileNotFoundError(f"{shard} is missing (listed in {file})")
        return file, shards
    raise FileNotFoundError(f"{path} holds no weights ({' or '.join(WEIGHT_FILES)})")


def read_weights(path: Path) -> tuple[dict, Path]:
    """The state dict and the file that holds it (the index of a sharded checkpoint)."""
    file, shards = _weight_files(path)
    state = {}
    for shard in shards:
        state.update(_read_weight_file(shard))
    return state, file


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class SlicedWeights:
    """A checkpoint's tensors by key, read on demand: from safetensors files (one, or the shards
    of an index) only the slices asked for; a pytorch_model.bin is read whole (pickles cannot be
    sliced) and sliced in memory."""

    def __init__(self, path: Path):
        self.handles, self.tensors = {}, None
        self.file, shards = _weight_files(path)
        if not shards[0].name.endswith(".safetensors"):
            self.tensors, _ = read_weights(path)
            return
        for shard in shards:
            try:
                handle = safe_open(str(shard), "pt", device="cpu")
            except Exception as exc:
                raise ValueError(f"{shard} could not be read: {exc}") from exc
            self.handles.update((key, handle) for key in handle.keys())

    def keys(self) -> list[str]:
        return list(self.handles if self.tensors is None else self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        if self.tensors is not None:
            return tuple(self.tensors[key].shape)
        return tuple(self.handles[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        if self.tensors is not None:
            return self.tensors[key].dtype
        name = self.handles[key].get_slice(key).get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self.file}: {key!r} has dtype {name}, not a float type stree loads")
        return SAFETENSORS_DTYPES[name]

    def read(self, key: str, idx: tuple | None) -> torch.Tensor:
        """``key``'s tensor, or the part ``idx`` (a tuple of slices) of it."""
        if self.tensors is not None:
            t = self.tensors[key]
            return t if idx is None else t[idx]
        part = self.handles[key].get_slice(key)
        return part[:] if idx is None else part[idx]


def slices(shapes: dict, rules: dict, read, tp: TensorParallel, like: dict, device) -> dict:
    """Rank ``tp.rank``'s part of every tensor in ``shapes`` (key: full shape): ``read(key, idx)``
    reads a part; ``rules`` (from :func:`~stree.models.parallel.plan`) say which; the results
    take the dtype of ``like[key]`` (the local model's tensor) and land on ``device``."""
    out = {}
    for key, shape in shapes.items():
        take = lambda idx, key=key: read(key, idx)
        t = rules[key].take(take, shape, tp) if key in rules else take(None)
        out[key] = t.to(device=device, dtype=like[key].dtype).contiguous()
    return out


def check_shapes(expected: dict, found: dict, where, config_where) -> None:
    """Every key of ``expected`` (key: shape) present in ``found`` with that shape, and nothing else."""
    for key, shape in expected.items():
        if key not in found:
            raise ValueError(f"{where}: missing key {key!r}")
        if tuple(found[key]) != tuple(shape):
            raise ValueError(f"{where}: {key!r} has shape {tuple(found[key])}, the config in {config_where} implies "
                             f"{tuple(shape)}")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ValueError(f"{where}: unexpected keys {unexpected[:5]}")


def check_finite_weights(state: dict, where) -> None:
    """A ValueError naming the first tensor of ``state`` holding NaN or inf."""
    for key, tensor in state.items():
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{where}: {key!r} holds {bad} NaN or inf values (load(..., check_finite=False) skips "
                             "this check)")


def fill(model, state: dict, tied: bool, where, config_where, share: bool = False) -> None:
    """Load ``state`` into ``model`` after checking every key and shape (``where`` names the
    source of the weights, ``config_where`` of the config); ``share``: take the tensors
    themselves (a model built on "meta"), then rebuild the buffers no checkpoint holds."""
    expected = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding when present
        expected.pop("lm_head.weight")
    check_shapes({k: t.shape for k, t in expected.items()}, {k: t.shape for k, t in state.items()}, where,
                  config_where)
    model.load_state_dict(state, strict=not tied, assign=share)
    if share:
        if tied:
            model.lm_head.weight = model.embed.weight
        for module in model.modules():
            if hasattr(module, "make_buffers"):
                module.make_buffers(model.device)


def file_name(key: str, memory_names: dict) -> str:
    """A transformers in-memory parameter name as checkpoints (and the stree class) name it."""
    for memory, file in memory_names.items():
        if key.endswith(memory):
            return key[:-len(memory)] + file
    return key
