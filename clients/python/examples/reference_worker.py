"""A reference worker: a small Llama-style decoder in torch whose attention reads its K/V from
kvmesh's cells through the local data path, and checks that kvmesh's operations keep the model's
outputs exact.

The model: random weights from a fixed seed, RMSNorm, grouped-query attention with RoPE NEOX,
a SwiGLU MLP, float32 or bfloat16 throughout. Its layers are full attention except one sliding-
window layer, so its cache has two layer groups: the full layers (group 0) and the sliding one
(group 1). ``HYBRID`` is another shape: full attention, a layer whose keys live in a ring of the
last ``window`` tokens (a Rotating group, as mlx's RotatingKVCache), and an LFM2-style short-
convolution layer whose state (its last ``conv_kernel - 1`` gated inputs) is a Recurrent group.

Every step of the worker runs on kvmesh's memory: it pins the sequence's stored cells with what
each new token attends to among them (``Session.pin`` with ``queries``), takes cells for its new
tokens (``Session.begin_append``), writes each layer's
K/V into those cells, reads every key and value it attends to from the mapped cells, and
commits (``Session.commit_append``). Nothing of the K/V goes through gRPC; the gRPC client only
creates the cache and runs the operations under test. Then it checks:

  (a) a prompt prefilled on node A and continued on node B after a cross-node CopyPrefix gives
      the logits of a recomputation from scratch, bit for bit;
  (b) a context shift (Remove of a middle range: kvmesh re-rotates the moved keys) leaves keys
      equal to the keys computed at the new positions within the dtype's rounding, and a
      continuation matches a worker that shifts its own copy of the cache the same way (equal
      within rounding, not bit for bit: a key rotated twice is not a key rotated once);
  (c) snapshot, continue, restore (into the sequence and into a fork), continue: the logits of
      a recomputation from scratch, bit for bit;
  (d) draft tokens appended speculatively, the accepted prefix committed, then a continuation:
      the logits of a recomputation from scratch, bit for bit, the drafts' included.

With ``HYBRID``, (a), (c) and (d) run the same way, bit for bit: the ring's rows and the conv
state are read and written in place (a plain plan stages them in a free ring and a free state
slot; a speculative plan in staging memory of its own, mapped with the plan, one row per draft:
the drafts' pending rows); (b) instead checks kvmesh's refusal, since a middle Remove cannot
shift a ring or a recurrent state (FAILED_PRECONDITION), then a bit-exact continuation.

Why bit for bit holds: every computation is done per token row (vector-matrix products, per-
row norms) and the attention of a query runs over its visible keys in position order, so a
token's arithmetic does not depend on which batch it was computed in, and the worker and the
recomputation feed the same operations the same bytes. Only (b) changes bytes: kvmesh rotates
a stored key by the shift, where a recomputation rotates the raw key once.

As a program, against two running nodes with --local-socket:

    python3 reference_worker.py --node-a 127.0.0.1:7701 --socket-a /run/a.sock --name-a a \\
                                --node-b 127.0.0.1:7702 --socket-b /run/b.sock [--dtype bf16]

it runs (a)-(d) and prints one line each; ``--ttft N`` instead measures the time to the first
token of an N-token prompt with a full prefix hit against recomputing it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kvmesh
import kvmesh.local
from kvmesh import Attention, CacheSpec, DType, Recurrent, Rope, Rotating, SlidingWindow

torch.set_num_threads(1)  # one reduction order for every operation


KINDS = ("full", "sliding", "rotating", "conv")  # in the order of their cache groups


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape. ``layers``: one of KINDS per layer. The sliding layer attends to
    [pos - window, pos] (an Attention group with a sliding window), the rotating one to the
    ``window`` positions up to pos (a Rotating group's ring of ``window`` rows)."""

    vocab: int = 61
    dim: int = 48
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 12
    ffn: int = 96
    layers: Tuple[str, ...] = ("full", "sliding", "full")
    window: int = 6
    rope_base: float = 10000.0
    conv_kernel: int = 3
    dtype: str = "f32"  # or "bf16"
    seed: int = 1234

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"f32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    @property
    def kinds(self) -> List[str]:
        """The kinds of layer the model has, one cache group each, in group order."""
        return [k for k in KINDS if k in self.layers]

    @property
    def hybrid(self) -> bool:
        """Whether a group keeps no cells of positions (a ring or a recurrent state)."""
        return "rotating" in self.layers or "conv" in self.layers

    def layer_slot(self, layer: int) -> Tuple[int, int]:
        """(group, index within the group) of a layer."""
        kind = self.layers[layer]
        return self.kinds.index(kind), self.layers[:layer].count(kind)

    def spec(self, name: str, capacity: int, max_sequences: int = 8,
             max_batch: Optional[int] = None) -> CacheSpec:
        """The kvmesh cache this model's K/V lives in."""
        rope = Rope.neox(self.head_dim, self.rope_base)
        groups = {
            "full": lambda n: Attention(num_layers=n, num_kv_heads=self.kv_heads,
                                        head_dim_k=self.head_dim, rope=rope),
            "sliding": lambda n: Attention(num_layers=n, num_kv_heads=self.kv_heads,
                                           head_dim_k=self.head_dim,
                                           window=SlidingWindow(self.window), rope=rope),
            "rotating": lambda n: Rotating(num_layers=n, num_kv_heads=self.kv_heads,
                                           head_dim_k=self.head_dim, max_size=self.window,
                                           rope=rope),
            "conv": lambda n: Recurrent(num_layers=n, conv_tail=self.conv_kernel - 1,
                                        conv_dim=self.dim)}
        return CacheSpec(
            name, DType.F32 if self.dtype == "f32" else DType.BF16,
            max_sequences=max_sequences, capacity=capacity,
            max_batch=max_batch or capacity,
            groups=[groups[k](self.layers.count(k)) for k in self.kinds])


