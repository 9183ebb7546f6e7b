"""A real Prometheus server for tests (Debian's `prometheus` binary): bound to 127.0.0.1 on a
free port, its storage in a temporary directory, scraping the given targets every second and
evaluating the given rule files every second. Stopped (SIGTERM, then SIGKILL) by `stop()`."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.processes import stop_process
from tests.support.tools import need_command


class PrometheusServer:
    def __init__(self, workdir: Path, port: int, targets: list[str], rule_files: list[Path]) -> None:
        self.workdir = workdir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.targets = targets
        self.rule_files = rule_files
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        binary = need_command("prometheus", "the scrape test runs a real Prometheus server")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [{"job_name": "runcap", "static_configs": [{"targets": self.targets}]}],
        }
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(self.workdir / "prometheus.log", "ab"),
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"prometheus was not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why
            raise AssertionError(f"{path} {params}: {e.code} {e.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result: vector samples, or a range selector's raw samples."""
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10)
