"""``pdserve prefill``: run one prefill instance."""

from __future__ import annotations

import argparse

from common.service import add_service_args, configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_service_args(parser, "prefill")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    from prefill_svc.service import PrefillService

    PrefillService(args).run()
    return 0
