"""Run the embedder role: `python -m services.embedder --config C --run-dir D` (port: embedder.port).

With env.name "search" it also serves /retrieve over env.search.corpus (the
shipped corpus when unset), indexed in the background at start.

Needs OPSD_API_TOKEN (set by `opsd run`): without it the embedder refuses to start.
"""

from __future__ import annotations

import logging
from functools import partial

from opsd.auth import api_token
from opsd.service import RoleProcess, fatal
from opsd.encoder import Encoder
from opsd.retrieval import LazyCorpusIndex, corpus_for_config
from services.embedder.app import ROLE, build_app


def main() -> None:
    proc = RoleProcess.from_argv(ROLE, __doc__)
    cfg = proc.cfg.embedder
    try:
        token = api_token()
    except RuntimeError as e:  # before loading the encoder: fail in a second, with the reason
        fatal(ROLE, str(e))
    proc.unready = "loading the encoder"
    try:
        encoder = Encoder(cfg.encoder, cfg.device, cfg.trust_remote_code)
    except (RuntimeError, ValueError) as e:  # device: cuda without a GPU; a directory needing its own code
        fatal(ROLE, str(e))
    proc.status.update(encoder=cfg.encoder, dim=encoder.dim)
    corpus = corpus_for_config(proc.cfg)
    retrieval = LazyCorpusIndex(corpus, encoder, cfg.encoder, proc.cfg.cache_root) if corpus else None
    if retrieval is not None:
        retrieval.build_in_background()  # a failure is kept and answered as 503 with its reason
    # Each request's encoding runs under a liveness guard (opsd.probes): an encoder that hangs fails /livez.
    guard = partial(proc.liveness.guard, "encoding a request", proc.cfg.probes.generate_s)
    port = proc.serve(build_app(cfg, encoder, token, retrieval, guard), cfg.port)
    proc.unready = "encoding a probe text"
    with guard():
        encoder.embed(["ping"])
    proc.unready = None  # ready (/readyz): the encoder is loaded and answered
    logging.getLogger(ROLE).info("serving on port %d (encoder %s, dim %d)", port, cfg.encoder, encoder.dim)
    while not proc.stop.wait(1.0):
        proc.liveness.beat()


if __name__ == "__main__":
    main()
