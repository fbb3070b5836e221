"""Tenants of a shared fleet: their tokens, and how their names are kept apart.

Why stateless tokens: several training runs ("tenants") share one fleet of replicas (and later one
router). A tenant's token is `<tenant>.<hex HMAC-SHA256(key, tenant)>`, so any fleet process that
holds the fleet's tenant key can check it without a table to keep in sync, and a token names its
tenant by itself. Forging one needs the key.

Why namespacing, not checks: everything a tenant names (session ids, adapter versions, the
`cache_salt` that scopes prefix sharing) is mapped to `<tenant>~<name>` at the point of entry.
`~` is in neither a client's session id (`http.SESSION_ID`), an adapter name nor a tenant name, so
no name of one tenant can ever equal a name of another, and whatever a tenant addresses is looked
up in its own namespace only: another tenant's sessions, traces, versions and cached prefixes
are not refused, they are simply not there. Names without `~` belong to the fleet (the admin's).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

from burstrl.protocol.http import SESSION_ID

TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")  # used with fullmatch
SEP = "~"


def scoped_pattern(pattern: re.Pattern[str]) -> re.Pattern[str]:
    """`pattern` (of a client's name), optionally in a tenant's namespace: what a stored key may be."""
    return re.compile(rf"(?:{TENANT_NAME.pattern}{SEP})?(?:{pattern.pattern})")


SCOPED_SESSION_ID = scoped_pattern(SESSION_ID)  # a session's key (fullmatch)


class TenantError(ValueError):
    """A tenant name or key that cannot be used."""


def check_name(name: str) -> str:
    """`name` if it is a valid tenant name, else a TenantError saying what a name must be."""
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise TenantError(f"tenant name {name!r} must be 1-32 characters of [a-z0-9-], "
                          "starting with a letter or digit")
    return name


def _mac(key: str, name: str) -> str:
    return hmac.new(key.encode(), name.encode(), hashlib.sha256).hexdigest()


def tenant_token(key: str, name: str) -> str:
    """The bearer token of tenant `name` under the fleet's tenant `key`."""
    if not key:
        raise TenantError("the tenant key is empty")
    return f"{check_name(name)}.{_mac(key, name)}"


def tenant_of(headers: Mapping[str, str], key: str) -> str | None:
    """The tenant whose valid token is the `Authorization: Bearer` of `headers`, else None.

    None for no key, no bearer, a malformed token, an unknown name or a wrong MAC; the MAC is
    compared in constant time, so a probe learns nothing from how long a refusal took.
    """
    if not key:
        return None
    scheme, _, given = headers.get("authorization", "").partition(" ")
    name, dot, mac = given.partition(".")
    if scheme.lower() != "bearer" or not dot or not TENANT_NAME.fullmatch(name):
        return None
    return name if hmac.compare_digest(mac.encode(), _mac(key, name).encode()) else None


def scoped(tenant: str | None, name: str) -> str:
    """`name` in `tenant`'s namespace; the fleet's own name (tenant None) is left as it is."""
    return name if tenant is None else f"{tenant}{SEP}{name}"


def local(name: str) -> str:
    """The name as its tenant knows it (`a~policy-v3` -> `policy-v3`); a fleet name unchanged."""
    return name.partition(SEP)[2] if SEP in name else name


def owner(name: str) -> str | None:
    """The tenant whose namespace `name` is in; None for a fleet name."""
    return name.partition(SEP)[0] if SEP in name else None


def scoped_salt(tenant: str | None, salt: str | None) -> str | None:
    """The `cache_salt` the engine sees: never None for a tenant, so its prefixes are shared only
    with its own requests of the same client salt, never with another tenant's or the fleet's."""
    return salt if tenant is None else f"{tenant}{SEP}{salt or ''}"
