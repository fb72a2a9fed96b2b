"""What the server benchmarks share: start `captionkit serve` on 127.0.0.1, post multipart
requests to it, read its memory from /proc. Loopback only."""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]


def add_client_args(ap) -> None:
    """The options every server benchmark takes: how many clients, which photos, what beam, and
    extra arguments for the server."""
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--photos", default=str(ROOT / "samples"), help="folder of JPEG or PNG photos")
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--server-args", default="", help="extra arguments for captionkit serve")


def photo_files(folder: str | Path) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))


def multipart(fields: dict, files: dict) -> tuple[bytes, str]:
    b = uuid.uuid4().hex
    out = io.BytesIO()
    for k, v in fields.items():
        out.write(f"--{b}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n".encode())
    for k, (name, data, ctype) in files.items():
        out.write(f"--{b}\r\nContent-Disposition: form-data; name=\"{k}\"; filename=\"{name}\"\r\n"
                  f"Content-Type: {ctype}\r\n\r\n".encode())
        out.write(data)
        out.write(b"\r\n")
    out.write(f"--{b}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={b}"


def post(port: int, body: bytes, ctype: str, timeout: float = 120,
         headers: dict | None = None) -> tuple[int, dict | None, float]:
    """(status, JSON answer or None, seconds); status 0 when the connection failed."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/caption", body=body, headers={"Content-Type": ctype, **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        return r.status, doc, time.perf_counter() - t0
    except OSError as e:
        return 0, {"error": f"connection failed: {e}"}, time.perf_counter() - t0
    finally:
        conn.close()


def get_json(port: int, path: str, headers: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values)) - 1))]


class Server:
    """`captionkit serve` on 127.0.0.1 and a free port, in a child process; a context manager."""

    def __init__(self, args: list[str] | tuple = (), env: dict | None = None, log: str | Path | None = None):
        self.args, self.env = list(args), {**os.environ, **(env or {})}
        self.own_log = log is None  # a temporary log, removed on exit
        self.log_path = Path(log) if log else Path(tempfile.mkstemp(prefix="captionkit-serve-", suffix=".log")[1])
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "captionkit", "serve", "--host", "127.0.0.1",
                                          "--port", "0", *self.args], stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env)
        deadline = time.time() + 600
        while not self.port:
            m = re.search(r"on http://127\.0\.0\.1:(\d+)/", self.output())
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None or time.time() > deadline:
                text = self.output()
                self.__exit__()
                raise RuntimeError(f"the server did not start:\n{text[-3000:]}")
            else:
                time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.own_log:
            self.log_path.unlink(missing_ok=True)

    def memory(self, field: str = "VmHWM") -> int:
        """The server's resident memory in bytes (VmHWM: its peak so far, VmRSS: now)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")
