"""``cns-cni``: the main CNI plugin, a thin client of the cns daemon's socket API.

The daemon assigns the IP and builds the pod's veth pair with netlink (docs/networking.md); this
process only validates what the runtime passed, forwards it, and prints the result in the
requested ``cniVersion``, so each pod pays for a small stdlib interpreter and nothing more.

Network config (the plugin's own object, usually the first of a conflist)::

    {"type": "cns-cni", "socket": "/run/cns/cns.sock", "mtu": 1500,
     "releaseQueueDir": "/var/lib/cns/release-queue", "timeoutSeconds": 15,
     "subnets": ["v4pods", "v6pods"]}

``subnets`` (optional): one address of each subnet named (dual-stack), as for ``cns-ipam``.
"""

from __future__ import annotations

from cni_plugin import client, skel
from cni_plugin.skel import CniError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.client import DaemonClient
    from cni_plugin.skel import CniEnv, Invocation, NetConf

PROG = "cns-cni"
DEFAULT_MTU = 1500


def _mtu(conf: NetConf) -> int:
    value = conf.raw.get("mtu", DEFAULT_MTU)
    if isinstance(value, bool) or not isinstance(value, int) or not 576 <= value <= 65535:
        raise CniError(skel.ERR_INVALID_CONFIG, f"{PROG}.mtu: must be an integer in 576..65535")
    return value


def cmd_add(env: CniEnv, conf: NetConf, daemon: DaemonClient) -> None:
    if not env.netns:
        raise CniError(skel.ERR_INVALID_ENV, "CNI_NETNS: required for ADD")
    client.add_via("/v1/cni/attach", env, conf, daemon, mtu=_mtu(conf))


def cmd_del(env: CniEnv, conf: NetConf, daemon: DaemonClient) -> None:
    """Remove the interface and release; with the daemon down, queue it and succeed."""
    client.release_via("/v1/cni/detach", env, daemon)


def cmd_check(env: CniEnv, conf: NetConf, daemon: DaemonClient) -> None:
    client.check_via("/v1/cni/verify", env, conf, daemon, netns=env.netns)


_COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "GC": client.cmd_gc,
    "STATUS": client.cmd_status,
}


def run(inv: Invocation) -> None:
    """One invocation; raises CniError on failure (see :func:`cni_plugin.skel.run_plugin`)."""
    skel.dispatch(inv, _COMMANDS, lambda raw: client.daemon_client(raw, where=PROG))


def main() -> int:
    """Entry point of ``cns-cni``: exit status 0 on success, 1 after printing a CNI error."""
    return skel.run_plugin(run, PROG)


if __name__ == "__main__":
    import sys

    sys.exit(main())
