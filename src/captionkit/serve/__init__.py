"""``captionkit serve``: an HTTP API and a web page over one or more captioners.

Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart); the rest of the library never
imports this package. ``serve.net`` (the listening socket) imports neither torch nor FastAPI, so
the command line checks --host and --port first; the app is imported when first used.
"""

__all__ = ["ServeConfig", "create_app", "load_models"]


def __getattr__(name: str):
    if name in __all__:
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
