"""Serves a corpus over Search-R1's ``POST /retrieve`` (``server.py`` says what the server guarantees)::

    python -m trace_jax.envs.retrieval serve --corpus corpus.jsonl --port 8000

The command is this package's ``__main__``, a module nothing imports, so ``python -m`` runs it fresh. It prints
``serving N passages on http://HOST:PORT`` (flushed) once the socket is bound: tests and launch scripts wait for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Sequence

from trace_jax.envs.retrieval.bm25 import BM25Retriever
from trace_jax.envs.retrieval.server import ServerLimits, make_server

PROG = "python -m trace_jax.envs.retrieval"


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(ServerLimits):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(field.default),
            default=field.default,
            help=f"ServerLimits.{field.name} (default %(default)s)",
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve BM25 retrieval over Search-R1's POST /retrieve")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", help="jsonl corpus (title/text or Search-R1 contents rows) or a saved index")
    source.add_argument("--index", help="directory written by BM25Retriever.save")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _add_limit_flags(serve)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
        retriever = BM25Retriever.from_path(args.corpus or args.index)
        server = make_server(retriever, args.host, args.port, limits)
    except (OSError, ValueError) as e:  # a missing or malformed corpus, a bad limit, a port in use
        serve.error(str(e))
    # The line tests and launch scripts wait for; flushed so a pipe sees it at once.
    print(f"serving {len(retriever.passages)} passages on http://{args.host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    # bm25s runs a JAX op when imported; a retrieval server never needs an accelerator, so keep JAX off it.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
