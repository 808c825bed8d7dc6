#!/usr/bin/env python3
"""Health check of a running llm-pool: GET /v1/models answers 200 with a model list.

Usage: llm-pool-healthcheck [--url URL] [--wait SECONDS]

The URL defaults to $LLM_POOL_URL, else http://127.0.0.1:8011; the token comes from
$LLM_POOL_ADMIN_TOKEN or the first of $LLM_POOL_API_TOKENS. With --wait, it retries
until the pool answers or the time is up (the unit's ExecStartPost). Exit 0 healthy,
1 not. Standard library only, so it runs with any Python 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def check(url: str, token: str | None) -> str | None:
    """None when healthy, else why not."""
    request = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = json.load(response)
    except (OSError, ValueError) as exc:
        return str(exc)
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return f"unexpected answer: {str(body)[:200]}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("LLM_POOL_URL") or "http://127.0.0.1:8011")
    parser.add_argument("--wait", type=float, default=0, help="retry for this many seconds")
    args = parser.parse_args()
    tokens = os.environ.get("LLM_POOL_API_TOKENS", "").split(",")
    token = os.environ.get("LLM_POOL_ADMIN_TOKEN") or tokens[0].strip() or None
    deadline = time.monotonic() + args.wait
    while True:
        problem = check(args.url, token)
        if problem is None:
            print(f"llm-pool at {args.url} is healthy")
            return 0
        if time.monotonic() >= deadline:
            print(f"llm-pool at {args.url} is not healthy: {problem}", file=sys.stderr)
            return 1
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
