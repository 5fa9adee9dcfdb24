"""Which subnets a pod's ADD draws from in Kubernetes mode: the `acn.azure.com/subnets`
annotation of the pod, else of its namespace, else the network configuration's `subnets`, else
the primary subnet (pure functions of cns/kube/pods.py)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni_plugin.skel import MAX_SUBNETS
from cns.core.subnet_choice import SubnetChoiceInvalid
from cns.kube.pods import (
    SUBNETS_ANNOTATION,
    AnnotationInvalid,
    annotated_subnets,
    namespace_identity,
    pod_subnets,
    subnets_annotation_problem,
)

label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,10}[a-z0-9])?", fullmatch=True)
names = st.lists(label, min_size=1, max_size=3).map(".".join)
spaces = st.sampled_from(["", " ", "  "])


def annotated(kind: str, name: str, value: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if kind == "pod":
        meta["namespace"] = "team-a"
    if value is not None:
        meta["annotations"] = {SUBNETS_ANNOTATION: value, "other": "x"}
    return {"metadata": meta}


@given(st.lists(names, min_size=1, max_size=MAX_SUBNETS, unique=True), st.data())
def test_comma_separated_names_read_back_in_their_order(chosen: list[str], data: Any) -> None:
    value = ",".join(f"{data.draw(spaces)}{n}{data.draw(spaces)}" for n in chosen)
    assert subnets_annotation_problem(value) is None
    assert annotated_subnets(annotated("pod", "p", value), "pod team-a/p") == tuple(chosen)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "name 1 is empty"),
        ("v4,", "name 2 is empty"),
        ("v4,,v6", "name 2 is empty"),
        ("v4,v4", "names a subnet twice"),
        (",".join(f"s{i}" for i in range(MAX_SUBNETS + 1)), f"at most {MAX_SUBNETS}"),
        ("V4", "is not a ClusterSubnet name"),
        ("v4_pods", "is not a ClusterSubnet name"),
        ("-v4", "is not a ClusterSubnet name"),
        ("v4..x", "is not a ClusterSubnet name"),
        ("a" * 254, "is not a ClusterSubnet name"),
    ],
)
def test_a_malformed_annotation_names_its_problem(value: str, problem: str) -> None:
    assert problem in (subnets_annotation_problem(value) or "")
    with pytest.raises(AnnotationInvalid) as raised:
        annotated_subnets(annotated("namespace", "team-a", value), "namespace team-a")
    assert isinstance(raised.value, SubnetChoiceInvalid)  # what the socket API turns into code 7
    assert str(raised.value).startswith(f"annotation {SUBNETS_ANNOTATION}=")
    assert "of namespace team-a: " in str(raised.value)


options = st.one_of(st.none(), st.lists(names, min_size=1, max_size=2, unique=True).map(tuple))


@given(pod=options, namespace=options, configured=st.lists(names, max_size=2).map(tuple))
def test_the_pod_wins_then_the_namespace_then_the_configuration(
    pod: tuple[str, ...] | None, namespace: tuple[str, ...] | None, configured: tuple[str, ...]
) -> None:
    def obj(kind: str, chosen: tuple[str, ...] | None) -> dict[str, Any]:
        return annotated(kind, "x", None if chosen is None else ",".join(chosen))

    expected = pod if pod is not None else namespace if namespace is not None else configured
    assert pod_subnets(obj("pod", pod), obj("namespace", namespace), configured) == expected
    # An object not known (a pod not found) is one without the annotation.
    assert pod_subnets(None, obj("namespace", namespace), configured) == (
        namespace if namespace is not None else configured
    )
    assert pod_subnets(None, None, configured) == configured


def test_a_malformed_pod_annotation_never_falls_back_to_the_namespace() -> None:
    pod, namespace = annotated("pod", "p", "v4,v4"), annotated("namespace", "team-a", "v6")
    with pytest.raises(AnnotationInvalid, match="of pod team-a/p: names a subnet twice"):
        pod_subnets(pod, namespace, ())
    # A valid pod annotation is all that counts: the namespace's is not even read.
    bad_namespace = annotated("namespace", "team-a", "")
    assert pod_subnets(annotated("pod", "p", "v4"), bad_namespace, ()) == ("v4",)


def test_a_namespace_is_kept_as_its_name_and_subnets_annotation() -> None:
    namespace = {
        "metadata": {
            "name": "team-a",
            "resourceVersion": "7",
            "labels": {"a": "b"},
            "annotations": {SUBNETS_ANNOTATION: "v4", "big": "x" * 999},
            "managedFields": [{}],
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }
    assert namespace_identity(namespace) == {
        "metadata": {
            "name": "team-a",
            "resourceVersion": "7",
            "annotations": {SUBNETS_ANNOTATION: "v4"},
        }
    }
    assert namespace_identity({"metadata": {"name": "b"}}) == {"metadata": {"name": "b"}}


async def test_the_socket_api_answers_a_choice_it_cannot_make_with_a_cni_error() -> None:
    """A malformed annotation is the request's fault (400, code 7, naming it); a pod the daemon
    could not read is a retry later (503, code 11). Neither reaches the node."""
    from aiohttp.test_utils import TestClient, TestServer

    from cns.core.subnet_choice import SubnetChoiceUnknown
    from cns.node.attachments import Attachments
    from cns.node.service import NodeIPAM
    from cns.web import api

    async def choose(namespace: str, name: str, configured: tuple[str, ...]) -> tuple[str, ...]:
        if name == "bad":
            raise AnnotationInvalid(f"pod {namespace}/{name}", "x,,y", "name 2 is empty")
        raise SubnetChoiceUnknown(f"cannot read pod {namespace}/{name} from the API server")

    untouched: Any = object()  # any use of the node or the attachments would fail
    app = api.build_app(cast(NodeIPAM, untouched), cast(Attachments, untouched), None, choose)
    async with TestClient(TestServer(app)) as client:
        for name, status, code, text in (
            ("bad", 400, 7, "annotation acn.azure.com/subnets='x,,y' of pod team-a/bad"),
            ("late", 503, 11, "cannot read pod team-a/late"),
        ):
            ask = {"containerID": "c1", "ifName": "eth0", "podName": name, "podNamespace": "team-a"}
            for verb, extra in (("add", {}), ("attach", {"netns": "/run/netns/x"})):
                reply = await client.post(f"/v1/cni/{verb}", json={**ask, **extra})
                body = await reply.json()
                assert (reply.status, body["code"]) == (status, code), body
                assert body["msg"].startswith(text), body
