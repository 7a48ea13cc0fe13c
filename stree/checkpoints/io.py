"""Checkpoint directories (a Hub id is resolved to one by :mod:`.hub`): detect the format, build
the model from the files' own sizes, load the weights with shape checks; and write checkpoints in
each format (test fixtures, exports).

Formats: ``mamba_ssm`` (config.json with ``ssm_cfg``; pytorch_model.bin or model.safetensors,
``backbone.embedding``), ``hf`` (transformers Mamba2: ``model_type`` "mamba2",
``backbone.embeddings``), ``mil`` (MambaInLlama: the Llama config.json plus mamba_config.json,
HF Llama parameter names, lm_head tied when the file has none), and the transformers hybrids by
their ``model_type``: ``bamba``, ``nemotron_h``, ``granitemoehybrid``, ``falcon_h1``, and the
attention-only ``llama`` and ``qwen2``.

Weights: model.safetensors, or shards listed in model.safetensors.index.json; pytorch_model.bin
(or its index) when there are no safetensors. Configs as transformers 4.x and 5.x write them,
infinity included (``Infinity`` literals, 5.x's ``{"__float__": "Infinity"}``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .atomic import write_text, write_with

from ..models.bamba import BambaLM
from ..models.config import HybridConfig, Mamba2Config, dt_limit_of, flag, require
from ..models.hybrid import HybridLM
from ..models.mamba2 import Mamba2LM
from ..models.llama import LlamaLM, Qwen2LM
from ..models.falcon_h1 import FalconH1LM
from ..models.granite import GraniteLM
from .hub import resolve
from ..models.nemotron_h import NemotronHLM
from ..models.parallel import TensorParallel, plan

# transformers families, by model_type: the class reads its config (config_class.from_hf) and
# its parameter names are the files' own.
FAMILIES = {cls.model_type: cls for cls in (BambaLM, NemotronHLM, GraniteLM, FalconH1LM, LlamaLM, Qwen2LM)}
FORMATS = ("mamba_ssm", "hf", "mil", *FAMILIES)
# Families a user may have in mind, refused by name (the message says what is supported).
_KNOWN_UNSUPPORTED = ("zamba2", "jamba", "qwen3_next", "mamba", "falcon_mamba", "lfm2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")

# mamba_ssm Mamba2 options this implementation does not compute; a checkpoint that sets them is refused.
_UNSUPPORTED_SSM = {"D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False}


def _json_object(pairs):
    """transformers 5 writes non-finite floats as ``{"__float__": "Infinity"}``."""
    obj = dict(pairs)
    if obj.keys() == {"__float__"} and isinstance(obj["__float__"], str):
        try:
            return float(obj["__float__"])
        except ValueError:
            pass  # left as a dict: the key that reads it names the file
    return obj


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_json_object)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def detect_format(path) -> str:
    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is a file: give the checkpoint directory that holds it")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    config = _read_json(path / "config.json")
    if (path / "mamba_config.json").exists():
        return "mil"
    model_type = config.get("model_type")
    if model_type == "mamba2":
        return "hf"
    if model_type in FAMILIES:
        return model_type
    if isinstance(config.get("ssm_cfg"), dict):
        return "mamba_ssm"
    supported = ", ".join(repr(t) for t in ("mamba2", *FAMILIES))
    if model_type in _KNOWN_UNSUPPORTED:
        raise ValueError(f"{path / 'config.json'}: model_type {model_type!r} is not supported (supported: {supported}, "
                         "mamba_ssm's ssm_cfg, MambaInLlama)")
    raise ValueError(f"{path / 'config.json'}: unknown checkpoint format (model_type {model_type!r}; supported: "
                     f"{supported}, mamba_ssm's ssm_cfg, MambaInLlama)")


def _config_mamba_ssm(config: dict, file: Path) -> Mamba2Config:
    ssm = config["ssm_cfg"]
    if ssm.get("layer", "Mamba1") != "Mamba2":
        raise ValueError(f"{file}: ssm_cfg.layer is {ssm.get('layer')!r}, only 'Mamba2' is supported")
    for key, value in _UNSUPPORTED_SSM.items():
        if ssm.get(key, value) != value:
            raise ValueError(f"{file}: ssm_cfg.{key} = {ssm[key]!r} is not supported (only {value!r})")
    if config.get("d_intermediate", 0) or config.get("attn_layer_idx"):
        raise ValueError(f"{file}: d_intermediate / attn_layer_idx (mamba_ssm MLP or attention layers) are not supported")
    if not config.get("rms_norm", True):
        raise ValueError(f"{file}: rms_norm = false (LayerNorm blocks) is not supported")
    d_model = require(config, "d_model", file)
    expand = ssm.get("expand", 2)
    if ssm.get("d_ssm") not in (None, expand * d_model):
        raise ValueError(f"{file}: ssm_cfg.d_ssm different from d_inner is not supported")
    return Mamba2Config(
        d_model=d_model, n_layer=require(config, "n_layer", file), vocab_size=require(config, "vocab_size", file),
        d_state=ssm.get("d_state", 128), d_conv=ssm.get("d_conv", 4), expand=expand, headdim=ssm.get("headdim", 64),
        ngroups=ssm.get("ngroups", 1), chunk_size=ssm.get("chunk_size", 256),
        dt_limit=dt_limit_of(ssm.get("dt_limit"), file, "ssm_cfg.dt_limit"),
        conv_bias=flag(ssm, "conv_bias", True, file), bias=flag(ssm, "bias", False, file),
        pad_vocab_size_multiple=config.get("pad_vocab_size_multiple", 8),
        tie_embeddings=flag(config, "tie_embeddings", True, file), residual_in_fp32=flag(config, "residual_in_fp32", True, file),
    )


def _config_hf(config: dict, file: Path) -> Mamba2Config:
    hidden, expand, head_dim = (require(config, k, file) for k in ("hidden_size", "expand", "head_dim"))
    num_heads = require(config, "num_heads", file)
    if num_heads * head_dim != hidden * expand:
        raise ValueError(f"{file}: num_heads * head_dim = {num_heads * head_dim} != hidden_size * expand = {hidden * expand}")
    return Mamba2Config(
        d_model=hidden, n_layer=require(config, "num_hidden_layers", file),
        vocab_size=require(config, "vocab_size", file), d_state=require(config, "state_size", file),
        d_conv=config.get("conv_kernel", 4), expand=expand, headdim=head_dim,
        ngroups=require(config, "n_groups", file), chunk_size=config.get("chunk_size", 256),
        dt_limit=dt_limit_of(config.get("time_step_limit"), file),
        conv_bias=flag(config, "use_conv_bias", True, file), bias=flag(config, "use_bias", False, file),
        pad_vocab_size_multiple=1,  # transformers stores the padded size as vocab_size
        tie_embeddings=flag(config, "tie_word_embeddings", False, file), residual_in_fp32=flag(config, "residual_in_fp32", True, file),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
    )


def _config_mil(config: dict, config_file: Path, mamba: dict, mamba_file: Path, plain_rope: bool) -> HybridConfig:
    if mamba.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{mamba_file}: hidden_act {mamba['hidden_act']!r} is not supported (only 'silu')")
    ssm = require(mamba, "ssm_cfg", mamba_file)
    heads = require(config, "num_attention_heads", config_file)
    hidden = require(mamba, "d_model", mamba_file)
    scaling = config.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling, rope_type=scaling.get("rope_type", scaling.get("type", "default")))
        if scaling["rope_type"] == "default":
            scaling = None
    return HybridConfig(
        d_model=hidden, n_layer=require(mamba, "n_layer", mamba_file),
        vocab_size=mamba.get("vocab_size") or require(config, "vocab_size", config_file),
        attn_layers=tuple(require(mamba, "attn_layers", mamba_file)),
        intermediate_size=require(mamba, "intermediate_size", mamba_file), num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads, d_inner=require(mamba, "d_inner", mamba_file),
        d_xb=require(mamba, "d_xb", mamba_file), d_state=ssm.get("d_state", 128), ngroups=ssm.get("ngroups", 1),
        d_conv=ssm.get("d_conv", 4), rms_norm_eps=mamba.get("rms_norm_eps", config.get("rms_norm_eps", 1e-5)),
        rope_theta=config.get("rope_theta", 10000.0), rope_scaling=None if plain_rope else scaling,
        tie_word_embeddings=flag(config, "tie_word_embeddings", False, config_file),
    )


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
        weight_map = _read_json(file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{file}: missing or empty 'weight_map'")
        shards = [path / shard for shard in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.exists():
                raise FileNotFoundError(f"{shard} is missing (listed in {file})")
        return file, shards
    raise FileNotFoundError(f"{path} holds no weights ({' or '.join(WEIGHT_FILES)})")


def _read_weights(path: Path) -> tuple[dict, Path]:
    """The state dict and the file that holds it (the index of a sharded checkpoint)."""
    file, shards = _weight_files(path)
    state = {}
    for shard in shards:
        state.update(_read_weight_file(shard))
    return state, file


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class _SlicedWeights:
    """A checkpoint's tensors by key, read on demand: from safetensors files (one, or the shards
    of an index) only the slices asked for; a pytorch_model.bin is read whole (pickles cannot be
    sliced) and sliced in memory."""

    def __init__(self, path: Path):
        self.handles, self.tensors = {}, None
        self.file, shards = _weight_files(path)
        if not shards[0].name.endswith(".safetensors"):
            self.tensors, _ = _read_weights(path)
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


def _slices(shapes: dict, rules: dict, read, tp: TensorParallel, like: dict, device) -> dict:
    """Rank ``tp.rank``'s part of every tensor in ``shapes`` (key: full shape): ``read(key, idx)``
    reads a part; ``rules`` (from :func:`~stree.models.parallel.plan`) say which; the results
    take the dtype of ``like[key]`` (the local model's tensor) and land on ``device``."""
    out = {}
    for key, shape in shapes.items():
        take = lambda idx, key=key: read(key, idx)
        t = rules[key].take(take, shape, tp) if key in rules else take(None)
        out[key] = t.to(device=device, dtype=like[key].dtype).contiguous()
    return out


def _check_shapes(expected: dict, found: dict, where, config_where) -> None:
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


def _load_shard(build, cfg, fmt: str, path: Path, dtype, device, check_finite: bool, tp: TensorParallel):
    """:func:`load` of rank ``tp.rank``'s slice: the model is built on "meta" at full size, its
    checkpoint shapes checked against the files, resized by ``plan`` (the divisibility checks),
    and only then are the rank's slices read."""
    source = _SlicedWeights(path)
    rename = ("backbone.embeddings.", "backbone.embedding.") if fmt == "hf" else None
    to_file = {(k.replace(*rename, 1) if rename else k): k for k in source.keys()}
    if fmt == "mil" and "lm_head.weight" not in to_file:  # as load: MIL 3B ships no lm_head
        cfg = HybridConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    if build.embed_key not in to_file:
        raise ValueError(f"{source.file}: missing key {build.embed_key!r}")
    model = build(cfg, device="meta", dtype=dtype or source.dtype(to_file[build.embed_key]))
    tied = model.lm_head.weight is model.embed.weight
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        expected.pop("lm_head.weight")
        to_file.pop("lm_head.weight", None)
    _check_shapes(expected, {k: source.shape(f) for k, f in to_file.items()}, source.file, path / "config.json")
    rules = plan(model, tp)
    local = model.state_dict()
    state = _slices(expected, rules, lambda key, idx: source.read(to_file[key], idx), tp, local,
                    device or torch.device("cpu"))
    if check_finite:
        check_finite_weights(state, source.file)
    _fill(model, state, tied, source.file, path / "config.json", share=True)
    return model.eval()


def shard(model, tp: TensorParallel):
    """Rank ``tp.rank``'s slice of an in-memory stree model (``model`` is left whole; the
    replicated tensors are shared with it, the split ones are copies): what ``load(...,
    tensor_parallel=tp)`` makes of the model's checkpoint."""
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"tp must be a TensorParallel, got {type(tp).__name__}")
    if getattr(model, "tp", None) is not None:
        raise ValueError(f"the model is already a slice ({model.tp})")
    local = type(model)(model.cfg, device="meta", dtype=model.dtype)
    tied = model.lm_head.weight is model.embed.weight
    full = model.state_dict()
    if tied:
        full.pop("lm_head.weight")
    rules = plan(local, tp)
    state = _slices({k: tuple(t.shape) for k, t in full.items()}, rules,
                    lambda key, idx: full[key] if idx is None else full[key][idx], tp, local.state_dict(), model.device)
    _fill(local, state, tied, f"{type(model).__name__}.state_dict()", "its config", share=True)
    return local.eval()


