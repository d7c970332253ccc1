"""Union-find over candidate pairs, vectorised: every node ends up labelled by its component's minimum.

Why vectorised hooking + pointer jumping instead of a Python loop of ``union`` calls: millions of
candidate pairs merge in a few numpy passes, and labelling by the minimum node makes the kept
document of each cluster its first occurrence, independent of pair order.
"""

from __future__ import annotations

import numpy as np


def connected_components(num_nodes: int, edges: np.ndarray) -> np.ndarray:
    """int64 [num_nodes]: for each node, the smallest node of its connected component."""
    parent = np.arange(num_nodes, dtype=np.int64)
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    if edges.size == 0:
        return parent
    u, v = edges[:, 0], edges[:, 1]
    while True:
        pu, pv = parent[u], parent[v]
        low, high = np.minimum(pu, pv), np.maximum(pu, pv)
        if np.array_equal(low, high):
            return parent
        np.minimum.at(parent, high, low)  # hook the larger root under the smaller one
        while True:  # pointer jumping: every node points at its root
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
