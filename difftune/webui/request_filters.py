"""What the UI's server refuses before Gradio sees a request: hosts and origins it does not serve, linked files, and
uploads over the cap.

Hosts: the UI answers only requests addressed to it, a guard against DNS rebinding as Jupyter's and TensorBoard's
servers have one.

A page on another site can make a browser send requests to 127.0.0.1 under that site's own name (its DNS record
switched to 127.0.0.1), with its own `Host` and `Origin`; Gradio's CORS middleware then echoed that origin, so the
page could drive the UI (launch jobs, read files). Every HTTP request and websocket must name, in `Host` and in
`Origin` where it has one, a host the UI serves: the address it binds, this machine's loopback names, and the public
names given (`--public-name`: a reverse proxy's, or a share link's). A host given as an IP address is always one
(rebinding needs a name). Anything else gets 403.

Uploads: Gradio's `max_file_size` caps each file, so three 0.9 MB files in one request passed a 1 MB cap; the whole
upload request is capped here (`UploadLimit`), by its declared length.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SHARE_LINK_SUFFIX = ".gradio.live"  # where Gradio's share links are served from
FILE_ROUTE = "/file="  # Gradio's file route, under its API prefix (`/gradio_api/file=`) or bare


def host_name(value: str) -> str:
    """`Host` header or origin -> its host name, lower case, without port or brackets ("" when unreadable)."""
    value = value.strip()
    try:
        return (urlsplit(value if "//" in value else f"//{value}").hostname or "").lower()
    except ValueError:
        return ""


class AllowedHosts:
    """ASGI middleware: requests whose `Host` (and `Origin`, if sent) name no served host are refused."""

    def __init__(self, app, names: tuple[str, ...] = (), share: bool = False):
        self.app, self.share = app, share
        self.names = {name.lower().strip("[]") for name in (*LOOPBACK_NAMES, *names)}

    def allows(self, name: str) -> bool:
        if not name:
            return False
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return name in self.names or (self.share and name.endswith(SHARE_LINK_SUFFIX))

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
            origin = headers.get("origin")
            if not self.allows(host_name(headers.get("host", ""))) or (
                origin is not None and not self.own_origin(origin, headers.get("host", ""))
            ):
                await _refuse(scope, send)
                return
        await self.app(scope, receive, send)

    def own_origin(self, origin: str, host: str) -> bool:
        """The UI's own pages' origin: the host and port the request is addressed to (a page on another local port,
        `http://localhost:9999`, had its origin echoed by Gradio's CORS layer), or a public name given (a reverse
        proxy's, which may address the UI by another port)."""
        try:
            netloc = urlsplit(origin.strip()).netloc.lower()
        except ValueError:
            return False
        name = host_name(origin)
        public = name in self.names - set(LOOPBACK_NAMES) or (self.share and name.endswith(SHARE_LINK_SUFFIX))
        return self.allows(name) and (netloc == host.strip().lower() or public)


async def _refuse(scope, send) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await _respond(send, 403, "difftune ui: this host is not served here (see `difftune ui --public-name`)")


async def _respond(send, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class OwnFilesOnly:
    """ASGI middleware: Gradio's file route (`/gradio_api/file=<path>`) serves a file only where it is the file's one
    name: never a symbolic link, nor a hard link to a file elsewhere (a train.log hard-linked to another user's file
    inside the jobs folder was served, though the page no longer shows it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and FILE_ROUTE in scope["path"]:
            asked = scope["path"].split(FILE_ROUTE, 1)[1]
            try:
                found = os.lstat(asked)
            except (OSError, ValueError):
                found = None  # Gradio's own answer (404) for what is not there
            if found is not None and (
                stat.S_ISLNK(found.st_mode) or (stat.S_ISREG(found.st_mode) and found.st_nlink > 1)
            ):
                await _respond(send, 403, "difftune ui: a linked file, not one of the jobs folder's own; not served")
                return
        await self.app(scope, receive, send)


class UploadLimit:
    """ASGI middleware: an upload request (a path ending `/upload`) must declare its length, at most `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/").endswith("/upload"):
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await _respond(send, 413, f"difftune ui: uploads are capped at {self.max_bytes:,} bytes a request")
                return
        await self.app(scope, receive, send)
