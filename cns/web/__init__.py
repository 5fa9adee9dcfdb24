"""The daemon's HTTP front ends: the CNI socket API and its validation, the debug and metrics
endpoint, the views of the pool they render, and the listeners that bound their clients."""
