"""deploy/kubernetes/ checked offline: every manifest validates against the Kubernetes schemas
(kubernetes-validate's bundled copies, strict: unknown fields are errors) for the oldest version
the sidecar needs (1.29: native sidecar containers) and the newest known; the pieces refer to
each other correctly (Secret keys, ConfigMap, selectors, ports); the ConfigMap's runcap.toml is a
configuration runcap accepts; and the probe and preStop commands do what they say against a real
runcap."""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import yaml

from proxy.config import build_config
from tests.conftest import REPO

K8S = REPO / "deploy" / "kubernetes"
# Native sidecars (init containers with restartPolicy: Always) are on by default from 1.29.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
LISTEN = "127.0.0.1:8787"


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> dict[str, dict[str, Any]]:
    """kind → object, over every manifest file (one object of each kind here)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in documents(path):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            out[doc["kind"]] = doc
    return out


def pod(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return objs["Deployment"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def runcap_container(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    [c] = [c for c in pod(objs).get("initContainers", []) if c["name"] == "runcap"]
    return c


def agent_container(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    [c] = [c for c in pod(objs)["containers"] if c["name"] == "agent"]
    return c


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"))
def test_manifest_validates_against_the_kubernetes_schema(name: str, version: str) -> None:
    for doc in documents(K8S / name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_the_manifests_but_not_the_example_secret() -> None:
    [kustomization] = documents(K8S / "kustomization.yaml")
    resources = kustomization["resources"]
    assert sorted(resources) == ["configmap.yaml", "deployment.yaml", "pdb.yaml"]
    assert all((K8S / r).is_file() for r in resources)


def test_runcap_is_a_native_sidecar_on_loopback_with_its_probes() -> None:
    objs = manifests()
    runcap = runcap_container(objs)
    assert runcap["restartPolicy"] == "Always"  # starts before the agent, stops after it
    args = runcap["args"]
    assert args[:1] == ["serve"] and args[args.index("--listen") + 1] == LISTEN
    # probes: exec (the kubelet cannot reach a loopback listener), on the routes that mean it
    routes = {
        probe: re.findall(r"http://([\d.:]+)(/\w+)", " ".join(runcap[probe]["exec"]["command"]))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert routes == {
        "startupProbe": [(LISTEN, "/readyz")],
        "readinessProbe": [(LISTEN, "/readyz")],
        "livenessProbe": [(LISTEN, "/healthz")],
    }
    # the agent points its SDKs at the sidecar
    agent_env = env_of(agent_container(objs))
    assert agent_env["OPENAI_BASE_URL"]["value"] == f"http://{LISTEN}/v1"
    assert agent_env["ANTHROPIC_BASE_URL"]["value"] == f"http://{LISTEN}/anthropic"
    # requests everywhere (the scheduler needs them); runcap's sized from bench/README.md
    assert runcap["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert "requests" in agent_container(objs)["resources"]


def test_secrets_and_config_are_wired_to_what_exists() -> None:
    objs = manifests()
    runcap = runcap_container(objs)
    secret = objs["Secret"]
    env = env_of(runcap)
    refs = [e["valueFrom"]["secretKeyRef"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs and all(r["name"] == secret["metadata"]["name"] for r in refs)
    assert {r["key"] for r in refs} <= set(secret["stringData"])
    assert env["RUNCAP_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "admin-token"
    # the agent container holds no secret
    assert not any("valueFrom" in e for e in agent_container(objs).get("env", []))

    # the ConfigMap is mounted where --config looks
    volumes = {v["name"]: v for v in pod(objs)["volumes"]}
    [mount] = [m for m in runcap["volumeMounts"] if m["mountPath"] == "/etc/runcap"]
    assert volumes[mount["name"]]["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    args = runcap["args"]
    assert args[args.index("--config") + 1] == "/etc/runcap/" + next(iter(objs["ConfigMap"]["data"]))
    # every volume mounted exists
    for container in (runcap, agent_container(objs)):
        assert {m["name"] for m in container.get("volumeMounts", [])} <= set(volumes)


def test_the_configmaps_runcap_toml_is_accepted_with_the_pods_environment() -> None:
    objs = manifests()
    raw = tomllib.loads(objs["ConfigMap"]["data"]["runcap.toml"])
    secret = objs["Secret"]["stringData"]
    env: dict[str, str] = {}
    for name, e in env_of(runcap_container(objs)).items():
        if "value" in e:
            env[name] = e["value"]
        else:
            env[name] = secret[e["valueFrom"]["secretKeyRef"]["key"]]
    config = build_config(raw, env, listen=LISTEN)
    assert config.admin_token == secret["admin-token"]
    # runcap holds the provider keys (api_key_env), read from the Secret
    assert config.upstreams["openai"].api_key == secret["openai-api-key"]
    assert config.upstreams["anthropic"].api_key == secret["anthropic-api-key"]
    assert config.spans.clickhouse_url and config.spans.s3_url and config.ledger.redis_url
    # the write-ahead log stays well inside the emptyDir it lives on
    size_limit = next(v for v in pod(objs)["volumes"] if v["name"] == "runcap-data")["emptyDir"]["sizeLimit"]
    assert size_limit == "2Gi" and config.spans.wal_max_bytes <= 2 * 2**30 // 2


def test_drain_fits_the_grace_period_and_the_budget_selects_the_pods() -> None:
    objs = manifests()
    spec = objs["Deployment"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pre_stop = " ".join(runcap_container(objs)["lifecycle"]["preStop"]["exec"]["command"])
    waits = int(re.search(r"time\.monotonic\(\) \+ (\d+)", pre_stop).group(1))  # type: ignore[union-attr]
    # preStop wait + runcap's own shutdown (10 s for calls in flight) + the agent's drain
    assert pod(objs)["terminationGracePeriodSeconds"] >= waits + 10 + 60


# --- the commands, run against a real runcap ----------------------------------------------------


def _command(objs: dict[str, dict[str, Any]], where: str, url: str) -> list[str]:
    runcap = runcap_container(objs)
    command = (
        runcap[where]["exec"]["command"]
        if where.endswith("Probe")
        else runcap[where]["preStop"]["exec"]["command"]
    )
    assert command[0] == "python"  # the image's interpreter; here, this one
    return [sys.executable, *(part.replace(f"http://{LISTEN}", url) for part in command[1:])]


async def _exit_code(command: list[str]) -> int:
    proc = await asyncio.create_subprocess_exec(*command)
    return await asyncio.wait_for(proc.wait(), 30)


async def test_probe_commands_pass_against_a_running_runcap(runcap) -> None:  # type: ignore[no-untyped-def]
    objs = manifests()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert await _exit_code(_command(objs, probe, runcap.url)) == 0, probe
    # and fail where nothing answers
    assert await _exit_code(_command(objs, "readinessProbe", "http://127.0.0.1:9")) != 0


async def test_pre_stop_waits_for_the_calls_in_flight(runcap, upstream) -> None:  # type: ignore[no-untyped-def]
    upstream.scripts["slow"] = [{"text": "late answer", "delay_s": 1.0}]
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"X-Run-Id": "k8s-drain", "X-Mock-Script": "slow"}
    async with aiohttp.ClientSession() as s:

        async def call() -> int:
            async with s.post(f"{runcap.url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        async def in_flight() -> float:
            async with s.get(f"{runcap.url}/metrics") as r:
                text = await r.text()
            return float(re.search(r"^runcap_in_flight\s+(\S+)", text, re.M).group(1))  # type: ignore[union-attr]

        pending = asyncio.create_task(call())
        for _ in range(200):
            if await in_flight() >= 1:
                break
            await asyncio.sleep(0.01)
        assert await in_flight() >= 1
        assert await _exit_code(_command(manifests(), "lifecycle", runcap.url)) == 0
        assert pending.done() and pending.result() == 200  # preStop returned only after the call
        assert await in_flight() == 0
