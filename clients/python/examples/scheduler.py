#!/usr/bin/python3
"""A small cluster scheduler on top of the kvmesh Python client.

It serves a stream of chat requests (token ids; a fake model makes their K/V) on a few kvmesh
nodes, the way an inference scheduler uses kvmesh:

- **prefix routing**: the nodes know which token ids their sequences hold (Appends carry
  them), and each keeps an index of the others' (fed by their events), so the scheduler asks
  one node (LookupPrefix with the cluster scope, verified) which sequence in the cluster shares
  the longest prefix with a request, rather than keeping a map of its own; the request goes to
  that node and is
  **forked** from that sequence with CopyPrefix (cells shared, nothing copied), so only the new
  tokens are prefilled; when that node is busier than the least loaded one, the fork is made on
  the least loaded node instead, with a cross-node CopyPrefix. A context-shifted sequence is
  offered only up to the shift (its later positions saw the removed tokens);
- **context shift**: a sequence that would outgrow the model's context keeps its first tokens
  (the system prompt) and drops the oldest half of the rest with a Remove, which moves the later
  positions down and re-rotates their keys (RoPE);
- **room first**: before a prompt is prefilled, room for it (a sequence slot and its cells) is
  reserved on the chosen node, or on another when that one has none (Reserve), so that other
  requests cannot starve it half-way; the reservation is dropped once the prompt is in;
- **rebalancing**: at the end, sequences move with Migrate from the node that uses the most KV
  cells to the one that uses the fewest, while a move narrows the gap.

Then every sequence is read back and its values checked against the fake model. The cache is
deleted at the end (``--keep`` leaves it).

    PYTHONPATH=clients/python:build/clients/python \\
        /usr/bin/python3 clients/python/examples/scheduler.py 127.0.0.1:17700 127.0.0.1:17701 \\
        127.0.0.1:17702

The nodes must form one cluster (``--peers``), as deploy/local/demo.sh starts them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import kvmesh

# The toy model: Llama-shaped, small. Attention only, with RoPE, so that Remove can shift.
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
MAX_CONTEXT = 96   # tokens a sequence may hold before the scheduler context-shifts it
KEEP = 16          # tokens a context shift keeps at the start (the system prompt)
BLOCK = 8          # tokens per block of the nodes' prefix index (CacheSpec.token_block_size)


def model_kv(layout: kvmesh.PayloadLayout, token_ids: Sequence[int]) -> List[kvmesh.GroupData]:
    """The fake model's K and V of ``token_ids``: a function of each token id only (a real
    model's would depend on the position and the context too)."""
    data = layout.zeros(len(token_ids))
    kv = data[0]
    for t, token in enumerate(token_ids):
        rng = np.random.default_rng(token)
        kv.k[:, t] = rng.standard_normal(kv.k.shape[:1] + kv.k.shape[2:]).astype(np.float16)
        kv.v[:, t] = rng.standard_normal(kv.v.shape[:1] + kv.v.shape[2:]).astype(np.float16)
    return data


