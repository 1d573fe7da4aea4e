"""examples/scheduler.py against a three-node cluster, as deploy/local/demo.sh runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest

import nodes

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "scheduler.py")


class SchedulerExampleTest(unittest.TestCase):

    def test_scheduler(self) -> None:
        cluster = nodes.start_cluster(["node-0", "node-1", "node-2"])
        try:
            result = subprocess.run([sys.executable, EXAMPLE] + [n.address for n in cluster],
                                    capture_output=True, text=True, timeout=120)
        finally:
            for node in cluster:
                node.stop_checked()
        out = result.stdout + result.stderr
        self.assertEqual(result.returncode, 0, out)
        for what in ("LookupPrefix on node-", "local CopyPrefix, cells shared", "CopyPrefix from node-",
                     "context shift of seq", "Migrate: ", "10 sequences on 3 nodes, 0 wrong"):
            self.assertIn(what, out)
        self.assertNotIn("WRONG DATA", out)


if __name__ == "__main__":
    unittest.main()
