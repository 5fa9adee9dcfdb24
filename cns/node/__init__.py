"""The node side of cns: the daemon, its IPAM service, and what feeds and checks it.

Layers, top down (the import contract in pyproject.toml enforces them): `daemon` wires the
program; `attachments`, `leak_reclaim` and `startup_check` work on the service; `service` is
the node's IPAM (`NodeIPAM`); `control_plane` (the source interface and the in-memory source)
and `standalone` (the source without Kubernetes) are adapters it is fed by.
"""
