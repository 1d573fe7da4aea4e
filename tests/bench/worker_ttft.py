"""The reference worker's time to first token (clients/python/examples/reference_worker.py): a
node with --local-socket is started, then an N-token prompt is run through the worker's model
with its K/V in kvmesh's cells, once recomputed from scratch and once with the whole prompt
already stored (a full prefix hit: only the next token's forward pass). Run by
`tests/bench/run.sh local`, which sets KVMESH_NODE and PYTHONPATH.

    worker_ttft.py [--tokens N (4096)] [--dtype f32|bf16] [--reps N (3)]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import nodes
import reference_worker as worker


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-ttft-") as directory:
        socket = os.path.join(directory, "local.sock")
        node = nodes.Node("ttft", args=[f"--local-socket={socket}"])
        try:
            t = worker.time_to_first_token(worker.Config(dtype=args.dtype), node.address, socket,
                                           args.tokens, reps=args.reps)
        finally:
            node.stop_checked()
    load = os.getloadavg()
    print(f"reference worker ({args.dtype}, {worker.Config().layers}): time to first token of a "
          f"{args.tokens}-token prompt: recomputed {t['recompute_s']:.3f} s, full prefix hit "
          f"{t['prefix_hit_s'] * 1000:.1f} ms = {t['recompute_s'] / t['prefix_hit_s']:.0f}x "
          f"faster (medians of {args.reps}; load average {load[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