@dataclasses.dataclass
class Placed:
    """A sequence the scheduler placed: where it lives and the token ids it holds, in order."""

    node: str
    seq: int
    tokens: List[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    """Places requests on the nodes of ``clients`` (node name -> client) in cache ``cache``."""

    def __init__(self, clients: Dict[str, kvmesh.Client], cache: str) -> None:
        self.clients = clients
        self.cache = cache
        self.sequences: List[Placed] = []
        self.lookups = 0
        self.next_seq = 1
        self.spec = kvmesh.CacheSpec(
            name=cache, dtype=kvmesh.DType.F16, max_sequences=32, capacity=256, max_batch=128,
            groups=[kvmesh.Attention(LAYERS, KV_HEADS, HEAD_DIM,
                                     rope=kvmesh.Rope.normal(HEAD_DIM, 10000.0))],
            token_block_size=BLOCK)

    def setup(self) -> None:
        """Creates the cache, with the same spec, on every node."""
        for name, client in self.clients.items():
            created = client.create_cache(self.spec)
            print(f"  {name}: cache {self.cache} {'created' if created.created else 'exists'}")
        self.layout = next(iter(self.clients.values())).layout(self.cache)

    def load(self) -> Dict[str, int]:
        """Live sequences per node, as the scheduler placed them."""
        load = {name: 0 for name in self.clients}
        for s in self.sequences:
            load[s.node] += 1
        return load

    def least_loaded(self) -> str:
        load = self.load()
        return min(load, key=lambda n: (load[n], n))

    def submit(self, request: str, tokens: List[int]) -> Placed:
        """Serves one request: fork the longest cached prefix, then prefill the rest."""
        best: Optional[Placed] = None
        best_len = 0
        # One node answers for the cluster: its own sequences, and the others' from its index
        # of the cluster (fed by their events), verified token by token by their holders.
        # Asked in turn, so that every node's index serves.
        router = list(self.clients)[self.lookups % len(self.clients)]
        self.lookups += 1
        for m in self.clients[router].lookup_prefix(self.cache, tokens, max_matches=1,
                                                    cluster=True, verify=True):
            best = next(s for s in self.sequences if s.node == m.node and s.seq == m.seq)
            best_len = m.length
            # What the node matched, the scheduler's own record agrees with.
            assert common_prefix(best.tokens, tokens) >= best_len
        seq = self.next_seq
        self.next_seq += 1
        if best is None:
            node = self.reserve_room(self.least_loaded(), seq, tokens)
            print(f"{request}: {len(tokens)} tokens, no cached prefix: new seq {seq} on {node}")
            new = Placed(node, seq, [])
        else:
            load = self.load()
            node = best.node
            if load[node] - load[self.least_loaded()] >= 2:
                node = self.least_loaded()
            node = self.reserve_room(node, seq, tokens)
            source = "" if node == best.node else best.node
            # The index recorded how far best.seq reached: if it has since been removed or
            # truncated, the node refuses rather than leaving seq empty or short.
            copied = self.clients[node].copy_prefix(self.cache, best.seq, seq, best_len,
                                                    source_node=source,
                                                    require_src_offset=len(best.tokens))
            transfer = copied.transfer
            how = ("local CopyPrefix, cells shared" if transfer is None else
                   f"CopyPrefix from {best.node}, {transfer.bytes} bytes over "
                   f"{transfer.transport} in {transfer.micros} us")
            print(f"{request}: {len(tokens)} tokens, LookupPrefix on {router}: {best_len} tokens "
                  f"held by seq {best.seq} on {best.node}: fork into seq {seq} on {node} ({how})")
            new = Placed(node, seq, list(tokens[:best_len]))
        self.sequences.append(new)
        self.extend(new, tokens[len(new.tokens):])
        self.clients[node].reserve(self.cache, seq, 0)  # the prompt is in: release the room
        return new

    def reserve_room(self, node: str, seq: int, tokens: List[int]) -> str:
        """Reserves room for ``seq``'s prompt (a sequence slot and its cells) on ``node``, or,
        when that node has no room, on the least loaded node that has: the prompt then cannot
        be starved half-way by other requests. Returns the node."""
        positions = min(len(tokens), MAX_CONTEXT)
        load = self.load()
        for candidate in [node] + sorted((n for n in self.clients if n != node),
                                         key=lambda n: (load[n], n)):
            try:
                self.clients[candidate].reserve(self.cache, seq, positions, ttl=60)
                return candidate
            except kvmesh.ResourceExhausted as e:
                print(f"  no room for seq {seq} on {candidate}: {e.shortage or e.message}")
        raise RuntimeError(f"no node has room for {positions} positions of seq {seq}")

    def extend(self, s: Placed, tokens: List[int]) -> None:
        """Appends ``tokens`` to ``s``, context-shifting first when they do not fit."""
        if not tokens:
            return
        if len(s.tokens) + len(tokens) > MAX_CONTEXT:
            self.context_shift(s, len(s.tokens) + len(tokens) - MAX_CONTEXT)
        start = len(s.tokens)
        self.clients[s.node].append(self.cache, kvmesh.tokens(s.seq, range(start,
                                                                           start + len(tokens))),
                                    model_kv(self.layout, tokens), token_ids=tokens)
        s.tokens.extend(tokens)
        print(f"  prefill {len(tokens)} tokens into seq {s.seq} on {s.node} "
              f"(positions {start}..{len(s.tokens) - 1})")

    def context_shift(self, s: Placed, needed: int) -> None:
        """Keeps the first KEEP tokens and drops at least ``needed`` (half of the rest)."""
        discard = max(needed, (len(s.tokens) - KEEP) // 2)
        self.clients[s.node].remove(self.cache, s.seq, KEEP, KEEP + discard)
        moved = len(s.tokens) - KEEP - discard
        del s.tokens[KEEP:KEEP + discard]
        print(f"  context shift of seq {s.seq} on {s.node}: removed positions "
              f"[{KEEP}, {KEEP + discard}); the {moved} later tokens moved down by {discard}, "
              "keys re-rotated")

    def cells_used(self) -> Dict[str, int]:
        """KV cells each node uses for the cache, as the node reports them (shared cells
        counted once)."""
        return {name: client.get_cache(self.cache).usage.groups[0].cells_used
                for name, client in self.clients.items()}

    def rebalance(self, max_moves: int = 8) -> None:
        """Migrates sequences from the node using the most cells to the one using the fewest,
        while a move narrows the gap. A move frees the sequence's private cells on its node
        (cells it shares with a fork stay) and takes all its tokens on the target."""
        for _ in range(max_moves):
            cells = self.cells_used()
            busiest = max(cells, key=lambda n: (cells[n], n))
            idlest = min(cells, key=lambda n: (cells[n], n))
            gap = cells[busiest] - cells[idlest]
            listed = self.clients[busiest].list_sequences(self.cache)
            private = {i.seq: i.groups[0].stored - i.groups[0].shared for i in listed}

            def gap_after(s: Placed) -> int:
                return abs((cells[busiest] - private[s.seq]) - (cells[idlest] + len(s.tokens)))

            candidates = [s for s in self.sequences if s.node == busiest and gap_after(s) < gap]
            if not candidates:
                print(f"balanced: cells used {cells}")
                return
            s = min(candidates, key=lambda s: (gap_after(s), s.seq))
            print(f"cells used {cells}: move seq {s.seq} ({len(s.tokens)} tokens, "
                  f"{private[s.seq]} private cells) {busiest} -> {idlest}")
            transfer = self.clients[busiest].migrate(self.cache, s.seq, idlest)
            assert transfer is not None
            print(f"  Migrate: {transfer.bytes} bytes over {transfer.transport} in "
                  f"{transfer.micros} us; seq {s.seq} now lives on {idlest}")
            s.node = idlest

    def verify(self) -> int:
        """Reads every sequence back from its node: the positions must be 0..n-1, the values
        the fake model's for its tokens (V exactly; K was re-rotated by context shifts, so
        only the keys of the tokens before KEEP are compared). Returns the failures."""
        failures = 0
        for s in self.sequences:
            client = self.clients[s.node]
            result = client.read(self.cache, s.seq)
            want = model_kv(self.layout, s.tokens)[0]
            got = result.data[0]
            ok = (result.positions[0] == tuple(range(len(s.tokens)))
                  and np.array_equal(got.v, want.v)
                  and np.array_equal(got.k[:, :KEEP], want.k[:, :KEEP]))
            listed = {i.seq: i for i in client.list_sequences(self.cache)}
            ok = ok and listed[s.seq].offset == len(s.tokens)
            failures += not ok
            print(f"  seq {s.seq:2d} on {s.node}: {len(s.tokens):3d} tokens, "
                  f"{listed[s.seq].groups[0].shared:3d} cells shared, "
                  f"{'verified' if ok else 'WRONG DATA'}")
        return failures

    def cleanup(self) -> None:
        for name, client in self.clients.items():
            client.delete_cache(self.cache)


def workload() -> List[Tuple[str, List[int]]]:
    """Chat requests as token ids: a shared system prompt, conversations that continue, and
    one that grows past the context."""
    system = list(range(1000, 1000 + KEEP))
    alice = system + list(range(2000, 2024))
    bob = system + list(range(3000, 3020))
    requests = [("req-1 alice", alice),
                ("req-2 bob", bob),
                ("req-3 alice turn 2", alice + list(range(2100, 2112))),
                ("req-4 carol", system + list(range(4000, 4030))),
                ("req-5 bob turn 2", bob + list(range(3100, 3116))),
                ("req-6 alice rewrite", alice[:30] + list(range(2200, 2210))),
                ("req-7 dave", system + list(range(5000, 5008)))]
    long_chat = alice + list(range(2100, 2112))
    for turn in range(3):  # each turn adds 28 tokens; the third passes MAX_CONTEXT
        long_chat = long_chat + list(range(6000 + 100 * turn, 6028 + 100 * turn))
        requests.append((f"req-{8 + turn} alice long turn {turn + 3}", long_chat))
    return requests


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("addresses", nargs="+", help="host:port of each node of the cluster")
    parser.add_argument("--cache", default="py-scheduler", help="cache name (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="do not delete the cache at the end")
    parser.add_argument("--tls-ca", help="PEM CA bundle: speak TLS to the nodes")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline per call, seconds")
    args = parser.parse_args(argv)

    tls = kvmesh.TlsOptions(ca_file=args.tls_ca) if args.tls_ca else None
    token = os.environ.get("KVMESH_TOKEN") or None
    clients: Dict[str, kvmesh.Client] = {}
    for address in args.addresses:
        client = kvmesh.Client(address, token=token, tls=tls, timeout=args.timeout)
        me = client.list_members()[0]
        print(f"{address}: node {me.name} ({me.backend}), members "
              f"{[m.name for m in client.list_members()]}")
        clients[me.name] = client

    scheduler = Scheduler(clients, args.cache)
    failures = 0
    try:
        print(f"== create cache {args.cache} on every node")
        scheduler.setup()
        print("== serve requests: route to the longest cached prefix, fork, prefill the rest")
        for name, tokens in workload():
            scheduler.submit(name, tokens)
        print(f"== rebalance with Migrate (sequences per node: {scheduler.load()})")
        scheduler.rebalance()
        print("== read every sequence back from its node")
        failures = scheduler.verify()
    except kvmesh.KvmeshError as error:
        print(f"scheduler: {error}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            try:
                scheduler.cleanup()
            except kvmesh.KvmeshError as error:
                print(f"scheduler: cleanup: {error}", file=sys.stderr)
        for client in clients.values():
            client.close()
    print(f"scheduler: {len(scheduler.sequences)} sequences on {len(clients)} nodes, "
          f"{failures} wrong")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
