"""`--api-key-file` with tenants: the one-file format, old single-key files, lookups, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.deploy.openai.tenants import DEFAULT_TENANT, Tenant, TenantTable, load_tenants


def _bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_an_old_single_key_file_is_tenant_default(tmp_path: Path) -> None:
    path = tmp_path / "api.key"
    path.write_text("s3cret-key\n")
    table = load_tenants(str(path))
    assert table.tenants == (Tenant(DEFAULT_TENANT),)
    assert table.only_key == "s3cret-key"
    assert table.lookup(_bearer("s3cret-key")) == Tenant(DEFAULT_TENANT)
    assert table.lookup(_bearer("s3cret-kex")) is None
    assert table.lookup(b"s3cret-key") is None  # not a bearer header


def test_named_keys_with_weights_caps_and_comments() -> None:
    table = TenantTable.parse(
        "# tenants of prod\n"
        "\n"
        "search   key-search   weight=3 max_concurrency=64\n"
        "batch    key-batch    weight=0.5 max_queued=0\n"
        "key-anonymous\n",
        "test",
    )
    assert table.tenants == (
        Tenant("search", weight=3.0, max_concurrency=64),
        Tenant("batch", weight=0.5, max_queued=0),
        Tenant(DEFAULT_TENANT),
    )
    assert table.only_key is None
    assert table.lookup(_bearer("key-batch")) == Tenant("batch", weight=0.5, max_queued=0)
    assert table.lookup(_bearer("key-anonymous")) == Tenant(DEFAULT_TENANT)
    assert table.lookup(_bearer("search")) is None  # a name is not a key


def test_no_key_makes_every_request_tenant_default() -> None:
    for table in (TenantTable.open(), TenantTable.single(None), TenantTable.single("")):
        assert not table.has_keys
        assert table.lookup(b"") == Tenant(DEFAULT_TENANT)


def test_a_key_given_on_the_command_line_is_taken_whole() -> None:
    table = TenantTable.single("with a space")
    assert table.lookup(_bearer("with a space")) == Tenant(DEFAULT_TENANT)
    assert table.only_key == "with a space"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# only a comment\n", "holds no key"),
        ("a k1\na k2\n", "tenant 'a' has a key already"),
        ("k1\nk2\n", "a bare KEY line is tenant default"),
        ("a k1\nb k1\n", "this key is given twice"),
        ("a k1 weight=0\n", "weight must be a positive number"),
        ("a k1 weight=inf\n", "weight must be a positive number"),
        ("a k1 weight=x\n", "is not a number"),
        ("a k1 max_concurrency=0\n", "max_concurrency must be at least 1"),
        ("a k1 max_queued=-1\n", "max_queued must be at least 0"),
        ("a k1 color=red\n", "unknown or repeated option 'color'"),
        ("a k1 weight=1 weight=2\n", "unknown or repeated option 'weight'"),
        ("a/b k1\n", "a tenant name is"),
        ("a k\u00e9y\n", "a key is printable ASCII"),
    ],
)
def test_a_malformed_file_names_its_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantTable.parse(text, "--api-key-file f")


def test_an_unreadable_or_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_tenants(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_tenants(str(empty))
