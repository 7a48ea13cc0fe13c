"""Tensor parallelism over ``torch.distributed`` (Megatron-style): every rank holds a slice of
each layer and the whole decoding protocol runs unchanged on every rank.

- Mamba2: heads and groups split; ``in_proj`` column-parallel per block (z, x, B, C, dt: each
  rank its 1/world of every block), the conv, the SSM state and the gated norm (per group) local,
  ``out_proj`` row-parallel. A model of one group (most checkpoints) keeps B and C whole on every
  rank, and its gated norm all-reduces one mean square per token.
- Attention: query and K/V heads split, ``o_proj`` row-parallel; the KV cache holds the rank's
  K/V heads only.
- MLPs and MoE experts: the intermediate width split (each rank a slice of every expert; the
  router replicated).
- Embedding and head vocabulary-parallel (rows padded up to a multiple of the world size).

A row-parallel output is a partial sum: the block loop all-reduces each block's mixer output
and MLP output once (a parallel pair of mixers, Falcon-H1's, once for both); a row-parallel bias
is held by rank 0 only (zeros elsewhere) so that it is counted once. The logits are gathered on
every rank. No rank holds a whole layer's Mamba state.

:func:`plan` turns a model built on "meta" into its rank's shapes and says how each checkpoint
tensor is sliced (:class:`Split`, :class:`VocabSplit`, :class:`FirstRank`): the loader reads
only those slices (``stree.models.load(..., tensor_parallel=...)``).
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .layers.attention import LlamaAttention
from .layers.norms import GatedRMSNorm
from .layers.mamba2 import Mamba2Mixer
from .layers.mlp import FusedSwiGLU, ReluSquaredMLP, SwiGLU
from .layers.moe import GroupedMoE, TopKMoE


class TensorParallel:
    """The ranks of a process group (default: the world) one model is split over."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tensor parallelism needs torch.distributed initialised: launch with torchrun "
                             "(--nproc-per-node N) and call stree.models.parallel.join(N), or "
                             "torch.distributed.init_process_group first")
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.src = 0 if group is None else dist.get_global_rank(group, 0)

    def __repr__(self) -> str:
        return f"TensorParallel(rank {self.rank} of {self.world})"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as rank 0 holds it (in place; same shape and dtype on every rank)."""
        dist.broadcast(t, self.src, group=self.group)
        return t

    def embed(self, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows of the tokens its slice holds."""
        rows = weight.shape[0]
        local = tokens - self.rank * rows
        inside = (local >= 0) & (local < rows)
        x = F.embedding(local.clamp(0, rows - 1), weight).masked_fill(~inside[..., None], 0.0)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The full ``[..., vocab_size]`` logits from every rank's slice (on every rank)."""
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def join(size: int, device=None) -> TensorParallel:
    """The world of a ``torchrun`` launch as a :class:`TensorParallel` of ``size`` ranks. The
    default process group is initialised here from torchrun's environment when it is not yet
    (NCCL for a CUDA ``device``, gloo otherwise); a world of another size is a ValueError."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {size!r}")
    if not dist.is_available():
        raise ValueError("tensor_parallel needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ValueError(f"tensor_parallel={size} needs a distributed launch: torchrun --nproc-per-node {size} ...")
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(device)  # NCCL binds each rank to the current device
        # Imported after the group began, torch._dynamo (which building a model on "meta" imports) keeps
        # the group's backend alive past destroy_process_group (torch 2.13: its torch.distributed._shard
        # import does): gloo's worker threads then ran on into the interpreter's exit, and one that freed
        # the last collective's tensor there aborted the rank (about one torchrun launch in fifty).
        importlib.import_module("torch._dynamo")

        dist.init_process_group("nccl" if cuda else "gloo")
        global _JOINED
        if not _JOINED:
            atexit.register(_leave_at_exit)  # the backstop: a script that never calls leave() still exits cleanly
        _JOINED = True
    tp = TensorParallel()
    if tp.world != size:
        raise ValueError(f"tensor_parallel={size} but the launch has {tp.world} ranks")
    return tp


_JOINED = False  # whether join() started the default process group (then leave() ends it)
MEET_TIMEOUT_S = 60.0


def leave(meet: bool = True) -> bool:
    """End the process group :func:`join` started (nothing where it did not, or has ended); returns
    whether it ended one. With ``meet``, every rank first waits for the others at a barrier, so
    that none tears down its connections while another still talks to it: gloo's threads then
    abort the process at exit ("terminate called without an active exception"), and the launch
    fails although the work was done. Leave ``meet`` off where this rank fails alone (the others
    may be inside a collective that would never match); on gloo the barrier gives up after
    ``MEET_TIMEOUT_S``."""
    global _JOINED
    if not _JOINED or not dist.is_initialized():
        _JOINED = False
        return False
    _JOINED = False
    try:
        if meet and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=MEET_TIMEOUT_S))
        elif meet:
            dist.barrier()
    except RuntimeError as exc:  # another rank failed on its own and never came: leave all the same
        print(f"stree: rank {dist.get_rank()} left without the other ranks ({str(exc).splitlines()[0]})",
              file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return True


def _leave_at_exit() -> None:
    # an uncaught exception is ending this rank (sys.last_value is set before atexit runs): do not wait
    leave(meet=getattr(sys, "last_value", None) is None)


def agree_on_error(tp: TensorParallel, error: BaseException | None) -> None:
    """After every rank checked its own inputs (``error``: what its check raised, None if it
    passed): a ValueError on every rank naming the first rank that failed and its message, or
    none anywhere. A rank that fails alone must not exit while the others wait for it in a
    collective: they would hang, or be killed with a report that hides the message."""
    messages = [None] * tp.world
    dist.all_gather_object(messages, None if error is None else str(error), group=tp.group)
    for rank, message in enumerate(messages):
        if message is not None:
            raise ValueError(f"rank {rank}: {message}") from error


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    """How many processes share this machine (torchrun's LOCAL_WORLD_SIZE; 1 without one)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


# ---- how a checkpoint tensor is sliced ------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Along ``dim`` the full tensor is the concatenation of blocks of ``sizes``; a rank holds
    its 1/world of every block (the blocks' units were checked to divide), or the whole block
    where ``whole`` says so (replicated: Mamba2's one group of B and C)."""

    dim: int
    sizes: tuple[int, ...]
    whole: tuple[bool, ...] = ()

    def take(self, read, shape, tp) -> torch.Tensor:
        parts, start = [], 0
        for i, size in enumerate(self.sizes):
            rep = i < len(self.whole) and self.whole[i]
            n = size if rep else size // tp.world
            lo = start if rep else start + tp.rank * n
            idx = [slice(None)] * len(shape)
            idx[self.dim] = slice(lo, lo + n)
            parts.append(read(tuple(idx)))
            start += size
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


@dataclass(frozen=True)
class VocabSplit:
    """Rows of the embedding / head: ``ceil(V / world)`` per rank, the last rank's padded with zeros."""

    def take(self, read, shape, tp) -> torch.Tensor:
        n = -(-shape[0] // tp.world)
        lo = min(tp.rank * n, shape[0])
        hi = min(lo + n, shape[0])
        part = read((slice(lo, hi),) + (slice(None),) * (len(shape) - 1))
        if hi - lo == n:
            return part
        return torch.cat([part, part.new_zeros((n - (hi - lo), *shape[1:]))])


@dataclass(frozen=True)
class FirstRank:
    """A row-parallel layer's bias: added once, by rank 0 (zeros elsewhere)."""

    def take(self, read, shape, tp) -> torch.Tensor:
        t = read(None)
        return t if tp.rank == 0 else torch.zeros_like(t)


def _divides(world: int, where: str, **counts) -> None:
    for name, count in counts.items():
        if count % world:
            raise ValueError(f"{where}: {name} = {count} is not divisible by the tensor-parallel world size {world}")


def _linear(prefix: str, layer: nn.Linear, split: Split, row_parallel: bool) -> dict:
    rules = {f"{prefix}.weight": split}
    if layer.bias is not None:
        rules[f"{prefix}.bias"] = FirstRank() if row_parallel else split
    return rules


def _mamba2(m: Mamba2Mixer, tp) -> tuple[dict, dict]:
    c, world = m.cfg, tp.world
    # One group (Mamba2-2.7B, Bamba, Granite 4.0-H, Falcon-H1) is held whole by every rank, and
    # its gated norm, which spans the ranks, sums its squares over them; more groups are split.
    one_group = c.ngroups == 1 and c.d_xb is None and world > 1
    counts = dict(nheads=c.nheads) if one_group else dict(nheads=c.nheads, ngroups=c.ngroups)
    if c.d_xb is not None:
        counts.update(d_xb_heads=c.d_xb // c.headdim, d_xb_groups=c.d_xb // c.d_state)
    _divides(world, "Mamba2 mixer", **counts)
    z, x, B, C, dt = c.d_inner, c.x_dim, c.B_dim, c.C_dim, c.nheads
    whole = (False, False, one_group, one_group)
    rules = {**_linear("in_proj", m.in_proj, Split(0, (z, x, B, C, dt), whole), False),
             **_linear("conv1d", m.conv1d, Split(0, (x, B, C), whole[1:]), False),
             **_linear("out_proj", m.out_proj, Split(1, (z,)), True),
             "dt_bias": Split(0, (dt,)), "A_log": Split(0, (dt,)), "D": Split(0, (dt,))}
    if isinstance(m.norm, GatedRMSNorm):
        rules["norm.weight"] = Split(0, (z,))
        if one_group:  # the group (group_size channels, all of d_inner) spans the ranks
            m.norm.tp = tp
    m.cfg = replace(c, d_ssm=z // world, ngroups=1 if one_group else c.ngroups // world,
                    d_xb=None if c.d_xb is None else c.d_xb // world)
    m.conv1d.in_channels = m.conv1d.out_channels = m.conv1d.groups = m.cfg.conv_dim
    return rules, rules


def _attention(m: LlamaAttention, tp) -> tuple[dict, dict]:
    world = tp.world
    _divides(world, "attention", num_key_value_heads=m.num_kv_heads)  # the query heads are a multiple
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    rules = {**_linear("q_proj", m.q_proj, Split(0, (q,)), False), **_linear("k_proj", m.k_proj, Split(0, (kv,)), False),
             **_linear("v_proj", m.v_proj, Split(0, (kv,)), False), **_linear("o_proj", m.o_proj, Split(1, (q,)), True)}
    m.num_heads, m.num_kv_heads = m.num_heads // world, m.num_kv_heads // world
    m.cfg = replace(m.cfg, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads)
    return rules, rules


def _dense_mlp(m: nn.Module, tp, columns: tuple[str, ...], row: str) -> tuple[dict, dict]:
    """An MLP of column-parallel ``columns`` into one row-parallel ``row`` (SwiGLU, squared ReLU)."""
    I = getattr(m, row).in_features
    _divides(tp.world, "MLP", intermediate_size=I)
    rules = _linear(row, getattr(m, row), Split(1, (I,)), True)
    for name in columns:
        rules.update(_linear(name, getattr(m, name), Split(0, (I,)), False))
    return rules, rules


def _fused_swiglu(m: FusedSwiGLU, tp) -> tuple[dict, dict]:
    I = m.output_linear.in_features
    _divides(tp.world, "shared MLP", shared_intermediate_size=I)
    rules = {"input_linear.weight": Split(0, (I, I)), "output_linear.weight": Split(1, (I,))}
    return rules, rules


def _expert_width(m: TopKMoE | GroupedMoE, tp, name: str) -> int:
    """The experts' full intermediate width, after checking and setting the rank's."""
    I = m.intermediate
    _divides(tp.world, "MoE experts", **{name: I})
    m.intermediate = I // tp.world
    return I


def _topk_moe(m: TopKMoE, tp) -> tuple[dict, dict]:
    I = _expert_width(m, tp, "intermediate_size")
    rules = {"input_linear.weight": Split(1, (I, I)), "output_linear.weight": Split(2, (I,))}
    return rules, rules


def _grouped_moe(m: GroupedMoE, tp) -> tuple[dict, dict]:
    I = _expert_width(m, tp, "moe_intermediate_size")
    params = {"experts.up": Split(1, (I,)), "experts.down": Split(2, (I,))}
    keys = {}  # the checkpoints hold one matrix per expert (StackedExperts)
    for e in range(m.experts.n_experts):
        keys.update({f"experts.{e}.up_proj.weight": Split(0, (I,)), f"experts.{e}.down_proj.weight": Split(1, (I,))})
    if hasattr(m, "fc2_latent_proj") and m.fc2_latent_proj.bias is not None:  # fed a partial sum
        params["fc2_latent_proj.bias"] = keys["fc2_latent_proj.bias"] = FirstRank()
    return params, keys


SHARDERS = {Mamba2Mixer: _mamba2, LlamaAttention: _attention, FusedSwiGLU: _fused_swiglu, TopKMoE: _topk_moe,
            GroupedMoE: _grouped_moe,
            SwiGLU: lambda m, tp: _dense_mlp(m, tp, ("gate_proj", "up_proj"), "down_proj"),
            ReluSquaredMLP: lambda m, tp: _dense_mlp(m, tp, ("up_proj",), "down_proj")}


def plan(model, tp: TensorParallel) -> dict:
    """Resize ``model`` (built on "meta", a stree TreeLM) to rank ``tp.rank``'s slice of every layer
    and return how each of its checkpoint tensors (state-dict key) is sliced; keys not named are
    replicated. Sets ``model.tp`` and ``model.full_vocab``. A head, group or width that the world
    size does not divide is a ValueError naming it (the meta model is then left half resized:
    it was built for this call)."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("plan resizes a model built on the 'meta' device")
    found = [(name, module, SHARDERS[type(module)]) for name, module in model.named_modules()
             if type(module) in SHARDERS]
    param_rules, key_rules = {}, {}
    for name, module, sharder in found:
        params, keys = sharder(module, tp)
        param_rules.update({f"{name}.{k}": r for k, r in params.items()})
        key_rules.update({f"{name}.{k}": r for k, r in keys.items()})
    tied = model.lm_head.weight is model.embed.weight
    full_vocab = model.lm_head.weight.shape[0]
    for key in (model.embed_key, "lm_head.weight"):
        param_rules[key] = key_rules[key] = VocabSplit()
    for name, p in list(model.named_parameters()):
        rule = param_rules.get(name)
        if rule is not None:
            owner, attr = _owner(model, name)
            setattr(owner, attr, nn.Parameter(rule.take(lambda idx: p if idx is None else p[idx], p.shape, tp)))
    if tied:
        model.lm_head.weight = model.embed.weight
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    model.tp, model.full_vocab = tp, full_vocab
    return key_rules


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