HYBRID = ("full", "rotating", "conv", "full")


def rope_tables(config: Config, delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each pair's angle for a rotation by ``delta`` positions: the angle in
    double precision, rounded to float32 (docs/api.md, "RoPE shift")."""
    half = config.head_dim // 2
    angles = [delta * config.rope_base ** (-2.0 * i / config.head_dim) for i in range(half)]
    return (torch.tensor([math.cos(a) for a in angles], dtype=torch.float32),
            torch.tensor([math.sin(a) for a in angles], dtype=torch.float32))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation of [..., head_dim] rows in float32, rounded back to x's dtype."""
    half = x.shape[-1] // 2
    f = x.float()
    x0, x1 = f[..., :half], f[..., half:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).to(x.dtype)


class Model:
    """The decoder's weights and per-token arithmetic."""

    def __init__(self, config: Config) -> None:
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        dt = config.torch_dtype

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[0])).to(dt)

        c = config
        self.embed = torch.randn(c.vocab, c.dim, generator=g).to(dt)
        self.layers = []
        for kind in c.layers:
            layer = {"norm1": (1 + 0.1 * torch.randn(c.dim, generator=g)).to(dt)}
            if kind == "conv":
                layer.update({"w_in": weight(c.dim, 3 * c.dim),
                              "conv": weight(c.conv_kernel, c.dim),
                              "w_out": weight(c.dim, c.dim)})
            else:
                layer.update({"wq": weight(c.dim, c.heads * c.head_dim),
                              "wk": weight(c.dim, c.kv_heads * c.head_dim),
                              "wv": weight(c.dim, c.kv_heads * c.head_dim),
                              "wo": weight(c.heads * c.head_dim, c.dim)})
            layer.update({"norm2": (1 + 0.1 * torch.randn(c.dim, generator=g)).to(dt),
                          "w1": weight(c.dim, c.ffn), "w3": weight(c.dim, c.ffn),
                          "w2": weight(c.ffn, c.dim)})
            self.layers.append(layer)
        self.norm = (1 + 0.1 * torch.randn(c.dim, generator=g)).to(dt)
        self.out = weight(c.dim, c.vocab)
        self._rope: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean() + 1e-5)).to(x.dtype) * w

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        if pos not in self._rope:
            self._rope[pos] = rope_tables(self.config, float(pos))
        return rotate(x, *self._rope[pos])

    def qkv(self, layer: int, x: torch.Tensor, pos: int):
        """One token's rotated query [heads, hd], key and value [kv_heads, hd]."""
        c, w = self.config, self.layers[layer]
        h = self.rms_norm(x, w["norm1"])
        q = (h @ w["wq"]).view(c.heads, c.head_dim)
        k = (h @ w["wk"]).view(c.kv_heads, c.head_dim)
        v = (h @ w["wv"]).view(c.kv_heads, c.head_dim)
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One query's attention over its visible keys and values [m, kv_heads, hd], in
        position order, every head at once (grouped: head h reads KV head h / (heads /
        kv_heads)); softmax in float32."""
        c = self.config
        group = c.heads // c.kv_heads
        k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)    # [heads, m, hd]
        v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (k * q.float()[:, None, :]).sum(-1) / math.sqrt(c.head_dim)  # [heads, m]
        p = torch.softmax(scores, dim=-1)
        return (p[:, :, None] * v).sum(1).to(q.dtype).reshape(-1)

    def finish_layer(self, layer: int, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The residual of the layer's mixer output (attention, projected here, or the conv's),
        then the MLP."""
        w = self.layers[layer]
        x = x + (mixed @ w["wo"] if "wo" in w else mixed)
        h = self.rms_norm(x, w["norm2"])
        return x + (torch.nn.functional.silu(h @ w["w1"]) * (h @ w["w3"])) @ w["w2"]

    def conv(self, layer: int, x: torch.Tensor, state: torch.Tensor):
        """One token through an LFM2-style gated short convolution: the projected output, and
        the new state (the last conv_kernel - 1 gated inputs [conv_kernel - 1, dim]). The
        depthwise convolution sums its taps in float32, oldest first."""
        w = self.layers[layer]
        b, c, v = (self.rms_norm(x, w["norm1"]) @ w["w_in"]).chunk(3)
        taps = torch.cat([state, (b * v)[None]])                     # [conv_kernel, dim]
        mixed = (taps.float() * w["conv"].float()).sum(0).to(x.dtype)
        return (c * mixed) @ w["w_out"], taps[1:]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self.rms_norm(x, self.norm) @ self.out).float()

    def visible(self, layer: int, pos: int, stored: Sequence[int]) -> List[int]:
        """The positions a query at ``pos`` attends to among ``stored`` (sorted), by kvmesh's
        rule: full layers everything up to pos, the sliding layer [pos - window, pos], the
        rotating one the window positions up to pos."""
        kind, window = self.config.layers[layer], self.config.window
        low = {"sliding": pos - window, "rotating": pos - window + 1}.get(kind, -1)
        return [p for p in stored if low <= p <= pos]


