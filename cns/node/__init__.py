"""The node side of cns: the daemon, its IPAM service, and what feeds and checks it.

Layers, top down (the import contract in pyproject.toml enforces them): `daemon` wires the
program; `attachments`, `leak_reclaim` and `startup_check` work on the service; `service` is
the node's IPAM (`NodeIPAM`); `control_plane` (the source interface and the in-memory source),
`standalone` (the source without Kubernetes) and `kube_source` (the source over the Kubernetes
API) are adapters it is fed by.
"""
