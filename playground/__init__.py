"""The Gradio playground built from the task registry (see app.py)."""

from .app import build_app

__all__ = ["build_app"]
