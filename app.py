"""Entry point of the playground, locally (`python app.py`) and on Hugging Face Spaces."""

import errno
import logging
import os
import socket
import sys

from bert_engine import settings
from bert_engine.runtime.precision import PrecisionError, check_kernel_setting, pick_device, setting_precision
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


def check_listen(name: str, port: int) -> None:
    """That the server can listen on `name`:`port` (GRADIO_SERVER_NAME, GRADIO_SERVER_PORT), tried before the models
    start loading: Gradio's own failure was a traceback, then a native abort, and "Cannot find empty port" for an
    address that is not this machine's.

    Raises:
        ValueError: the address does not resolve, is not this machine's, or the port is taken, naming them."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"GRADIO_SERVER_NAME {name!r} is not an address or host name this machine can resolve "
                         f"({getattr(err, 'strerror', None) or err})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket (uvicorn)
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {name} is in use (GRADIO_SERVER_PORT): stop what listens there or "
                                 "set GRADIO_SERVER_PORT to another port") from None
            raise ValueError(f"cannot listen on {name}:{port} (GRADIO_SERVER_NAME, GRADIO_SERVER_PORT): "
                             f"{err.strerror or err}") from None


if __name__ == "__main__":
    try:
        settings.check_all()  # a bad BERT_ENGINE_* value: one line and exit 2, not every request failing later
        for folder in settings.get("BERT_ENGINE_MODEL_DIRS"):  # (one may appear later: a warning, not a refusal)
            if not os.path.isdir(folder):
                logging.getLogger("app").warning("BERT_ENGINE_MODEL_DIRS: %r is not a folder (yet); the model "
                                                 "picker lists nothing from it until it is", folder)
        pick_device()  # BERT_ENGINE_DEVICE names a device this machine has (cuda on a CPU build of torch: refused)
        setting_precision()  # before the playground is imported: a precision this machine cannot run is said first
        check_kernel_setting()  # a kernel that is not one, or "tiled" where bert_engine's kernel cannot run
        port = server_port()
    except ValueError as err:
        logging.getLogger("app").error("%s", err)
        sys.exit(2)
    try:
        import gradio  # noqa: F401 - the playground imports it only when it builds the UI: missing, say so here

        from playground import build_app
        from playground.app import serve_queue, warm_up
    except ModuleNotFoundError as err:  # `pip install bert-engine` leaves out the playground's packages
        logging.getLogger("app").error("the playground needs %s, which is not installed: pip install "
                                       "'bert-engine[playground]' (or -r requirements.txt)", (err.name or "?").partition(".")[0])
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
    server_name = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1").strip() or "127.0.0.1"
    try:
        check_listen(server_name, port)  # before the models start loading in their threads
    except ValueError as err:
        logging.getLogger("app").error("%s", err)
        sys.exit(2)
    warm_up(app.predictors)  # models load in the background while the server starts
    serve_queue(app)  # Gradio's queue admits what the fairness gate can order (BERT_ENGINE_CONCURRENCY, default 64)
    # every task is also an MCP tool (at /gradio_api/mcp/) unless BERT_ENGINE_MCP=0
    try:
        app.launch(server_name=server_name, server_port=port, mcp_server=settings.get("BERT_ENGINE_MCP"))
    except OSError as err:  # the port taken between check_listen and now
        logging.getLogger("app").error("cannot listen on %s:%s (GRADIO_SERVER_NAME, GRADIO_SERVER_PORT): %s",
                                       server_name, port, err)
        logging.shutdown()
        os._exit(2)  # the models' loading threads are still running: a normal exit aborted in native code
