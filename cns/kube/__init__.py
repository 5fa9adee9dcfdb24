"""Kubernetes adapters: the daemon's NCSource over NodeNetworkConfig, and shared plumbing."""
