"""The Kubernetes API for the node and the controller alike: the objects typed (`wire`), read,
checked and built per kind, the client and its watched collections. Imports nothing of the node
or the controller (the node's source over it is `cns.node.kube_source`)."""

# Where the NodeNetworkConfigs and the controller's Lease live unless configured otherwise.
# Here rather than in objects.py: the config reads it, and standalone nodes import no more.
NAMESPACE = "kube-system"
