"""What Ray says when nightshift starts it: Ray 2.60's `ray.init` of a new cluster, with
RAY_AUTH_MODE unset, enables token authentication and logs "Token authentication is enabled for
this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...", which read on every `nightshift
start` like an action asked of the user. The daemon's Ray now takes the same mode without the
notice (`ray_cluster.settle_token_auth`); a mode the user set is theirs. Each in a process of
its own (Ray reads the variable when it is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTICE = "Token authentication is enabled for this Ray cluster"

# The daemon's own Ray, as `init_ray` starts it; what the driver, Ray's config and the raylet
# (whose environment Ray's workers and the trials' engines inherit) then hold.
_START = """
import json, os
import psutil, ray
from ray._raylet import AuthenticationMode, get_authentication_mode
from optimizer.run.ray_cluster import init_ray
init_ray(num_gpus=0)
raylet = [p for p in psutil.Process().children() if p.name() == "raylet"][0]
print(json.dumps({"env": os.environ.get("RAY_AUTH_MODE"),
                  "token": get_authentication_mode() == AuthenticationMode.TOKEN,
                  "raylet": raylet.environ().get("RAY_AUTH_MODE"),
                  "answers": ray.get(ray.remote(lambda: 1).remote(), timeout=60)}), flush=True)
ray.shutdown()
"""

# What the decision leaves without starting Ray: an explicit address (Ray never switches a join
# by address to tokens), and a mode the user set.
_DECIDE = """
import json, os, sys
from ray._raylet import AuthenticationMode, get_authentication_mode
from optimizer.run.ray_cluster import settle_token_auth
settle_token_auth(sys.argv[1] if sys.argv[1] != "-" else None)
print(json.dumps({"env": os.environ.get("RAY_AUTH_MODE"),
                  "disabled": get_authentication_mode() == AuthenticationMode.DISABLED}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


@pytest.mark.slow
def test_the_daemons_ray_starts_with_token_auth_and_without_rays_notice() -> None:
    done = subprocess.run([sys.executable, "-c", _START], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert NOTICE not in done.stderr + done.stdout, done.stderr[-3000:]
    out = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert out == {"env": "token", "token": True, "raylet": "token", "answers": 1}, \
        "token authentication, as Ray enables it for a new cluster, in the driver and the " \
        f"processes Ray starts, and the cluster answers a task: {out}"


@pytest.mark.parametrize(("given", "address", "expected"), [
    (None, "127.0.0.1:6379", None),  # a join by address: Ray's own choice, left to it
    ("disabled", "-", "disabled"),   # the user's value, kept for the daemon's own Ray
    ("token", "127.0.0.1:6379", "token"),
])
def test_a_join_by_address_and_a_mode_the_user_set_are_left_as_they_are(
        given: str | None, address: str, expected: str | None) -> None:
    env = _env(**({"RAY_AUTH_MODE": given} if given is not None else {}))
    done = subprocess.run([sys.executable, "-c", _DECIDE, address], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"env": expected, "disabled": expected != "token"}, out
