"""The `pagekv.v1.Generation` contract as another client sees it, checked the same way against
a pod and against the router in front of two pods: a client must not be able to tell them
apart (the router only adds `routing`). Here: discovery, server reflection
and health.

The client side is written from the .proto alone: plain generated stubs, grpc.health.v1 and a
hand-written server-reflection client. One cluster (Redis, two pods, the router, as
processes) serves every test_api_contract_*.py module (conftest.py); helpers are in
contract_fixtures.py.
"""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.contract_fixtures import SERVICE, Target

pytestmark = pytest.mark.integration


# -- discovery: reflection and health ----------------------------------------------------------

def test_reflection_lists_and_describes_the_service(target: Target) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(target.channel)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]
    listed, described = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    services = {f"{f.package}.{s.name}": s for f in files for s in f.service}
    methods = {m.name: (m.input_type, m.output_type, m.server_streaming)
               for m in services[SERVICE].method}
    assert methods == {
        "Generate": (".pagekv.v1.GenerateRequest", ".pagekv.v1.GenerateResponse", False),
        "GenerateStream": (".pagekv.v1.GenerateRequest", ".pagekv.v1.GenerateChunk", True),
    }


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_serving(target: Target, service: str) -> None:
    stub = health_pb2_grpc.HealthStub(target.channel)
    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
