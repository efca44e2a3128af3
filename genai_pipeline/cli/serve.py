"""`genai serve DIR`: an OpenAI-compatible HTTP server over an export folder (genai_pipeline/serve/)."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

log = logging.getLogger("genai_pipeline")


def cmd_serve(args) -> int:
    from genai_pipeline.serve.app import listen, serve
    from genai_pipeline.serve.engine import Engine
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden_throughout

    engine = Engine(Path(args.folder), parallel=args.parallel, lookahead=args.lookahead, verify=not args.no_verify)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    where = (
        "to this machine only (loopback; --host 0.0.0.0 serves other machines too)"
        if ipaddress.ip_address(host).is_loopback
        else "to every machine that reaches this address: there is no authentication"
    )
    # Sessions run in threads at once for as long as the server lives: the runtime's C++ logs are
    # kept off fd 2 throughout, and ours (uvicorn's too) go to a copy of it.
    with native_logs_hidden_throughout() as messages:
        for handler in log.handlers:
            handler.setStream(messages)
        logging.getLogger("uvicorn").handlers = log.handlers
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        log.info(
            "serving %s from %s on %s with %d session(s), %s; Ctrl-C stops",
            engine.model.id,
            args.folder,
            url,
            len(engine.slots),
            where,
        )
        serve(engine, sock)
    log.info("stopped")
    return 0
