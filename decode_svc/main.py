"""``pdserve decode``: run one decode instance."""

from __future__ import annotations

import argparse

from common.service import EngineService, service_main


def _build(args: argparse.Namespace) -> EngineService:
    from decode_svc.service import DecodeService

    return DecodeService(args)


def main(argv: list[str] | None = None) -> int:
    return service_main("decode", _build, argv)
