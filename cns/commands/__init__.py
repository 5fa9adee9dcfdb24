"""The command line: `cns` and its commands (install, systemd install, status) and the kubelet's
probe. Imports nothing: `python -m cns.commands.probe` must stay stdlib-only."""
