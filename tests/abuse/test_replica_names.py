"""Replica names go into headers, metric labels, log fields and admin paths: a name that
cannot go everywhere is refused, and names kvlb makes itself (DNS members are
HOST/ADDRESS:PORT) are reachable through the admin API."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote, urlsplit

import orjson
import pytest
import yaml

from tests.abuse.harness import (
    JSON,
    GoodClient,
    Kvlb,
    RawConn,
    bearer,
    get,
    replica,
    run_cli,
    start_kvlb,
    under_attack,
)

BAD_NAMES = ["two words", "réplica"]
TOKEN_ENV = "KVLB_ABUSE_ADMIN_TOKEN"
TOKEN = "admin-secret"


@pytest.mark.parametrize("name", BAD_NAMES)
def test_check_config_refuses_a_replica_name_with_spaces_or_non_ascii(tmp_path, name) -> None:
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump({"replicas": [replica("http://127.0.0.1:9999", name)]}, allow_unicode=True))
    result = run_cli("check-config", str(path))
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"check-config accepted replica name {name!r}: {output.strip()}"
    assert "replicas[0].name" in output, output


async def admin(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    conn = await RawConn.open(port)
    try:
        headers = [bearer(TOKEN)] + ([JSON] if body else [])
        answer = await conn.request(method, path, body, headers)
    finally:
        conn.close()
    return answer.status, orjson.loads(answer.body) if answer.body else {}


@pytest.fixture(scope="module")
def with_admin(sim: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Kvlb, str]]:
    """kvlb with the admin API, in front of a replica set whose one member is named
    "127.0.0.1/127.0.0.1:PORT", as DNS members are."""
    port = urlsplit(sim[0]).port
    k = start_kvlb(tmp_path_factory.mktemp("admin"), {
        "replica_sets": [{"host": "127.0.0.1", "port": port, "refresh_s": 3600}],
        "admin": {"token_env": TOKEN_ENV},
    }, env={TOKEN_ENV: TOKEN})
    try:
        yield k, f"127.0.0.1/127.0.0.1:{port}"
    finally:
        k.stop()


async def test_the_admin_api_refuses_replica_names_with_spaces_or_non_ascii(with_admin, sim) -> None:
    k, _ = with_admin
    async with under_attack(k, GoodClient(k.port)):
        for name in BAD_NAMES:
            status, body = await admin(k.port, "POST", "/admin/replicas",
                                       orjson.dumps({"url": sim[1], "name": name}))
            assert status == 400, f"POST /admin/replicas with name {name!r}: {status} {body}"
            assert body["error"]["code"] == "invalid_replica", body


async def test_the_admin_api_reaches_a_replica_whose_name_holds_a_slash(with_admin) -> None:
    k, member = with_admin
    path = "/admin/replicas/" + quote(member, safe="")
    async with under_attack(k, GoodClient(k.port)):
        status, body = await admin(k.port, "GET", path)
        assert status == 200 and body.get("name") == member, f"GET {path}: {status} {body}"
    # Removing the replica the good client uses: after it has stopped.
    status, body = await admin(k.port, "DELETE", path)
    assert status == 200, f"DELETE {path}: {status} {body}"
    status, _ = await admin(k.port, "GET", path)
    assert status == 404
    assert (await get(k.port, "/health")).status == 200
