"""``cns-cni``: the main CNI plugin, a thin client of the cns daemon's socket API.

The daemon assigns the IP and builds the pod's veth pair with netlink (docs/networking.md); this
process only validates what the runtime passed, forwards it, and prints the result in the
requested ``cniVersion``, so each pod pays for a small stdlib interpreter and nothing more.

Network config (the plugin's own object, usually the first of a conflist)::

    {"type": "cns-cni", "socket": "/run/cns/cns.sock", "mtu": 1500,
     "releaseQueueDir": "/var/lib/cns/release-queue", "timeoutSeconds": 15}
"""

from __future__ import annotations

from cni_plugin import common
from cni_plugin.common import CniError
from cni_plugin.ipam import (
    IpamConfig,
    add_via,
    client_config,
    cmd_gc,
    cmd_status,
    prev_result_addresses,
    release_via,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.common import CniEnv, Invocation, NetConf

PROG = "cns-cni"
DEFAULT_MTU = 1500


def _mtu(conf: NetConf) -> int:
    value = conf.raw.get("mtu", DEFAULT_MTU)
    if isinstance(value, bool) or not isinstance(value, int) or not 576 <= value <= 65535:
        raise CniError(common.ERR_INVALID_CONFIG, f"{PROG}.mtu: must be an integer in 576..65535")
    return value


def cmd_add(env: CniEnv, conf: NetConf, daemon: IpamConfig) -> None:
    if not env.netns:
        raise CniError(common.ERR_INVALID_ENV, "CNI_NETNS: required for ADD")
    add_via("/v1/cni/attach", env, conf, daemon, mtu=_mtu(conf))


def cmd_del(env: CniEnv, conf: NetConf, daemon: IpamConfig) -> None:
    """Remove the interface and release; with the daemon down, queue it and succeed."""
    release_via("/v1/cni/detach", env, daemon)


def cmd_check(env: CniEnv, conf: NetConf, daemon: IpamConfig) -> None:
    common.require_version(conf.cni_version, "0.4.0", "CHECK")
    addresses = prev_result_addresses(conf)
    body: dict[str, object] = {
        "containerID": env.container_id,
        "ifName": env.ifname,
        "netns": env.netns,
    }
    if addresses is not None:
        body["ips"] = addresses
    common.call_daemon(daemon.socket, "POST", "/v1/cni/verify", body, daemon.timeout)


_COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "GC": cmd_gc,
    "STATUS": cmd_status,
}


def run(inv: Invocation) -> None:
    """One invocation; raises CniError on failure (see :func:`common.run_plugin`)."""
    common.dispatch(inv, _COMMANDS, lambda raw: client_config(raw, PROG))


def main() -> int:
    """Entry point of ``cns-cni``: exit status 0 on success, 1 after printing a CNI error."""
    return common.run_plugin(run, PROG)


if __name__ == "__main__":
    import sys

    sys.exit(main())