class Step:
    """What a forward pass needs of a cache for one batch of one sequence's new tokens."""

    def stored(self, group: int) -> List[int]:
        """Positions the sequence stores in ``group`` (new tokens included), sorted."""
        raise NotImplementedError

    def write(self, layer: int, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V of the batch's token i in ``layer``."""
        raise NotImplementedError

    def read(self, layer: int, positions: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [m, kv_heads, hd] of ``positions`` in ``layer``."""
        raise NotImplementedError

    def state(self, layer: int) -> torch.Tensor:
        """A conv layer's state before the batch (zeros for a new sequence)."""
        raise NotImplementedError

    def write_state(self, layer: int, i: int, state: torch.Tensor) -> None:
        """A conv layer's state after the batch's token i."""
        raise NotImplementedError

    def visible(self, model: "Model", layer: int, i: int, pos: int) -> List[int]:
        """What the batch's token i, at ``pos``, attends to in ``layer``, sorted."""
        return model.visible(layer, pos, self.stored(model.config.layer_slot(layer)[0]))


def forward(model: Model, step: Step, positions: Sequence[int],
            token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [n, vocab] of a batch of new tokens, layer by layer: each layer writes the batch's
    K/V into the cache, then every query attends over what the cache holds."""
    xs = [model.embed[t] for t in token_ids]
    for layer in range(len(model.config.layers)):
        if model.config.layers[layer] == "conv":
            state = step.state(layer)
            for i in range(len(positions)):
                out, state = model.conv(layer, xs[i], state)
                step.write_state(layer, i, state)
                xs[i] = model.finish_layer(layer, xs[i], out)
            continue
        queries = []
        for i, pos in enumerate(positions):
            q, k, v = model.qkv(layer, xs[i], pos)
            step.write(layer, i, k, v)
            queries.append(q)
        for i, pos in enumerate(positions):
            keys, values = step.read(layer, step.visible(model, layer, i, pos))
            xs[i] = model.finish_layer(layer, xs[i], model.attend(queries[i], keys, values))
    return torch.stack([model.logits(x) for x in xs])


class MemoryStep(Step):
    """A batch's step on a MemoryCache sequence."""

    def __init__(self, config: Config, layers, positions: Sequence[int]) -> None:
        self.config, self.layers, self.positions = config, layers, positions

    def stored(self, group: int) -> List[int]:
        layer = next(i for i in range(len(self.config.layers))
                     if self.config.layer_slot(i)[0] == group)
        return sorted(self.layers[layer])

    def write(self, layer: int, i: int, k, v) -> None:
        self.layers[layer][self.positions[i]] = (k, v)

    def read(self, layer: int, positions):
        return (torch.stack([self.layers[layer][p][0] for p in positions]),
                torch.stack([self.layers[layer][p][1] for p in positions]))

    def state(self, layer: int) -> torch.Tensor:
        c = self.config
        return self.layers[layer].get(
            "state", torch.zeros(c.conv_kernel - 1, c.dim, dtype=c.torch_dtype))

    def write_state(self, layer: int, i: int, state: torch.Tensor) -> None:
        self.layers[layer]["state"] = state


class MemoryCache:
    """The worker's own cache, for recomputations: per sequence and layer, position -> (k, v)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.seqs: Dict[int, List[Dict[int, Tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _layers(self, seq: int):
        return self.seqs.setdefault(seq, [{} for _ in self.model.config.layers])

    def run(self, seq: int, positions: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        return forward(self.model, MemoryStep(self.model.config, self._layers(seq), positions),
                       positions, token_ids)

    def shift(self, seq: int, begin: int, end: int) -> None:
        """What kvmesh's Remove of [begin, end) does: later positions move down, their keys are
        rotated by the shift."""
        cos, sin = rope_tables(self.model.config, float(begin - end))
        for i, stored in enumerate(self._layers(seq)):
            moved = {}
            for p, (k, v) in stored.items():
                if p < begin:
                    moved[p] = (k, v)
                elif p >= end:
                    moved[p - (end - begin)] = (rotate(k, cos, sin), v)
            self.seqs[seq][i] = moved


def recompute(model: Model, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits of every position of ``token_ids``, from scratch in one batch."""
    return MemoryCache(model).run(0, range(len(token_ids)), token_ids)


class KvmeshStep(Step):
    """A batch's step on kvmesh's cells: the pinned cells of what the sequence stores, and the
    plan's cells of the new tokens. What a token attends to among the stored positions is the
    node's answer (the pin's visibility of the batch's queries); among the batch's own tokens,
    the model's rule. A ring keeps only the last ``window`` tokens of a batch (the plan marks
    the others -1), and a speculative batch of a ring or a conv state goes to the plan's staging
    memory: those are read from the batch's own K/V, as an engine attends over a batch's fresh
    keys."""

    def __init__(self, cache: "KvmeshCache", pin: Optional[kvmesh.local.Pin],
                 plan: kvmesh.local.AppendPlan, cells: List[Dict[int, int]],
                 positions: Sequence[int]) -> None:
        self.cache, self.pin, self.plan, self.cells = cache, pin, plan, cells
        self.positions = positions
        config = cache.model.config
        self.config, self.shape = config, (config.kv_heads, config.head_dim)
        self.fresh: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        # Per layer whose group's rows go to the plan's staging memory: its row tensors.
        self.staging: Dict[int, List[torch.Tensor]] = {}
        if plan.staging is not None:
            for layer in range(len(config.layers)):
                group, j = config.layer_slot(layer)
                if plan.staging.groups[group] is None:
                    continue
                planes = [j] if config.layers[layer] == "conv" else [2 * j, 2 * j + 1]
                self.staging[layer] = [plan.staging.tensor(group, p, config.torch_dtype)
                                       for p in planes]

    def release(self) -> None:
        """Drops the views of the plan's staging memory (so that the plan can unmap it)."""
        self.staging = {}

    def visible(self, model: "Model", layer: int, i: int, pos: int) -> List[int]:
        group, _ = self.config.layer_slot(layer)
        stored: List[int] = []
        if self.pin is not None:
            for first, last in self.pin.visible[group][i]:
                stored.extend(range(first, last + 1))
            # The node's rule and the model's must agree, or the model attends to other keys.
            want = model.visible(layer, pos, self.pin.positions[group].tolist())
            if stored != want:
                raise AssertionError(f"layer {layer}: the node says a query at {pos} attends to "
                                     f"{stored}, the model's rule to {want}")
        return stored + model.visible(layer, pos, sorted(self.positions))

    def stored(self, group: int) -> List[int]:
        return sorted(self.cells[group])

    def write(self, layer: int, i: int, k, v) -> None:
        group, _ = self.config.layer_slot(layer)
        cell = int(self.plan.cells[group][i])
        if layer in self.staging:  # a draft's pending rows, in the plan's staging memory
            self.staging[layer][0][cell] = k.reshape(-1)
            self.staging[layer][1][cell] = v.reshape(-1)
            self.fresh[(layer, self.positions[i])] = (k, v)
            return
        if cell < 0:  # the plan's mark of a token a later one of the batch overwrites
            if self.config.layers[layer] != "rotating":
                raise ValueError(f"the batch holds position {self.positions[i]} twice")
            self.fresh[(layer, self.positions[i])] = (k, v)
            return
        self.cache.k_rows[layer][cell] = k.reshape(-1)
        self.cache.v_rows[layer][cell] = v.reshape(-1)

    def read(self, layer: int, positions):
        group, _ = self.config.layer_slot(layer)
        keys, values = [], []
        for p in positions:
            if (layer, p) in self.fresh:
                k, v = self.fresh[(layer, p)]
            else:
                cell = self.cells[group][p]
                k = self.cache.k_rows[layer][cell].view(self.shape)
                v = self.cache.v_rows[layer][cell].view(self.shape)
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)

    def state(self, layer: int) -> torch.Tensor:
        group, _ = self.config.layer_slot(layer)
        c = self.config
        if self.pin is None or len(self.pin.cells[group]) == 0:
            return torch.zeros(c.conv_kernel - 1, c.dim, dtype=c.torch_dtype)
        # The pinned slot: the sequence's state, which the plan's Append will not overwrite.
        slot = int(self.pin.cells[group][0])
        return self.cache.state_rows[layer][slot].clone().view(c.conv_kernel - 1, c.dim)

    def write_state(self, layer: int, i: int, state: torch.Tensor) -> None:
        group, _ = self.config.layer_slot(layer)
        if layer in self.staging:  # a draft's state after it: row i of the staging memory
            self.staging[layer][0][int(self.plan.cells[group][i])] = state.reshape(-1)
        elif i == len(self.positions) - 1:
            # One sequence per batch: the plan's one state slot (its first sequence's).
            self.cache.state_rows[layer][int(self.plan.cells[group][0])] = state.reshape(-1)


class KvmeshCache:
    """A sequence's K/V in a kvmesh cache, reached through the local data path."""

    def __init__(self, model: Model, session: kvmesh.local.Session, cache: str) -> None:
        self.model = model
        self.session = session
        self.cache = cache
        self.mapped = session.attach(cache)
        config = model.config
        # Per layer: K and V rows (attention layers), or state rows (conv layers: a Recurrent
        # group's plane j is layer j's conv state, [conv_kernel - 1, dim] in the dtype).
        self.k_rows, self.v_rows, self.state_rows = [], [], []
        for layer in range(len(config.layers)):
            group, j = config.layer_slot(layer)
            conv = config.layers[layer] == "conv"
            self.k_rows.append(None if conv else self.mapped.tensor(group, 2 * j))
            self.v_rows.append(None if conv else self.mapped.tensor(group, 2 * j + 1))
            self.state_rows.append(self.mapped.tensor(group, j) if conv else None)

    def close(self) -> None:
        self.k_rows = self.v_rows = self.state_rows = []
        self.mapped.close()

    def pinned(self, seq: int, queries: Sequence[int] = ()
               ) -> Tuple[Optional[kvmesh.local.Pin], List[Dict[int, int]]]:
        """Pins what ``seq`` stores, with what queries at ``queries`` attend to: the pin (None
        for nothing) and, per group, pos -> cell."""
        try:
            pin = self.session.pin(self.cache, seq, queries=queries)
        except kvmesh.NotFound:
            return None, [{} for _ in self.model.config.kinds]
        return pin, [dict(zip(p.tolist(), c.tolist()))
                     for p, c in zip(pin.positions, pin.cells)]

    def keys(self, seq: int, layer: int) -> Dict[int, torch.Tensor]:
        """The stored key of every position of ``seq`` in ``layer``, read in place."""
        pin, cells = self.pinned(seq)
        try:
            group, _ = self.model.config.layer_slot(layer)
            shape = (self.model.config.kv_heads, self.model.config.head_dim)
            return {p: self.k_rows[layer][c].clone().view(shape) for p, c in cells[group].items()}
        finally:
            if pin is not None:
                self.session.unpin(pin)

    def run(self, seq: int, positions: Sequence[int], token_ids: Sequence[int], *,
            speculative: bool = False) -> torch.Tensor:
        """One forward pass of new tokens at ``positions`` of ``seq``, K/V in kvmesh's cells;
        committed (as pending tokens with ``speculative``) when it succeeds, abandoned if not."""
        pin, cells = self.pinned(seq, positions)
        try:
            plan = self.session.begin_append(self.cache, kvmesh.tokens(seq, positions),
                                             token_ids, speculative=speculative)
            for group, kind in enumerate(self.model.config.kinds):
                if kind == "conv" or (plan.staging is not None and plan.staging.groups[group]):
                    continue  # a state slot per sequence, or rows of the plan's staging
                for i, cell in enumerate(plan.cells[group].tolist()):
                    if cell >= 0:
                        cells[group][positions[i]] = cell
            kinds = self.model.config.kinds
            staged = [kinds[g] for g, m in enumerate(plan.staging.groups if plan.staging else [])
                      if m is not None]
            if staged != ([k for k in kinds if k in ("rotating", "conv")] if speculative else []):
                raise AssertionError(f"the plan stages groups of kinds {staged}")
            step = KvmeshStep(self, pin, plan, cells, positions)
            try:
                logits = forward(self.model, step, positions, token_ids)
            except BaseException:
                self.session.abandon_append(plan)
                raise
            finally:
                step.release()
            self.session.commit_append(plan)
            plan.close()
            return logits
        finally:
            if pin is not None:
                self.session.unpin(pin)


@dataclasses.dataclass
class Check:
    """The outcome of one scenario."""

    name: str
    exact: bool          # compared bit for bit (else within a tolerance)
    max_abs_diff: float  # over every compared logit (or key, for the shift's keys)
    compared: int        # values compared
    ok: bool
    note: str = ""

    def line(self) -> str:
        how = "bit for bit" if self.exact else "within rounding"
        verdict = "ok" if self.ok else "FAILED"
        return (f"{self.name}: {verdict} ({self.compared} values {how}, max |diff| "
                f"{self.max_abs_diff:.3g}){' ' + self.note if self.note else ''}")


def compare(name: str, got: torch.Tensor, want: torch.Tensor, *, exact: bool = True,
            relative: float = 0.0, note: str = "") -> Check:
    """Bit for bit, or (``exact`` False) each |got - want| at most ``relative`` times the
    largest |want|: a rounding of the dtype is relative to the magnitudes a rotation or a
    softmax mixes, not to each element."""
    diff = (got.float() - want.float()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    if exact:  # the bits themselves (torch.equal would take -0.0 for 0.0)
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[got.dtype]
        ok = got.dtype == want.dtype and bool(torch.equal(got.view(bits), want.view(bits)))
    else:
        ok = worst <= relative * scale
    return Check(name, exact, worst, int(diff.numel()), ok, note)


def tokens_of(rng: np.random.Generator, config: Config, n: int) -> List[int]:
    return [int(t) for t in rng.integers(0, config.vocab, n)]


def prefix_across_nodes(model: Model, a: kvmesh.Client, a_name: str, cache_a: KvmeshCache,
                        b: kvmesh.Client, cache_b: KvmeshCache, prompt: int, more: int,
                        rng: np.random.Generator) -> Check:
    """(a): prefill on A in two batches, CopyPrefix to B, continue on B token by token."""
    name = cache_a.cache
    ids = tokens_of(rng, model.config, prompt + more)
    half = prompt // 2
    got = [cache_a.run(0, range(half), ids[:half]),
           cache_a.run(0, range(half, prompt), ids[half:prompt])]
    b.copy_prefix(name, src_seq=0, dst_seq=5, length=prompt, source_node=a_name)
    for p in range(prompt, prompt + more):
        got.append(cache_b.run(5, [p], [ids[p]]))
    b.remove(name, 5, 0)
    a.remove(name, 0, 0)
    return compare("(a) prefill on A, CopyPrefix to B, continue on B",
                   torch.cat(got), recompute(model, ids))


def context_shift(model: Model, client: kvmesh.Client, cache: KvmeshCache, prompt: int,
                  more: int, rng: np.random.Generator) -> List[Check]:
    """(b): Remove [begin, end) from the middle, then continue; against the worker's own cache
    shifted the same way, and the moved keys of the first layer against keys computed at their
    new positions (the first layer's keys depend on the token alone)."""
    config = model.config
    name, seq = cache.cache, 1
    ids = tokens_of(rng, config, prompt + more)
    begin, end = prompt // 4, prompt // 2
    cut = end - begin
    # A few units in the last place of the dtype: float32 2^-23, bfloat16 2^-7.
    rounding = 2.0 ** (-20 if config.dtype == "f32" else -5)
    mine = MemoryCache(model)
    cache.run(seq, range(prompt), ids[:prompt])
    mine.run(seq, range(prompt), ids[:prompt])
    client.remove(name, seq, begin, end)
    mine.shift(seq, begin, end)

    stored = cache.keys(seq, 0)
    kept = ids[:begin] + ids[end:prompt]
    fresh = [model.qkv(0, model.embed[t], p)[1] for p, t in enumerate(kept)]
    moved = [p for p in sorted(stored) if p >= begin]
    keys = compare("(b) keys after the shift vs keys computed at the new positions",
                   torch.stack([stored[p] for p in moved]),
                   torch.stack([fresh[p] for p in moved]), exact=False,
                   relative=rounding,
                   note=f"({len(moved)} moved keys of layer 0)")
    got, want = [], []
    for p in range(prompt - cut, prompt - cut + more):
        t = ids[p + cut]
        got.append(cache.run(seq, [p], [t]))
        want.append(mine.run(seq, [p], [t]))
    client.remove(name, seq, 0)
    cont = compare("(b) continuation after the shift vs the worker's own shifted cache",
                   torch.cat(got), torch.cat(want), exact=False, relative=rounding,
                   note="(deeper layers' values after a shift are an approximation of a "
                        "recomputation, as in llama.cpp's context shift)")
    return [keys, cont]


def snapshot_restore(model: Model, client: kvmesh.Client, cache: KvmeshCache, prompt: int,
                     more: int, rng: np.random.Generator) -> Check:
    """(c): snapshot after the prompt, continue, restore into the sequence and into a fork
    (another sequence), continue both differently."""
    config = model.config
    name, seq, fork = cache.cache, 2, 3
    ids = tokens_of(rng, config, prompt)
    first, second, third = (tokens_of(rng, config, more) for _ in range(3))
    cache.run(seq, range(prompt), ids)
    snapshot_id = client.snapshot(name, seq).id
    got, want = [], []
    for i, t in enumerate(first):
        cache.run(seq, [prompt + i], [t])
    client.restore(name, seq, prompt, snapshot_id)
    client.restore(name, fork, prompt, snapshot_id)
    for s, cont in ((seq, second), (fork, third)):
        got.append(torch.cat([cache.run(s, [prompt + i], [t]) for i, t in enumerate(cont)]))
        want.append(recompute(model, ids + cont)[prompt:])
    client.drop_snapshot(name, snapshot_id)
    client.remove(name, seq, 0)
    client.remove(name, fork, 0)
    return compare("(c) snapshot, continue, restore (and fork), continue",
                   torch.cat(got), torch.cat(want))


def speculation(model: Model, client: kvmesh.Client, cache: KvmeshCache, prompt: int,
                drafts: int, rng: np.random.Generator) -> Check:
    """(d): drafts appended speculatively in one batch, the first ``accepted`` committed, then
    a continuation from the accepted prefix."""
    config = model.config
    name, seq = cache.cache, 4
    ids = tokens_of(rng, config, prompt)
    draft = tokens_of(rng, config, drafts)
    accepted = drafts // 2
    after = tokens_of(rng, config, 3)
    cache.run(seq, range(prompt), ids)
    spec_logits = cache.run(seq, range(prompt, prompt + drafts), draft, speculative=True)
    client.commit_speculation(name, seq, accepted)
    start = prompt + accepted
    cont = torch.cat([cache.run(seq, [start + i], [t]) for i, t in enumerate(after)])
    client.remove(name, seq, 0)
    want_drafts = recompute(model, ids + draft)[prompt:]
    want_after = recompute(model, ids + draft[:accepted] + after)[start:]
    return compare("(d) speculative drafts, commit the accepted prefix, continue",
                   torch.cat([spec_logits, cont]), torch.cat([want_drafts, want_after]))


def refused_shift(model: Model, client: kvmesh.Client, cache: KvmeshCache, prompt: int,
                  rng: np.random.Generator) -> Check:
    """(b) on a hybrid cache: a middle Remove is refused with FAILED_PRECONDITION (a ring or a
    recurrent state cannot be shifted), and the sequence then continues with the logits of a
    recomputation from scratch, bit for bit (the refusal changed nothing)."""
    config = model.config
    name, seq = cache.cache, 6
    ids = tokens_of(rng, config, prompt + 2)
    cache.run(seq, range(prompt), ids[:prompt])
    try:
        client.remove(name, seq, prompt // 4, prompt // 2)
        refusal = ""
    except kvmesh.FailedPrecondition as error:
        refusal = str(error).split(": ", 1)[-1]
    got = torch.cat([cache.run(seq, [p], [ids[p]]) for p in range(prompt, prompt + 2)])
    client.remove(name, seq, 0)
    check = compare("(b) a middle Remove of a ring and a recurrent state: FAILED_PRECONDITION, "
                    "then a continuation", got, recompute(model, ids)[prompt:],
                    note=f"(refused: {refusal[:90]}...)" if refusal else "(not refused)")
    check.ok = check.ok and bool(refusal)
    return check


@contextlib.contextmanager
def attached(session: kvmesh.local.Session, model: Model, cache: str) -> Iterator[KvmeshCache]:
    c = KvmeshCache(model, session, cache)
    try:
        yield c
    finally:
        c.close()


def run_all(config: Config, node_a: str, socket_a: str, name_a: str, node_b: str,
            socket_b: str, *, token: str = "", prompt: int = 24, more: int = 5,
            cache: Optional[str] = None) -> List[Check]:
    """Creates the cache on both nodes, runs (a)-(d), deletes it; returns the checks."""
    model = Model(config)
    cache = cache or f"reference-worker-{config.dtype}{'-hybrid' if config.hybrid else ''}"
    spec = config.spec(cache, capacity=4 * (prompt + more) + 64)
    checks: List[Check] = []
    rng = np.random.default_rng(config.seed)
    with kvmesh.Client(node_a, token=token or None) as a, \
            kvmesh.Client(node_b, token=token or None) as b:
        a.create_cache(spec)
        b.create_cache(spec)
        try:
            with kvmesh.local.Session(socket_a, token=token) as sa, \
                    kvmesh.local.Session(socket_b, token=token) as sb, \
                    attached(sa, model, cache) as ca, attached(sb, model, cache) as cb:
                checks.append(prefix_across_nodes(model, a, name_a, ca, b, cb, prompt, more,
                                                  rng))
                if config.hybrid:
                    checks.append(refused_shift(model, a, ca, prompt, rng))
                else:
                    checks.extend(context_shift(model, a, ca, prompt, more, rng))
                checks.append(snapshot_restore(model, a, ca, prompt, more, rng))
                checks.append(speculation(model, a, ca, prompt, more + 1, rng))
        finally:
            a.delete_cache(cache)
            b.delete_cache(cache)
    return checks


def time_to_first_token(config: Config, node: str, socket: str, prompt: int, *,
                        token: str = "", reps: int = 3) -> Dict[str, float]:
    """Seconds to the first token of a ``prompt``-token prompt: recomputed from scratch (the
    whole prompt through the model, K/V into kvmesh) against a full prefix hit (the prompt's
    K/V already in kvmesh: only the next token's forward pass). Medians of ``reps``."""
    model = Model(config)
    name = f"reference-worker-ttft-{config.dtype}"
    spec = config.spec(name, capacity=prompt + 64, max_sequences=4, max_batch=prompt + 1)
    ids = tokens_of(np.random.default_rng(config.seed), config, prompt + 1)
    cold, hit = [], []
    with kvmesh.Client(node, token=token or None) as client:
        client.create_cache(spec)
        try:
            with kvmesh.local.Session(socket, token=token) as session, \
                    attached(session, model, name) as cache:
                for _ in range(reps):
                    client.remove(name, 0, 0)
                    start = time.perf_counter()
                    cache.run(0, range(prompt + 1), ids)
                    cold.append(time.perf_counter() - start)
                    client.remove(name, 0, prompt)  # keep the prompt, drop the token
                    start = time.perf_counter()
                    cache.run(0, [prompt], [ids[prompt]])
                    hit.append(time.perf_counter() - start)
        finally:
            client.delete_cache(name)
    return {"recompute_s": float(np.median(cold)), "prefix_hit_s": float(np.median(hit))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--node-a", required=True, help="gRPC address of node A")
    parser.add_argument("--socket-a", required=True, help="node A's --local-socket")
    parser.add_argument("--name-a", required=True, help="node A's member name")
    parser.add_argument("--node-b", help="gRPC address of node B (a member of A's cluster)")
    parser.add_argument("--socket-b", help="node B's --local-socket")
    parser.add_argument("--token", default="", help="bearer token (nodes with a token file)")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--hybrid", action="store_true",
                        help="the HYBRID shape: full attention, a ring, an LFM2-style conv")
    parser.add_argument("--ttft", type=int, default=0, metavar="N",
                        help="measure time to first token of an N-token prompt on node A")
    args = parser.parse_args(argv)
    config = Config(dtype=args.dtype, layers=HYBRID if args.hybrid else Config.layers)
    if args.ttft:
        t = time_to_first_token(config, args.node_a, args.socket_a, args.ttft, token=args.token)
        print(f"reference worker ({args.dtype}): time to first token of a {args.ttft}-token "
              f"prompt: recomputed {t['recompute_s'] * 1000:.1f} ms, full prefix hit "
              f"{t['prefix_hit_s'] * 1000:.1f} ms "
              f"({t['recompute_s'] / t['prefix_hit_s']:.0f}x)")
        return 0
    if not args.node_b or not args.socket_b:
        parser.error("--node-b and --socket-b are needed unless --ttft")
    checks = run_all(config, args.node_a, args.socket_a, args.name_a, args.node_b,
                     args.socket_b, token=args.token)
    shape = f"{args.dtype}, hybrid" if args.hybrid else args.dtype
    for check in checks:
        print(f"reference worker ({shape}): {check.line()}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
