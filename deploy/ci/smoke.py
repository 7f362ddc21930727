"""End-to-end smoke test of a running Berth stack, through the gateway only.

    python deploy/ci/smoke.py --base-url http://127.0.0.1:8080 --api-key sk-berth-...

Waits for /readyz, creates an environment, attaches two sessions to it by
reference, writes and lists a file (the first environment operation, so it
creates the sandbox on the stack's backend), then deletes the sessions and
the environment. Prints one line per step and exits non-zero at the first
failure, naming the step.
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from typing import Any

import httpx

BETA = {"OpenAI-Beta": "agents=v1"}


class SmokeFailure(Exception):
    pass


def _expect(response: httpx.Response, *statuses: int) -> Any:
    if response.status_code not in statuses:
        raise SmokeFailure(f"{response.request.method} {response.request.url.path} -> {response.status_code}: {response.text[:500]}")
    return response.json() if response.content else None


def wait_healthy(client: httpx.Client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            response = client.get("/readyz")
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise SmokeFailure(f"gateway not ready after {timeout_s}s: {last}")


def run(base_url: str, api_key: str, health_timeout_s: float, request_timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}", **BETA}
    with httpx.Client(base_url=base_url, headers=headers, timeout=request_timeout_s) as client:
        step("readyz")
        wait_healthy(client, health_timeout_s)

        step("create environment")
        env = _expect(client.post("/v1/agents/environments", json={"environment": {"type": "openai_hosted"}}), 201)
        env_id = env["id"]

        sessions = []
        for n in (1, 2):
            step(f"create session {n} referencing {env_id}")
            body = {"agent": {"model": "scripted"}, "environment": {"type": "reference", "environment_id": env_id}}
            sessions.append(_expect(client.post("/v1/agents/sessions", json=body), 200, 201)["id"])

        step("write a file (creates the sandbox)")
        content = b"hello from the smoke test\n"
        file_body = {"type": "inline", "path": "/workspace/smoke/hello.txt", "data": base64.b64encode(content).decode()}
        _expect(client.post(f"/v1/agents/environments/{env_id}/files", json=file_body), 200, 201)

        step("list files")
        listed = _expect(client.get(f"/v1/agents/environments/{env_id}/files"), 200)
        paths = [str(item.get("path", "")) for item in listed.get("data", [])]
        if not any(p.endswith("smoke/hello.txt") for p in paths):
            raise SmokeFailure(f"written file not listed: {paths}")

        step("environment in use while sessions are attached")
        _expect(client.delete(f"/v1/agents/environments/{env_id}"), 409)

        for session_id in sessions:
            step(f"delete session {session_id}")
            _expect(client.delete(f"/v1/agents/sessions/{session_id}"), 200)

        step("delete environment")
        deleted = _expect(client.delete(f"/v1/agents/environments/{env_id}"), 200)
        if not deleted.get("deleted"):
            raise SmokeFailure(f"environment not deleted: {deleted}")


def step(name: str) -> None:
    print(f"smoke: {name}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--health-timeout", type=float, default=90.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        run(args.base_url.rstrip("/"), args.api_key, args.health_timeout, args.request_timeout)
    except (SmokeFailure, httpx.HTTPError) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print("smoke: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
