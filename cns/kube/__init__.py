"""Kubernetes adapters: the daemon's NCSource over NodeNetworkConfig, and shared plumbing."""

# Where the NodeNetworkConfigs and the controller's Lease live unless configured otherwise.
# Here rather than in resources.py: the config reads it, and standalone nodes import no more.
NAMESPACE = "kube-system"
