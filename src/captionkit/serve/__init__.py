"""``captionkit serve``: an HTTP API and a web page over one or more captioners.

Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart); the rest of the library never
imports this package.
"""

from .app import ServeConfig, create_app, load_models

__all__ = ["ServeConfig", "create_app", "load_models"]
