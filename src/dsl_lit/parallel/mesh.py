"""The device mesh of a :class:`~dsl_lit.config.ParallelLayout`.

One (pp, edp, ep, tp) mesh with the flattened ``dp`` = (edp, ep) dimension: ``mesh["ep"]`` for
expert parallelism, ``mesh["dp"]`` for the non-expert gradient reduction and the data sampler
(dp rank = edp * ep + ep rank), ``mesh["edp"]`` for the routed experts' reduction, ``mesh["tp"]``
and ``mesh["pp"]`` for tensor and pipeline parallelism. tp ranks are adjacent (one node), then ep
ranks, so an ep group stays on as few nodes as tp allows; pipeline stages are outermost.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dsl_lit.config.parallel import MESH_DIM_NAMES, ParallelLayout


def build_device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """Initialise the layout's mesh over the default process group (every rank calls it)."""
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    mesh["edp", "ep"]._flatten("dp")
    return mesh
