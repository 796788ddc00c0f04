"""Run the embedder role: `python -m services.embedder --config C --run-dir D [--port P]`."""

from __future__ import annotations

import argparse
import logging

from opsd.service import RoleProcess
from services.embedder.app import ROLE, Encoder, build_app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    proc = RoleProcess.start(ROLE, args.config, args.run_dir)
    cfg = proc.cfg.embedder
    encoder = Encoder(cfg.encoder)
    proc.status.update(encoder=cfg.encoder, dim=encoder.dim)
    port = proc.serve(build_app(cfg, encoder), args.port if args.port is not None else cfg.port)
    logging.getLogger(ROLE).info("serving on port %d (encoder %s, dim %d)", port, cfg.encoder, encoder.dim)
    while not proc.stop.wait(1.0):
        pass


if __name__ == "__main__":
    main()
