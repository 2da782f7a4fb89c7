"""`threefold simulate` (registered on the main CLI by `add_parser`)."""

from __future__ import annotations

import argparse


def _simulate(ns: argparse.Namespace) -> int:
    from threefold.sim.sweep import run_simulate

    run_simulate(ns)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from threefold.sim.sweep import add_simulate_args

    sim = subparsers.add_parser("simulate", help="discrete-event simulation of N replicas behind the router")
    add_simulate_args(sim)
    sim.set_defaults(func=_simulate)
    return sim
