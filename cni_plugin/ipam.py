"""``cns-ipam``: the CNI IPAM plugin, a thin client of the cns daemon's socket API.

All IP address management lives in the daemon (docs/api.md); this process only validates what the
runtime passed, forwards it over the unix socket and converts the answer to the requested
``cniVersion``. The one thing it does on its own is queueing a DEL on disk when the daemon is
down, because a DEL must never fail for that reason (the runtime would retry it forever).

Network config (``ipam`` object)::

    {"type": "cns-ipam", "socket": "/run/cns/cns.sock",
     "releaseQueueDir": "/var/lib/cns/release-queue", "timeoutSeconds": 15}
"""

from __future__ import annotations

from cni_plugin.client import (
    DaemonClient,
    add_via,
    check_via,
    cmd_gc,
    cmd_status,
    daemon_client,
    release_via,
)
from cni_plugin.skel import (
    ERR_INVALID_CONFIG,
    CniError,
    dispatch,
    run_plugin,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.skel import CniEnv, Invocation, NetConf

PROG = "cns-ipam"


def parse_ipam_config(conf: dict[str, object]) -> DaemonClient:
    """Read the ``ipam`` object (code 7 naming the field that is missing or wrong)."""
    ipam = conf.get("ipam")
    if not isinstance(ipam, dict):
        raise CniError(ERR_INVALID_CONFIG, "ipam: missing or not an object")
    return daemon_client(ipam, where="ipam")


def cmd_add(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    add_via("/v1/cni/add", env, conf, ipam)


def cmd_del(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    release_via("/v1/cni/del", env, ipam)


def cmd_check(env: CniEnv, conf: NetConf, ipam: DaemonClient) -> None:
    check_via("/v1/cni/check", env, conf, ipam)


_COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "GC": cmd_gc,
    "STATUS": cmd_status,
}


def run(inv: Invocation) -> None:
    """One invocation; raises CniError on failure (see :func:`cni_plugin.skel.run_plugin`)."""
    dispatch(inv, _COMMANDS, parse_ipam_config)


def main() -> int:
    """Entry point of ``cns-ipam``: exit status 0 on success, 1 after printing a CNI error."""
    return run_plugin(run, PROG)


if __name__ == "__main__":
    import sys

    sys.exit(main())