def check_finite_weights(state: dict, where) -> None:
    """A ValueError naming the first tensor of ``state`` holding NaN or inf."""
    for key, tensor in state.items():
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{where}: {key!r} holds {bad} NaN or inf values (load(..., check_finite=False) skips "
                             "this check)")


def check_device(device) -> torch.device | None:
    """``device`` as a torch.device that exists here (None stays None), else a ValueError."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type not in ("cpu", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu or cuda)")
    return device


def _config(fmt: str, raw: dict, path: Path, plain_rope: bool):
    """The model class and config of a checkpoint directory; errors name the config file."""
    config_file = path / "config.json"
    try:
        if fmt == "mil":
            mamba_file = path / "mamba_config.json"
            return HybridLM, _config_mil(raw, config_file, _read_json(mamba_file), mamba_file, plain_rope)
        if fmt in FAMILIES:
            return FAMILIES[fmt], FAMILIES[fmt].config_class.from_hf(raw, config_file)
        return Mamba2LM, _config_hf(raw, config_file) if fmt == "hf" else _config_mamba_ssm(raw, config_file)
    except ValueError as exc:  # a config class's own check names no file
        if str(path) in str(exc):
            raise
        raise ValueError(f"{config_file}: {exc}") from None


def load(path, dtype: torch.dtype | None = None, device=None, plain_rope: bool = False, check_finite: bool = True,
         tensor_parallel: TensorParallel | None = None, revision: str | None = None):
    """Build and load the model in checkpoint directory ``path`` (format auto-detected), or of
    the Hub id ``path`` (``org/name``; ``revision``: its branch, tag or commit), fetched into or
    found in the Hub cache (:mod:`stree.checkpoints.hub`).

    ``dtype`` defaults to the checkpoint's embedding dtype; Mamba2's D stays fp32 as in mamba_ssm.
    ``plain_rope`` drops a hybrid's llama3 RoPE scaling (what MIL's own inference code runs).
    ``check_finite``: refuse weights holding NaN or inf (one pass over every tensor; off for speed).
    ``tensor_parallel``: load this rank's slice of every layer (see :mod:`stree.models.parallel`),
    reading only those slices of safetensors files.
    Everything is checked (config, device, dtype, the world size's divisibility) before the
    weights are read.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
        raise TypeError(f"tensor_parallel must be a TensorParallel (stree.models.parallel.join), got "
                        f"{type(tensor_parallel).__name__}")
    device = check_device(device)
    path = resolve(path, revision)
    fmt = detect_format(path)
    config_file = path / "config.json"
    build, cfg = _config(fmt, _read_json(config_file), path, plain_rope)
    if tensor_parallel is not None:
        return _load_shard(build, cfg, fmt, path, dtype, device, check_finite, tensor_parallel)
    state, weights_file = _read_weights(path)
    if check_finite:
        check_finite_weights(state, weights_file)
    if fmt == "mil" and "lm_head.weight" not in state:  # MIL 3B ships no lm_head: tied to the embedding
        cfg = HybridConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    if fmt == "hf":
        state = {k.replace("backbone.embeddings.", "backbone.embedding.", 1): v for k, v in state.items()}
    tied = cfg.tie_embeddings if build is Mamba2LM else cfg.tie_word_embeddings
    embedding = state.get(build.embed_key)
    if embedding is None:
        file_key = "backbone.embeddings.weight" if fmt == "hf" else build.embed_key
        raise ValueError(f"{weights_file}: missing key {file_key!r}")
    model = build(cfg, device=device, dtype=dtype or embedding.dtype)
    _fill(model, state, tied, weights_file, config_file)
    return model.eval()


def _fill(model, state: dict, tied: bool, where, config_where, share: bool = False) -> None:
    """Load ``state`` into ``model`` after checking every key and shape (``where`` names the
    source of the weights, ``config_where`` of the config); ``share``: take the tensors
    themselves (a model built on "meta"), then rebuild the buffers no checkpoint holds."""
    expected = model.state_dict()
    if tied:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding when present
        expected.pop("lm_head.weight")
    _check_shapes({k: t.shape for k, t in expected.items()}, {k: t.shape for k, t in state.items()}, where,
                  config_where)
    model.load_state_dict(state, strict=not tied, assign=share)
    if share:
        if tied:
            model.lm_head.weight = model.embed.weight
        for module in model.modules():
            if hasattr(module, "make_buffers"):
                module.make_buffers(model.device)


def _file_name(key: str, memory_names: dict) -> str:
    """A transformers in-memory parameter name as checkpoints (and the stree class) name it."""
    for memory, file in memory_names.items():
        if key.endswith(memory):
            return key[:-len(memory)] + file
    return key


def from_transformers(hf_model):
    """The stree model of a loaded transformers ``Mamba2ForCausalLM``, ``BambaForCausalLM``,
    ``NemotronHForCausalLM``, ``GraniteMoeHybridForCausalLM``, ``FalconH1ForCausalLM``, ``LlamaForCausalLM``
    or ``Qwen2ForCausalLM``, sharing its parameter tensors (no copy: a change to one is a
    change to the other). Its config is read as ``load`` reads config.json."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    where = f"{type(hf_model).__name__}.config"
    if model_type != "mamba2" and model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(repr(t) for t in ('mamba2', *FAMILIES))})")
    raw = json.loads(json.dumps(config.to_dict(), default=str), object_pairs_hook=_json_object)
    state = dict(hf_model.state_dict())
    if model_type == "mamba2":
        build, cfg = Mamba2LM, _config_hf(raw, where)
        tied = cfg.tie_embeddings
        state = {k.replace("backbone.embeddings.", "backbone.embedding.", 1): v for k, v in state.items()}
    else:
        build = FAMILIES[model_type]
        cfg = build.config_class.from_hf(raw, where)
        tied = cfg.tie_word_embeddings
        prefix = build.embed_key.split(".")[0] + "."  # transformers keeps the modules under "model."
        state = {_file_name(prefix + k[len("model."):] if k.startswith("model.") else k,
                            getattr(build, "memory_names", {})): v for k, v in state.items()}
        if hasattr(build, "file_state"):
            state = build.file_state(state)
    weights = next(iter(state.values()))
    model = build(cfg, device="meta", dtype=weights.dtype)
    _fill(model, state, tied, f"{type(hf_model).__name__}.state_dict()", where, share=True)
    return model.eval()


def save(model, path, format: str | None = None) -> None:
    """Write ``model`` as a checkpoint directory (config file(s) + model.safetensors): a Mamba2LM
    as ``mamba_ssm`` (default) or ``hf``, a HybridLM as ``mil``, a transformers family as
    transformers saves it (its model_type)."""
    family = getattr(model, "model_type", None)
    if format is None:
        format = family or ("mil" if isinstance(model, HybridLM) else "mamba_ssm")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    fits = format == family if family else (format == "mil") == isinstance(model, HybridLM) and format not in FAMILIES
    if not fits:
        raise ValueError(f"format {format!r} does not fit a {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_embeddings", getattr(cfg, "tie_word_embeddings", False)):
        state.pop("lm_head.weight")  # safetensors stores each tensor once; loading re-ties
    if family:
        config = model.cfg.to_hf()
    elif format == "mil":
        write_text(path / "mamba_config.json", json.dumps(dict(
            d_model=cfg.d_model, ssm_cfg=dict(expand=cfg.d_inner // cfg.d_model, ngroups=cfg.ngroups,
                                              d_state=cfg.d_state, d_conv=cfg.d_conv),
            rms_norm_eps=cfg.rms_norm_eps, vocab_size=None, d_inner=cfg.d_inner, d_xb=cfg.d_xb,
            intermediate_size=cfg.intermediate_size, hidden_act="silu", n_layer=cfg.n_layer,
            attn_layers=list(cfg.attn_layers)), indent=2))
        config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size,
                      hidden_size=cfg.d_model, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layer,
                      num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                      head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                      rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings)
    elif format == "hf":
        state = {k.replace("backbone.embedding.", "backbone.embeddings.", 1): v for k, v in state.items()}
        config = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=cfg.d_model,
                      num_hidden_layers=cfg.n_layer, vocab_size=cfg.padded_vocab_size, state_size=cfg.d_state,
                      conv_kernel=cfg.d_conv, expand=cfg.expand, num_heads=cfg.nheads, head_dim=cfg.headdim,
                      n_groups=cfg.ngroups, chunk_size=cfg.chunk_size, time_step_limit=list(cfg.dt_limit),
                      use_bias=cfg.bias, use_conv_bias=cfg.conv_bias, tie_word_embeddings=cfg.tie_embeddings,
                      residual_in_fp32=cfg.residual_in_fp32, layer_norm_epsilon=cfg.norm_eps)
    else:
        ssm = dict(layer="Mamba2", d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand, headdim=cfg.headdim,
                   ngroups=cfg.ngroups, chunk_size=cfg.chunk_size, dt_limit=list(cfg.dt_limit), bias=cfg.bias,
                   conv_bias=cfg.conv_bias)
        config = dict(d_model=cfg.d_model, d_intermediate=0, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                      ssm_cfg=ssm, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                      residual_in_fp32=cfg.residual_in_fp32, fused_add_norm=True,
                      pad_vocab_size_multiple=cfg.pad_vocab_size_multiple, tie_embeddings=cfg.tie_embeddings)
    write_with(path / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
    write_text(path / "config.json", json.dumps(config, indent=2))


def load_tokenizer(path, vocab_size: int | None = None, revision: str | None = None):
    """The tokenizer saved in checkpoint directory ``path`` (or of that Hub id, as :func:`load`),
    loaded offline. With ``vocab_size`` (the model's), a tokenizer that can produce ids the model
    has no row for is a ValueError."""
    from transformers import AutoTokenizer

    path = resolve(path, revision)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path} holds no tokenizer (tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer in {path} has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")
    return tokenizer
