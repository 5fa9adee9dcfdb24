"""The host the daemon runs on: the rtnetlink client, the veth data path, the container runtime
(CRI), systemd's notification socket and the C library's heap."""
