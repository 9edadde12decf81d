"""Entry point of the playground, locally (`python app.py`) and on Hugging Face Spaces."""

import logging
import os
import sys

from bert_engine import settings
from bert_engine.runtime.precision import PrecisionError
from bert_engine.serving import memory

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def server_port() -> int:
    """GRADIO_SERVER_PORT (default 7860), checked before Gradio is imported: Gradio reads it at its import and
    a bad value was a 30-line traceback there.

    Raises:
        ValueError: not a port number, naming the variable and its value."""
    raw = os.environ.get("GRADIO_SERVER_PORT", "").strip() or "7860"
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ValueError(f"GRADIO_SERVER_PORT must be a port number from 1 to 65535, got {raw!r}")
    return int(raw)


if __name__ == "__main__":
    try:
        settings.check_all()  # a bad BERT_ENGINE_* value: one line and exit 2, not every request failing later
        port = server_port()
    except ValueError as err:
        logging.getLogger("app").error("%s", err)
        sys.exit(2)
    try:
        from playground import build_app
        from playground.app import serve_queue, warm_up
    except ModuleNotFoundError as err:  # `pip install bert-engine` leaves out the playground's packages
        logging.getLogger("app").error("the playground needs %s, which is not installed: pip install "
                                       "'bert-engine[playground]' (or -r requirements.txt)", err.name)
        sys.exit(2)
    if settings.get("BERT_ENGINE_TUNE_MALLOC"):
        memory.tune_allocator()  # before any thread: a bounded number of arenas, tensors over 1 MB mmapped
    try:
        app = build_app(device=settings.get("BERT_ENGINE_DEVICE") or None,
                        precision=settings.get("BERT_ENGINE_PRECISION"),
                        timeout_s=settings.get("BERT_ENGINE_TIMEOUT") or None)
    except PrecisionError as err:  # e.g. BERT_ENGINE_PRECISION=bf16 on a CPU without native bf16
        message = str(err)
        logging.getLogger("app").error("%s", message if message.startswith("BERT_ENGINE_") else
                                       f"BERT_ENGINE_PRECISION: {message}")
        sys.exit(2)
    warm_up(app.predictors)  # models load in the background while the server starts
    serve_queue(app)  # Gradio's queue admits what the fairness gate can order (BERT_ENGINE_CONCURRENCY, default 64)
    # every task is also an MCP tool (at /gradio_api/mcp/) unless BERT_ENGINE_MCP=0
    app.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
               server_port=port,
               mcp_server=settings.get("BERT_ENGINE_MCP"))
