"""``cns-ipam``: the CNI IPAM plugin, a thin client of the cns daemon's socket API.

All IP address management lives in the daemon (docs/api.md); this process only validates what the
runtime passed, forwards it over the unix socket and converts the answer to the requested
``cniVersion``. The one thing it does on its own is queueing a DEL on disk when the daemon is
down, because a DEL must never fail for that reason (the runtime would retry it forever).

Network config (``ipam`` object)::

    {"type": "cns-ipam", "socket": "/run/cns/cns.sock",
     "releaseQueueDir": "/var/lib/cns/release-queue", "timeoutSeconds": 15,
     "subnets": ["v4pods", "v6pods"]}

``subnets`` (optional) names the subnets an ADD gets one address of each (dual-stack: an IPv4
and an IPv6 one), all or none; without it, one address of the node's primary subnet.
"""

from __future__ import annotations

from cni_plugin import client, skel
from cni_plugin.skel import CniError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.client import DaemonClient
    from cni_plugin.skel import CniEnv, Invocation, NetConf

PROG = "cns-ipam"


def parse_ipam_config(conf: dict[str, object]) -> DaemonClient:
    """Read the ``ipam`` object (code 7 naming the field that is missing or wrong)."""
    ipam = conf.get("ipam")
    if not isinstance(ipam, dict):
        raise CniError(skel.ERR_INVALID_CONFIG, "ipam: missing or not an object")
    return client.daemon_client(ipam, where="ipam")


def cmd_add(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    client.add_via("/v1/cni/add", env, conf, ipam)


def cmd_del(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    client.release_via("/v1/cni/del", env, ipam)


def cmd_check(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    client.check_via("/v1/cni/check", env, conf, ipam)


_COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "GC": client.cmd_gc,
    "STATUS": client.cmd_status,
}


def run(inv: Invocation) -> None:
    """One invocation; raises CniError on failure (see :func:`cni_plugin.skel.run_plugin`)."""
    skel.dispatch(inv, _COMMANDS, parse_ipam_config)


def main() -> int:
    """Entry point of ``cns-ipam``: exit status 0 on success, 1 after printing a CNI error."""
    return skel.run_plugin(run, PROG)


if __name__ == "__main__":
    import sys

    sys.exit(main())
