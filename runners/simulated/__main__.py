"""Command line of the simulated engine: `python -m runners.simulated --port P --config-json J`.

The process entry point: installs vLLM-style log formatting on stdout and runs the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from runners.base import EngineConfig
from runners.credentials import API_KEY_ENV
from runners.hardware import HardwareProfile, load_preset
from runners.simulated.faults import Faults
from runners.simulated.server import serve
from runners.simulated.settings import ServerSettings

EXAMPLE = """example:
  python -m runners.simulated --port 8123 --startup-time-scale 0.001 \\
      --config-json '{"model": "qwen2.5-7b", "flags": {"max_num_seqs": 64}}'
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runners.simulated", epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A simulated vLLM server on 127.0.0.1 whose latencies follow a roofline "
                    "model of the config and hardware. Not a measurement.")
    # Loopback only: the simulated engine is a test double, never a service on the network.
    parser.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config-json", required=True,
                        help='{"model": ..., "flags": {...}, "served_model_name": ..., '
                             '"env_names": [...], "load_format": ...}: the variables named '
                             "in env_names are read from the environment (a secret never "
                             "travels in argv); VLLM_API_KEY, when set, is the key every "
                             "route but /health asks for, as vLLM's")
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="enables /start_profile and /stop_profile, as vLLM's profiler "
                             "config does")
    hardware = parser.add_mutually_exclusive_group()
    hardware.add_argument("--hardware", default="h200", help="hardware preset name")
    hardware.add_argument("--hardware-json", default=None,
                          help="a full HardwareProfile as JSON (HardwareProfile.to_dict)")
    parser.add_argument("--startup-time-scale", type=float, default=0.01,
                        help="slept seconds per modelled start-up second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-sigma", type=float, default=0.025,
                        help="lognormal sigma of the step-time noise")
    parser.add_argument("--vllm-variant-json", default=None,
                        help='the vLLM release to pretend to be, e.g. {"version": "0.27.0", '
                             '"renamed": {"old-flag": "new-flag"}, "dropped": [...]}: its '
                             "parser refuses the flags it renamed or dropped")
    parser.add_argument("--faults", default=None,
                        help='JSON object, e.g. {"crash_after_requests": 3}; overrides sim_ flags')
    return parser


def _engine_config(text: str) -> EngineConfig:
    data = json.loads(text)
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"--config-json must be an object with a model but got {text!r}.")
    # The launch's variables by name only: their values (a token among them) are in this
    # process's environment, where no other user can read them.
    names = data.get("env_names") or []
    return EngineConfig(
        model=str(data["model"]),
        flags=dict(data.get("flags") or {}),
        env={str(k): os.environ[str(k)] for k in names if str(k) in os.environ},
        load_format=str(data.get("load_format") or "auto"),
        served_model_name=str(data.get("served_model_name") or "model"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # vLLM's line shape, so log parsers written for vLLM read ours unchanged.
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    try:
        config = _engine_config(args.config_json)
        refused: list[str] = []
        version: str | None = None
        if args.vllm_variant_json:  # imported only here: the plain start stays as quick
            from runners.simulated.launcher import VllmVariant

            variant = VllmVariant.from_dict(json.loads(args.vllm_variant_json))
            refused = variant.refused(config.flags)
            version = variant.version
            config = EngineConfig(model=config.model,
                                  flags=variant.as_baseline_flags(config.flags),
                                  env=config.env, load_format=config.load_format,
                                  served_model_name=config.served_model_name)
        hardware = (HardwareProfile.from_dict(json.loads(args.hardware_json))
                    if args.hardware_json else load_preset(args.hardware))
        faults = Faults.from_flags(config.flags, args.faults)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if refused:
        # As vLLM's argparse does for a flag its version no longer has: usage error, exit 2.
        print(f"vllm serve: error: unrecognized arguments: {' '.join(refused)}",
              file=sys.stderr)
        return 2
    if args.startup_time_scale < 0:
        print("error: --startup-time-scale must be >= 0.", file=sys.stderr)
        return 2
    settings = ServerSettings(config=config, hardware=hardware, port=args.port, host=args.host,
                              profile_dir=args.profile_dir,
                              startup_time_scale=args.startup_time_scale, seed=args.seed,
                              faults=faults, noise_sigma=args.noise_sigma,
                              api_key=os.environ.get(API_KEY_ENV) or None,
                              vllm_version=version)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
