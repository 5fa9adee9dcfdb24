"""cns: a node-level IP address manager for Kubernetes pod networking."""

__version__ = "0.1.0"
