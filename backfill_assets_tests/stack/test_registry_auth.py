"""Schema registry credentials reach every registry client the project makes.

The registry is the session's real local Apicurio Registry. It cannot require credentials here
(its authentication needs a Keycloak/OIDC server), so a credential-checking proxy of the test
support (``support/auth_proxy.py``) stands in front of it: the 401 comes from that proxy, every
schema from the real registry. ``BACKFILL_SCHEMA_REGISTRY_URL`` names the proxy, and the
project's clients register (the demo's encoder), derive columns (``spec/registry_columns``),
resolve writer schemas (the replay's ``avro.resolve``) and decode a record (the checks'
``RecordDecoder``) through it.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from backfill_assets.demo.avro import Encoder
from backfill_assets.errors import SettingsError
from backfill_assets.lake.decode import avro
from backfill_assets.lake.decode.content import RecordDecoder
from backfill_assets.spec import registry_columns
from backfill_assets.stack import registry as registry_module
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import CCOMPAT_PATH, Settings, listing
from backfill_assets_tests.demo.test_demo_avro import readme_spec
from backfill_assets_tests.support.auth_proxy import auth_proxy, basic


@dataclass(frozen=True)
class OrderEvent:
    """One valid demo event, as the demo's Avro encoder reads it."""

    value: bytes = json.dumps({"customer_id": "c1", "channel": "web"}).encode()
    schema_version: int = 2
    event_id: str = "e1"
    order_id: str = "o1"
    event_type: str = "order_created"
    status: str = "created"
    currency: str = "EUR"
    amount_minor: int = 1250
    event_time_ms: int = 1_770_872_400_000


@dataclass(frozen=True)
class Guarded:
    settings: Settings  # BACKFILL_SCHEMA_REGISTRY_URL: the proxy, with the right credentials
    secret: str
    proxy_url: str


@pytest.fixture(params=["basic", "bearer"])
def guarded(request: pytest.FixtureRequest, registry: LocalRegistry) -> Iterator[Guarded]:
    secret = secrets.token_urlsafe(18)
    if request.param == "basic":
        env = {"BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH": f"reader:{secret}"}
        header = basic(f"reader:{secret}")
    else:
        env = {"BACKFILL_SCHEMA_REGISTRY_TOKEN": secret}
        header = f"Bearer {secret}"
    with auth_proxy(registry.url.removesuffix(CCOMPAT_PATH), header) as proxy:
        url = proxy + CCOMPAT_PATH
        yield Guarded(Settings.from_env({**env, "BACKFILL_SCHEMA_REGISTRY_URL": url}), secret, url)


def test_every_registry_client_sends_the_credentials(guarded: Guarded) -> None:
    """Register, derive columns, resolve writers and decode, all through the guarded URL."""
    s = guarded.settings
    url, auth = s.schema_registry_url, s.schema_registry_auth
    topic = f"auth-{uuid.uuid4().hex[:8]}"
    encode = Encoder(url, topic, auth)  # registers both versions through the proxy
    value = encode(OrderEvent())
    spec = readme_spec(topic)
    derived = registry_columns.read_columns("avro", f"{topic}-value", url, None, auth)
    assert {c["name"] for c in derived.columns} >= {"order_id", "channel", "amount_minor"}
    writers = avro.resolve(spec, url, encode.ids.values(), auth)
    assert sorted(writers) == sorted(encode.ids.values())
    assert all(w.reason is None for w in writers.values())
    row = avro.IndependentDecode(spec, url, auth)(value)
    assert isinstance(row, dict) and row["order_id"] == "o1" and row["channel"] == "web"
    decoded = RecordDecoder(spec, url, auth)
    assert decoded.decode is not None and decoded.decode(value) == row
    assert registry_module.external_status(s).ready


def test_without_or_with_wrong_credentials_the_error_names_the_settings(guarded: Guarded) -> None:
    """No credentials, or a wrong token: one line naming both settings, without the secret;
    ``stack status`` says the registry refuses the credentials."""
    for env in ({}, {"BACKFILL_SCHEMA_REGISTRY_TOKEN": "wrong-" + guarded.secret}):
        s = Settings.from_env({**env, "BACKFILL_SCHEMA_REGISTRY_URL": guarded.proxy_url})
        with pytest.raises(SettingsError) as caught:
            registry_columns.read_columns(
                "avro", "any-value", s.schema_registry_url, None, s.schema_registry_auth
            )
        message = str(caught.value)
        assert message.startswith(
            "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH/BACKFILL_SCHEMA_REGISTRY_TOKEN: the schema "
            f"registry at {guarded.proxy_url} refused the request (HTTP 401)"
        )
        assert guarded.secret not in message and "\n" not in message
        status = registry_module.external_status(s)
        assert status.refused and not status.ready
        assert "refusing the credentials" in status.describe()


def test_registry_credentials_are_masked_and_validated() -> None:
    """Both settings are secrets in the listing; both at once, or a user without a password,
    is an error naming the setting."""
    env = {"BACKFILL_SCHEMA_REGISTRY_TOKEN": "tok-" + "x" * 12}
    shown = {r.variable: r for r in listing(env)}
    assert shown["BACKFILL_SCHEMA_REGISTRY_TOKEN"].value == "***"
    assert shown["BACKFILL_SCHEMA_REGISTRY_TOKEN"].secret
    basic_env = {"BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH": "u:pw12"}
    basic_shown = {r.variable: r for r in listing(basic_env)}
    assert basic_shown["BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH"].value == "***"
    assert basic_shown["BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH"].secret
    with pytest.raises(SettingsError, match="both set"):
        Settings.from_env({**env, "BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH": "u:p"})
    with pytest.raises(SettingsError, match="BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH must be USER"):
        Settings.from_env({"BACKFILL_SCHEMA_REGISTRY_BASIC_AUTH": "just-a-user"})
    assert "tok-" not in repr(Settings.from_env(env))
