"""moto in server mode as a real S3 endpoint on 127.0.0.1 for tests, with a way to take it
down and bring it back on the same port (its buckets and objects live in moto's in-process
backend, so they survive the restart)."""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class S3Server:
    port: int = field(default_factory=_free_port)
    _server: ThreadedMotoServer | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> S3Server:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def stop(self) -> None:
        """Take S3 down: the port refuses connections until `start()`."""
        if self._server is not None:
            self._server.stop()
            inner = self._server._server  # ThreadedMotoServer.stop() leaves the socket bound
            if inner is not None:
                inner.server_close()
            self._server = None

    def reset(self) -> None:
        """Forget every bucket and object (moto keeps them process-wide, across restarts)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=5) as resp:
            resp.read()

    def client(self, **kwargs: Any) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            **kwargs,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)
