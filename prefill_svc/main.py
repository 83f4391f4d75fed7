"""``pdserve prefill``: run one prefill instance."""

from __future__ import annotations

import argparse

from common.service import EngineService, service_main


def _build(args: argparse.Namespace) -> EngineService:
    from prefill_svc.service import PrefillService

    return PrefillService(args)


def main(argv: list[str] | None = None) -> int:
    return service_main("prefill", _build, argv)
