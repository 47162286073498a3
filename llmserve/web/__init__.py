"""The web pages (docs/web.md), one folder for the server's and the router's: `page.html` with the server's or the
router's dashboard in it (`dash_<mode>.html`), and the files both load from /static/ (`static/`)."""

from __future__ import annotations

import os

WEB_DIR = os.path.dirname(os.path.abspath(__file__))
STATIC_DIR = os.path.join(WEB_DIR, "static")
PAGES = {
    "server": ("llmserve", ""),
    "router": ("llmserve router", '<script src="/static/router.js"></script>\n'),
}


def page(mode: str) -> str | None:
    """The page of `mode` ("server" or "router"): its title, dashboard and scripts; None where its files are missing."""
    title, scripts = PAGES[mode]
    try:
        with open(os.path.join(WEB_DIR, "page.html"), encoding="utf-8") as f:
            html = f.read()
        with open(os.path.join(WEB_DIR, f"dash_{mode}.html"), encoding="utf-8") as f:
            dashboard = f.read()
    except OSError:
        return None
    return (
        html.replace("{{title}}", title)
        .replace("{{mode}}", mode)
        .replace("{{dashboard}}", dashboard)
        .replace("{{scripts}}", scripts)
    )


def mount_static(app) -> None:
    """/static/: the pages' scripts and style (a router or an app)."""
    if os.path.isdir(STATIC_DIR):
        from fastapi.staticfiles import StaticFiles

        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
