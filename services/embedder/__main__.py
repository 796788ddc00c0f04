"""Run the embedder role: `python -m services.embedder --config C --run-dir D` (port: embedder.port)."""

from __future__ import annotations

import logging

from opsd.service import RoleProcess
from services.embedder.app import ROLE, Encoder, build_app


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg.embedder
    encoder = Encoder(cfg.encoder)
    proc.status.update(encoder=cfg.encoder, dim=encoder.dim)
    port = proc.serve(build_app(cfg, encoder), cfg.port)
    logging.getLogger(ROLE).info("serving on port %d (encoder %s, dim %d)", port, cfg.encoder, encoder.dim)
    while not proc.stop.wait(1.0):
        pass


if __name__ == "__main__":
    main()
