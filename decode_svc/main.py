"""``pdserve decode``: run one decode instance."""

from __future__ import annotations

import argparse

from common.service import add_service_args, configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_service_args(parser, "decode")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    from decode_svc.service import DecodeService

    DecodeService(args).run()
    return 0
