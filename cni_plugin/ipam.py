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

from cni_plugin import common
from cni_plugin.common import CniError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cni_plugin.common import CniEnv, Invocation, NetConf

PROG = "cns-ipam"
DEFAULT_SOCKET = "/run/cns/cns.sock"
DEFAULT_RELEASE_QUEUE_DIR = "/var/lib/cns/release-queue"
# The daemon may hold an ADD for up to 10 s waiting for a free IP; the client must outwait it.
DEFAULT_TIMEOUT_SECONDS = 15.0
MAX_TIMEOUT_SECONDS = 3600.0  # a runtime gives up on a plugin long before
VALID_ATTACHMENTS_KEY = "cni.dev/valid-attachments"


class IpamConfig:
    """The validated ``ipam`` object of the network config."""

    __slots__ = ("release_queue_dir", "socket", "timeout")

    def __init__(self, socket: str, release_queue_dir: str, timeout: float) -> None:
        self.socket = socket
        self.release_queue_dir = release_queue_dir
        self.timeout = timeout


def parse_ipam_config(conf: dict[str, object]) -> IpamConfig:
    """Read the ``ipam`` object (code 7 naming the field that is missing or wrong)."""
    ipam = conf.get("ipam")
    if not isinstance(ipam, dict):
        raise CniError(common.ERR_INVALID_CONFIG, "ipam: missing or not an object")
    return client_config(ipam, "ipam")


def client_config(section: dict[str, object], where: str) -> IpamConfig:
    """How to reach the daemon, from `section` (``ipam`` here, the plugin's own for cns-cni)."""
    return IpamConfig(
        common.config_str(section, "socket", DEFAULT_SOCKET, where),
        common.config_str(section, "releaseQueueDir", DEFAULT_RELEASE_QUEUE_DIR, where),
        common.config_number(
            section, "timeoutSeconds", DEFAULT_TIMEOUT_SECONDS, where, MAX_TIMEOUT_SECONDS
        ),
    )


def add_via(path: str, env: CniEnv, conf: NetConf, daemon: IpamConfig, **extra: object) -> None:
    """ADD through the daemon's `path` (cns-ipam: add, cns-cni: attach); print the result."""
    body: dict[str, object] = {
        "containerID": env.container_id,
        "ifName": env.ifname,
        "netns": env.netns,
        **extra,
    }
    if env.pod_name is not None:
        body["podName"] = env.pod_name
    if env.pod_namespace is not None:
        body["podNamespace"] = env.pod_namespace
    result = common.call_daemon(daemon.socket, "POST", path, body, daemon.timeout)
    common.print_json(common.convert_result(result, conf.cni_version))


def release_via(path: str, env: CniEnv, daemon: IpamConfig) -> None:
    """DEL through the daemon's `path`; if it is unreachable, queue the release and succeed."""
    body = {"containerID": env.container_id, "ifName": env.ifname}
    try:
        common.call_daemon(daemon.socket, "POST", path, body, daemon.timeout)
    except CniError as err:
        if err.code != common.ERR_UNREACHABLE:
            raise
        common.queue_release(daemon.release_queue_dir, env.container_id, env.ifname)


def cmd_add(env: CniEnv, conf: NetConf, ipam: IpamConfig) -> None:
    add_via("/v1/cni/add", env, conf, ipam)


def cmd_del(env: CniEnv, conf: NetConf, ipam: IpamConfig) -> None:
    release_via("/v1/cni/del", env, ipam)


def prev_result_addresses(conf: NetConf) -> list[str] | None:
    prev = conf.raw.get("prevResult")
    if not isinstance(prev, dict):
        raise CniError(
            common.ERR_INVALID_CONFIG, "prevResult: missing or not an object", "CHECK needs it"
        )
    ips = prev.get("ips")
    if ips is None:
        return None
    if not isinstance(ips, list):
        raise CniError(common.ERR_INVALID_CONFIG, "prevResult.ips: not a list")
    addresses: list[str] = []
    for i, ip in enumerate(ips):
        address = ip.get("address") if isinstance(ip, dict) else None
        if not isinstance(address, str) or not address:
            raise CniError(
                common.ERR_INVALID_CONFIG, f"prevResult.ips[{i}].address: missing or not a string"
            )
        addresses.append(address)
    return addresses


def cmd_check(env: CniEnv, conf: NetConf, ipam: IpamConfig) -> None:
    common.require_version(conf.cni_version, "0.4.0", "CHECK")
    addresses = prev_result_addresses(conf)
    body: dict[str, object] = {"containerID": env.container_id, "ifName": env.ifname}
    if addresses is not None:
        body["ips"] = addresses
    common.call_daemon(ipam.socket, "POST", "/v1/cni/check", body, ipam.timeout)


def _valid_attachments(conf: NetConf) -> list[dict[str, object]]:
    """``cni.dev/valid-attachments``; missing is an error, not "none valid" (that releases all)."""
    key = VALID_ATTACHMENTS_KEY
    items = conf.raw.get(key)
    if not isinstance(items, list):
        raise CniError(common.ERR_INVALID_CONFIG, f"{key}: missing or not a list")
    out: list[dict[str, object]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise CniError(common.ERR_INVALID_CONFIG, f"{key}[{i}]: not an object")
        for field in ("containerID", "ifname"):
            if not isinstance(item.get(field), str) or not item.get(field):
                raise CniError(
                    common.ERR_INVALID_CONFIG, f"{key}[{i}].{field}: missing or not a string"
                )
        out.append({"containerID": item["containerID"], "ifname": item["ifname"]})
    return out


def cmd_gc(env: CniEnv, conf: NetConf, ipam: IpamConfig) -> None:
    common.require_version(conf.cni_version, "1.1.0", "GC")
    body = {"validAttachments": _valid_attachments(conf)}
    common.call_daemon(ipam.socket, "POST", "/v1/cni/gc", body, ipam.timeout)


def cmd_status(env: CniEnv, conf: NetConf, ipam: IpamConfig) -> None:
    """Succeed iff the daemon can serve ADDs; every "cannot" is code 50 (plugin not available)."""
    common.require_version(conf.cni_version, "1.1.0", "STATUS")
    try:
        reply = common.call_daemon(ipam.socket, "GET", "/v1/cni/status", None, ipam.timeout)
    except CniError as err:
        if err.code == common.ERR_UNREACHABLE:
            raise CniError(common.ERR_NOT_AVAILABLE, err.msg, err.details) from None
        raise
    if isinstance(reply, dict) and reply.get("ready") is False:
        raise CniError(common.ERR_NOT_AVAILABLE, f"cns daemon at {ipam.socket} is not ready")


_COMMANDS = {
    "ADD": cmd_add,
    "DEL": cmd_del,
    "CHECK": cmd_check,
    "GC": cmd_gc,
    "STATUS": cmd_status,
}


def run(inv: Invocation) -> None:
    """One invocation; raises CniError on failure (see :func:`common.run_plugin`)."""
    common.dispatch(inv, _COMMANDS, parse_ipam_config)


def main() -> int:
    """Entry point of ``cns-ipam``: exit status 0 on success, 1 after printing a CNI error."""
    return common.run_plugin(run, PROG)


if __name__ == "__main__":
    import sys

    sys.exit(main())
