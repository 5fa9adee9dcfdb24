"""The two ways choosing a pod's subnets can fail, as the node's CNI API answers them: the
choice is malformed (the same ADD fails until someone fixes it) or unknown now (it may succeed
later). Raised by the Kubernetes side that reads the choice, caught by the node's API."""

from __future__ import annotations


class SubnetChoiceInvalid(ValueError):
    """What chooses a pod's subnets (an annotation) is malformed; the message names it and the
    object that carries it. The pod's ADD fails until someone fixes it."""


class SubnetChoiceUnknown(Exception):
    """What chooses a pod's subnets could not be read now (the pod or its namespace is in no
    cache and the API server did not answer); the same ADD may succeed later."""
