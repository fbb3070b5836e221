"""One HTTP client for the tests' own requests, instead of `httpx.get(...)` and friends.

Each top-level `httpx.get/post/...` call builds a new `httpx.Client`, and with it a TLS context that
loads the CA bundle, even for a plain-http URL: 35-40 ms of CPU per call, 130-160 ms of wall time on
the loaded 2-core test machine, against 2-3 ms through one client. `HTTP` keeps what a top-level call
means: no keep-alive (every request opens and closes its own connection) and no cookie jar shared
between requests. Calls that pass `verify=`/`cert=` (the TLS tests) stay top-level.
"""

from __future__ import annotations

from http.cookiejar import DefaultCookiePolicy

import httpx

HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
HTTP.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # accepts no cookie
