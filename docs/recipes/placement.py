"""Recipe: add a placement (fetch a miss only when enough tokens share it) and plan with it."""

import numpy as np

from moelab.hybrid.offline import plan_routing
from moelab.hybrid.placement import FETCH, HOST, PLACEMENTS, Placement
from moelab.routing import ForwardRouting


@PLACEMENTS.register("fetch-shared")
class FetchShared(Placement):
    """Copy a missed expert to the device when at least ``min_tokens`` tokens use it (one copy
    serves them all); run it on the host otherwise (one token: reading it there is cheaper)."""

    name = "fetch-shared"
    min_tokens = 2

    def place(self, hits, misses, cost):  # hits, misses: (expert, tokens) pairs of one MoE layer
        return {e: FETCH if n >= self.min_tokens else HOST for e, n in misses}


def forward(i, phase, ids):  # the routing of one forward pass with a single MoE layer (top-2)
    ids = np.array(ids, dtype=np.int64)
    weights = np.tile(np.array([0.6, 0.4], dtype=np.float32), (len(ids), 1))
    return ForwardRouting(forward=i, step=i, phase=phase, tokens=len(ids), ids=[ids], weights=[weights])


routing = [forward(0, "prefill", [[0, 1], [0, 2], [3, 1]]), forward(1, "decode", [[2, 3]])]
config = {"cache": {"capacity": 0}, "placement": "fetch-shared"}  # no device cache: all misses
plans = plan_routing(routing, config, num_experts=[4], top_k=[2], expert_bytes=1024)
for p in plans:
    print(p.phase, "device:", p.device, "host:", p.host, "copies:", [t.expert for t in p.transfers])
