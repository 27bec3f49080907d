"""Plain HTTP helpers (stdlib) for requests the openai client would refuse to send."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from tests.server.conftest import API_KEY


def raw(url: str, path: str, body: bytes | dict[str, Any] | None = None, key: str | None = API_KEY,
        method: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped; histogram buckets skipped)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = raw(url, "/metrics")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "le" not in s.labels:
                out[s.name] = s.value
    return out


def assert_openai_error(status: int, body: Any, want: int) -> None:
    assert status == want, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and len(err["message"]) > 10, err


def call(url: str, path: str, body: bytes | dict[str, Any] | None = None, key: str | None = API_KEY,
         method: str | None = None, headers: dict[str, str] | None = None,
         conn: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], Any]:
    """One request on ``conn`` (a new connection if None): (status, lower-cased headers, body)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    if conn is None:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
    head = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    conn.request(method or ("POST" if data is not None else "GET"), path, body=data, headers=head)
    r = conn.getresponse()
    text = r.read().decode()
    try:
        parsed: Any = json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
