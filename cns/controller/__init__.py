"""The reference subnet control plane: `cns controller`."""
