"""The device mesh of a :class:`~dsl_lit.config.ParallelLayout`.

One (pp, edp, ep, cp, tp) mesh with flattened dimensions: ``dp`` = (edp, ep) for the data sampler
(dp rank = edp * ep + ep rank; the cp ranks of a replica read the same rows), ``dp_cp`` = (edp,
ep, cp) for the non-expert gradient reduction and every count a step normalises by, ``edp_cp`` =
(edp, cp) for the routed experts' reduction (the ranks that hold the same experts);
``mesh["ep"]``, ``mesh["cp"]``, ``mesh["tp"]`` and ``mesh["pp"]`` for expert, context, tensor and
pipeline parallelism. tp ranks are adjacent (one node), then cp and ep ranks, so those groups stay
on as few nodes as tp allows; pipeline stages are outermost.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dsl_lit.config.parallel import MESH_DIM_NAMES, ParallelLayout


def build_device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """Initialise the layout's mesh over the default process group (every rank calls it)."""
    mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    mesh["edp", "ep"]._flatten("dp")
    mesh["edp", "ep", "cp"]._flatten("dp_cp")
    mesh["edp", "cp"]._flatten("edp_cp")
    return mesh
