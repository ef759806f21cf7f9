"""The authorization table covers the contracts exactly: every RPC declared in protos/ names the
roles allowed to call it (a new RPC without an entry fails here), and no entry names an RPC that
does not exist."""

import re

from rlmesh.rpc.authz import AUTHORIZED, OPEN_SERVICES, ROLES, USER_CONTRACTS, allowed_roles, service_of
from tests.support.paths import REPO_ROOT

PROTOS = REPO_ROOT / "protos"


def declared_rpcs() -> set[str]:
    """ "/package.Service/Method" of every rpc in every .proto file, read from the text."""
    paths = set()
    for proto in PROTOS.rglob("*.proto"):
        text = re.sub(r"//[^\n]*", "", proto.read_text())
        package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.MULTILINE).group(1)
        for service, body in re.findall(r"\bservice\s+(\w+)\s*\{(.*?)\n\}", text, re.DOTALL):
            paths |= {f"/{package}.{service}/{method}" for method in re.findall(r"\brpc\s+(\w+)\s*\(", body)}
    return paths


def test_every_rpc_of_every_contract_has_an_entry_and_every_entry_an_rpc():
    declared = {rpc for rpc in declared_rpcs() if service_of(rpc) not in USER_CONTRACTS}
    assert len(declared) >= 27
    assert declared - set(AUTHORIZED) == set(), "RPCs with no entry in rlmesh/rpc/authz.py AUTHORIZED"
    assert set(AUTHORIZED) - declared == set(), "entries of rlmesh/rpc/authz.py AUTHORIZED that no contract declares"


def test_every_entry_names_known_roles_and_no_contract_is_open():
    for method, roles in AUTHORIZED.items():
        assert roles and roles <= set(ROLES), method
        assert service_of(method) not in OPEN_SERVICES
    assert allowed_roles("/rlmesh.manager.v1.ManagerService/NotYetWritten") == frozenset()


def test_what_only_the_trainer_may_do():
    trainer_only = {method.rsplit("/", 1)[1] for method, roles in AUTHORIZED.items() if roles == {"trainer"}}
    assert {
        "PublishVersion",
        "UploadWeights",
        "UploadShards",
        "SubmitPrompts",
        "StreamRollouts",
        "StartSession",
    } <= trainer_only
    assert allowed_roles("/rlmesh.manager.v1.ManagerService/RegisterInstance") == {"instance"}
    assert all(
        "observer" not in roles
        for method, roles in AUTHORIZED.items()
        if not method.endswith(("/GetStatus", "/ListInstances", "/GetInfo", "/GetTrainingStatus"))
    )


def test_the_contracts_users_serve_are_in_no_roles_table():
    """A remote verifier or environment is the user's code: no role's credential is meant for it."""
    assert USER_CONTRACTS == {"rlmesh.reward.v1.RewardService", "rlmesh.environment.v1.EnvironmentService"}
    assert not [method for method in AUTHORIZED if service_of(method) in USER_CONTRACTS]
    assert allowed_roles("/rlmesh.reward.v1.RewardService/Score") == frozenset()


def test_the_security_page_shows_the_table_as_it_is():
    page = (PROTOS.parent / "docs" / "security.md").read_text()
    shown = {
        (service, rpc): {role.strip() for role in roles.split(",")}
        for service, rpc, roles in re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([\w, ]+) \|$", page, re.MULTILINE)
    }
    actual = {(method.split(".")[1], method.rsplit("/", 1)[1]): set(roles) for method, roles in AUTHORIZED.items()}
    assert shown == actual
