"""Run the embedder role: `python -m services.embedder --config C --run-dir D` (port: embedder.port).

Needs OPSD_API_TOKEN (set by `opsd run`): without it the embedder refuses to start.
"""

from __future__ import annotations

import logging

from opsd.auth import api_token
from opsd.service import RoleProcess, fatal
from services.embedder.app import ROLE, Encoder, build_app


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg.embedder
    try:
        token = api_token()
    except RuntimeError as e:  # before loading the encoder: fail in a second, with the reason
        fatal(ROLE, str(e))
    encoder = Encoder(cfg.encoder)
    proc.status.update(encoder=cfg.encoder, dim=encoder.dim)
    port = proc.serve(build_app(cfg, encoder, token), cfg.port)
    logging.getLogger(ROLE).info("serving on port %d (encoder %s, dim %d)", port, cfg.encoder, encoder.dim)
    while not proc.stop.wait(1.0):
        pass


if __name__ == "__main__":
    main()
