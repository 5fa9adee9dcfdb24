"""Fuzzing `cns-ipam`, `cns-cni` and the socket API with hypothesis: `python -m bench.stress.fuzz`
(the targets, the checks and the options are described in `__main__.py`)."""
