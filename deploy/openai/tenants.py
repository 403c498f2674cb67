"""Tenants: who a request is, by the API key it carries, and what each may hold.

`--api-key-file` holds one key per line; blank lines and lines starting with `#` are skipped:

    KEY                                           the tenant `default`
    NAME KEY [weight=W] [max_concurrency=N] [max_queued=N]

A file of one bare key (what every earlier release read) is one tenant, `default`. NAME is
1-64 of `A-Z a-z 0-9 _ . @ -` (it labels metrics); KEY is any run of printable non-space
ASCII. `weight` (default 1, any positive number) is the tenant's share of the cluster
relative to the others; `max_concurrency` caps its requests admitted at once (default none);
`max_queued` caps its requests waiting for admission (default `--max-queued-requests-per-tenant`).
`--api-key` and `SHOAL_API_KEY` give one key, tenant `default`. Without any key every request
is tenant `default`. Keys are matched by their SHA-256 digest, so a lookup's time does not
depend on how much of a wrong key matches a right one; no key is ever logged. `read_key`
reads a single key (the tenant `default`'s or the admin key) from its file, flag or
environment variable.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
_KEY = re.compile(r"[\x21-\x7e]+")
_OPTIONS = ("weight", "max_concurrency", "max_queued")


@dataclass(frozen=True)
class Tenant:
    """One tenant's name and limits (None: the front end's default)."""

    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    max_queued: int | None = None


@dataclass(frozen=True)
class TenantTable:
    """Every tenant of a front end, and the digest of each one's key."""

    tenants: tuple[Tenant, ...] = (Tenant(DEFAULT_TENANT),)
    _by_digest: dict[bytes, Tenant] = field(default_factory=dict, repr=False, compare=False)
    # The key when the table holds exactly one (the resize endpoints' default key).
    only_key: str | None = field(default=None, repr=False)

    @classmethod
    def open(cls) -> TenantTable:
        """No keys: every request is tenant `default`."""
        return cls()

    @classmethod
    def single(cls, key: str | None) -> TenantTable:
        """One key (`--api-key`, `SHOAL_API_KEY`) for tenant `default`; none: open."""
        if not key:
            return cls.open()
        tenant = Tenant(DEFAULT_TENANT)
        return cls((tenant,), {_digest(key): tenant}, key)

    @classmethod
    def parse(cls, text: str, source: str) -> TenantTable:
        """The tenants of a key file's `text` (`source` names it in errors).

        Raises:
            ValueError: no key, a malformed line, a name or key given twice.
        """
        tenants: list[Tenant] = []
        keys: list[str] = []
        by_digest: dict[bytes, Tenant] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            tenant, key = _parse_line(words, f"{source} line {number}")
            if any(t.name == tenant.name for t in tenants):
                raise ValueError(
                    f"{source} line {number}: tenant {tenant.name!r} has a key already"
                    + (" (a bare KEY line is tenant default)" if len(words) == 1 else "")
                )
            digest = _digest(key)
            if digest in by_digest:
                raise ValueError(f"{source} line {number}: this key is given twice")
            tenants.append(tenant)
            keys.append(key)
            by_digest[digest] = tenant
        if not tenants:
            raise ValueError(f"{source} holds no key")
        return cls(tuple(tenants), by_digest, keys[0] if len(keys) == 1 else None)

    @property
    def has_keys(self) -> bool:
        return bool(self._by_digest)

    def lookup(self, authorization: bytes) -> Tenant | None:
        """The tenant whose key an `Authorization: Bearer KEY` header carries; None for a
        missing or wrong key. Without keys, every request is tenant `default`."""
        if not self._by_digest:
            return self.tenants[0]
        prefix = b"Bearer "
        if not authorization.startswith(prefix):
            return None
        return self._by_digest.get(hashlib.sha256(authorization[len(prefix) :]).digest())


def load_tenants(path: str) -> TenantTable:
    """The tenants of `--api-key-file PATH`.

    Raises:
        ValueError: the file cannot be read, or does not parse (`TenantTable.parse`).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read --api-key-file {path}: {e.strerror}") from e
    if not text.strip():
        raise ValueError(f"--api-key-file {path} is empty")
    return TenantTable.parse(text, f"--api-key-file {path}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_line(words: list[str], where: str) -> tuple[Tenant, str]:
    if len(words) == 1:
        name, key, options = DEFAULT_TENANT, words[0], []
    else:
        name, key, options = words[0], words[1], words[2:]
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: a tenant name is 1-64 of A-Z a-z 0-9 _ . @ -")
    if not _KEY.fullmatch(key):
        raise ValueError(f"{where}: a key is printable ASCII without spaces")
    values: dict[str, float | int] = {}
    for option in options:
        name_, _, value = option.partition("=")
        if name_ not in _OPTIONS or not value or name_ in values:
            raise ValueError(
                f"{where}: unknown or repeated option {name_!r} (options: "
                f"{', '.join(o + '=' for o in _OPTIONS)})"
            )
        values[name_] = _option_value(name_, value, where)
    return Tenant(name, **values), key  # type: ignore[arg-type]


def _option_value(name: str, value: str, where: str) -> float | int:
    try:
        number: float | int = float(value) if name == "weight" else int(value)
    except ValueError:
        raise ValueError(f"{where}: {name}={value} is not a number") from None
    lowest = 0 if name == "max_queued" else 1
    if name == "weight" and not 0 < number < float("inf"):
        raise ValueError(f"{where}: weight must be a positive number, not {value}")
    if name != "weight" and number < lowest:
        raise ValueError(f"{where}: {name} must be at least {lowest}, not {value}")
    return number


def read_key(path: str | None, given: str | None, flag: str, env: str) -> str | None:
    """A key from its file, its flag (with a warning), or its environment variable.

    Raises:
        ValueError: the file cannot be read, or is empty.
    """
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read {flag}-file {path}: {e.strerror}") from e
        if not key:
            raise ValueError(f"{flag}-file {path} is empty")
        return key
    if given:
        logger.warning(
            "%s on the command line is visible to anyone who can list processes or read the "
            "job's entrypoint; use %s-file",
            flag,
            flag,
        )
        return given
    return os.environ.get(env) or None
