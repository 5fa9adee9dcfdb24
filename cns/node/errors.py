"""How the node service fails a request: CNI error codes and messages, never HTTP statuses.

The subclass says what kind of failure it is; the socket API gives each kind its HTTP status
(cns/web/api.py, HTTP_STATUS). The code alone cannot say it: code 4 is a malformed identifier (400)
or another pod's attachment (409).
"""

from __future__ import annotations

from typing import Any

from cns.core.pool import OwnerConflict
from cns.core.requested import Misplaced
from cns.state.store import Rejected, StoreError


class IPAMError(Exception):
    """A request's failure as the CNI caller gets it: a CNI error code, a message and details."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "msg": self.msg, "details": self.details}


class InvalidRequest(IPAMError):
    """The request itself is wrong: a field missing, malformed, or that the state file cannot
    hold."""


class NotFound(IPAMError):
    """The request names an attachment the node does not hold."""


class Conflict(IPAMError):
    """The request contradicts what the node holds: another pod's attachment, another address,
    the state file's record. Nothing changed."""


class Unavailable(IPAMError):
    """The node cannot serve the request now (no free IP in time, state not committable,
    shutting down); the same request may succeed later."""


class InternalError(IPAMError):
    """cns, or the host under it, failed on a request that was fine."""


class PublishFailed(Exception):
    """The control plane did not take the pool request (the source's error is the cause).

    Only this is retried by the reconcile loop: any other failure of a reconcile is a bug and
    ends the task, which stops the daemon instead of looping on it.
    """


class AddressRefused(Exception):
    """A requested address the node cannot give now: which one and why (nothing changed)."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(why)
        self.address = address
        self.why = why


def stopping_error() -> IPAMError:
    return Unavailable(11, "cns is shutting down", "retry the ADD once cns is back")


def conflict_error(conflict: OwnerConflict) -> IPAMError:
    """Code 4: the runtime's CNI_CONTAINERID + CNI_IFNAME belong to another pod already."""
    key = conflict.holder.key
    return Conflict(
        4,
        f"container {key.container_id} interface {key.ifname} belongs to pod "
        f"{conflict.holder.pod}, not {conflict.asked.pod}",
        "an ADD never relabels an attachment; DEL it first",
    )


def refused_error(refused: AddressRefused) -> IPAMError:
    """Code 11: a requested address the node cannot give now, and why."""
    return Unavailable(11, f"requested address {refused.address} cannot be assigned: {refused.why}")


def wrong_request(field: str, wrong: Misplaced | OwnerConflict) -> IPAMError:
    """Code 7 for addresses that do not fit the subnets named; code 4 for another pod's
    attachment."""
    if isinstance(wrong, OwnerConflict):
        return conflict_error(wrong)
    return InvalidRequest(7, f"{field}: {wrong}")


def store_error(exc: StoreError) -> IPAMError:
    """A storage failure is every waiting request's (CNI 5, I/O failure). A refused record is
    its own request's: a field the state file cannot hold (CNI 4 for the identifiers, 7 for the
    rest), or a conflict with what it records (CNI 11: memory now follows the disk, so a retry
    gets a consistent answer)."""
    if not isinstance(exc, Rejected):
        return Unavailable(5, str(exc))
    if exc.field is None:
        return Conflict(11, str(exc))
    return InvalidRequest(4 if exc.field in ("containerID", "ifName") else 7, str(exc))
