"""The production stack (docker-compose.yml, Dockerfile, deploy/) checked statically: Docker cannot
run here, so everything a `docker compose up` depends on that can be read from the files is read
and cross-checked — images pinned, mounts present, start order backed by health checks, and
runcap's environment pointing at the services that exist, with the credentials they were given.
`docker compose config` runs as an extra check where the compose plugin is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.config import build_config
from tests.conftest import REPO
from tests.support.compose import _VAR, COMPOSE_FILE, ENV_EXAMPLE, interpolate, raw_compose, sample_env  # noqa: F401
from tests.support.parts import missing

# What the images serve inside the compose network (from their documentation).
IMAGE_PORTS = {
    "clickhouse/clickhouse-server": {8123, 9000},
    "redis": {6379},
    "minio/minio": {9000, 9001},
    "grafana/grafana": {3000},
    "otel/opentelemetry-collector-contrib": {4317, 4318, 13133},
    "prom/prometheus": {9090},
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(raw_compose(), sample_env())


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def container_ports(name: str, svc: dict[str, Any]) -> set[int]:
    if "build" in svc:
        return {int(p) for p in re.findall(r"^EXPOSE\s+(\d+)", dockerfile_text(svc), re.M)}
    image = svc["image"].rsplit(":", 1)[0]
    return IMAGE_PORTS[image]


def dockerfile_text(svc: dict[str, Any]) -> str:
    build = svc["build"]
    ctx = REPO / (build if isinstance(build, str) else build.get("context", "."))
    return (
        ctx / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
    ).read_text()


# -- the file itself ---------------------------------------------------------------------------


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert set(s) == {
        "runcap", "clickhouse", "redis", "minio", "minio-init", "grafana", "otel-collector", "prometheus"
    }  # fmt: skip
    assert s["otel-collector"]["profiles"] == ["otel"]
    assert s["prometheus"]["profiles"] == ["metrics"]
    assert all(
        "profiles" not in svc for name, svc in s.items() if name not in ("otel-collector", "prometheus")
    )


def test_secrets_are_required_and_listed_in_the_env_example() -> None:
    text = COMPOSE_FILE.read_text()
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert {"RUNCAP_ADMIN_TOKEN", "CLICKHOUSE_PASSWORD", "GRAFANA_ADMIN_PASSWORD"} <= required
    listed = set(re.findall(r"^(\w+)=", ENV_EXAMPLE.read_text(), re.M))
    assert required <= listed, f"missing from {ENV_EXAMPLE.name}: {required - listed}"
    with pytest.raises(KeyError, match="RUNCAP_ADMIN_TOKEN"):
        interpolate(raw_compose(), {k: v for k, v in sample_env().items() if k != "RUNCAP_ADMIN_TOKEN"})
    # no secret has a default value in the compose file
    assert not re.search(r"(PASSWORD|SECRET|TOKEN)\w*:-", text)


def test_images_are_pinned_or_built_from_an_existing_dockerfile(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert dockerfile_text(svc), name
            continue
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: {image} is not pinned"
        assert re.match(r"^(v?\d+(\.\d+)*(-\w+)?|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ)$", tag), (
            f"{name}: {tag}"
        )


def test_published_ports_are_unique(compose: dict[str, Any]) -> None:
    seen: dict[tuple[str, int], str] = {}
    for name, svc in compose["services"].items():
        for spec in svc.get("ports", []):
            parts = str(spec).split(":")
            host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
            host_port, container_port = int(parts[-2]), int(parts[-1])
            assert container_port in container_ports(name, svc), f"{name} publishes {container_port}"
            for other in ((host_ip, host_port), ("0.0.0.0", host_port)):
                assert other not in seen, f"{name} and {seen.get(other)} both publish {host_port}"
            seen[(host_ip, host_port)] = name
    # what must stay inside the compose network
    assert not compose["services"]["redis"].get("ports")
    assert all(p.startswith("127.0.0.1:") for p in compose["services"]["clickhouse"]["ports"])


def test_bind_mounts_exist_and_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            src, target = str(v).split(":")[:2]
            assert target.startswith("/"), f"{name}: {v}"
            if src.startswith((".", "/")):
                assert (REPO / src).exists(), f"{name} mounts {src}, which is not in the repository"
            else:
                assert src in declared, f"{name} uses volume {src}, not declared under volumes:"
                used.add(src)
    assert used == declared, f"declared but unused: {declared - used}"
    # what is mounted where it is read
    mounts = {name: {str(v).split(":")[1]: str(v).split(":")[0] for v in svc.get("volumes", [])}
              for name, svc in compose["services"].items()}  # fmt: skip
    assert mounts["runcap"]["/etc/runcap/runcap.toml"] == "./deploy/runcap.toml"
    assert (
        mounts["grafana"]["/etc/grafana/provisioning/datasources"] == "./dashboards/provisioning/datasources"
    )
    assert mounts["grafana"]["/etc/grafana/provisioning/dashboards"] == "./dashboards/provisioning/dashboards"
    assert mounts["otel-collector"]["/etc/otelcol-contrib/config.yaml"] == "./deploy/otel-collector.yaml"
    assert mounts["clickhouse"]["/docker-entrypoint-initdb.d"] == "./deploy/clickhouse/initdb"
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/compose.yml"
    assert (
        mounts["prometheus"]["/etc/prometheus/runcap-alerts.yml"] == "./deploy/prometheus/runcap-alerts.yml"
    )


def test_start_order_is_backed_by_health_checks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, rule in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            target = services[dep]
            if rule["condition"] == "service_healthy":
                has_check = "healthcheck" in target or (
                    "build" in target and "HEALTHCHECK" in dockerfile_text(target)
                )
                assert has_check, f"{name} waits for {dep} to be healthy, which has no healthcheck"
                assert not target.get("healthcheck", {}).get("disable")
            else:
                assert rule["condition"] == "service_completed_successfully", (name, dep)
                assert target.get("restart") == "no", f"{dep} is a one-shot job"
    assert services["runcap"]["depends_on"] == {
        "clickhouse": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
    }
    assert services["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert services["prometheus"]["depends_on"] == {"runcap": {"condition": "service_healthy"}}
    for name in ("runcap", "clickhouse", "redis", "minio", "grafana", "prometheus"):
        assert services[name]["healthcheck"]["test"], name
    assert "/readyz" in " ".join(services["runcap"]["healthcheck"]["test"])


# -- runcap's environment points at the services ------------------------------------------------


def test_runcap_talks_to_the_compose_clickhouse(compose: dict[str, Any]) -> None:
    s = compose["services"]
    env, ch = env_of(s["runcap"]), env_of(s["clickhouse"])
    url = urlsplit(env["RUNCAP_CLICKHOUSE_URL"])
    assert url.scheme == "http" and url.hostname == "clickhouse" and url.hostname in s
    assert url.port == 8123 and url.port in container_ports("clickhouse", s["clickhouse"])
    assert (url.username, url.password) == (ch["CLICKHOUSE_USER"], ch["CLICKHOUSE_PASSWORD"])
    assert url.path == "/" + ch["CLICKHOUSE_DB"]


def minio_init_script(compose: dict[str, Any]) -> str:
    """minio-init's shell script with the container's own variables ($${X} in the file) resolved
    from its environment."""
    svc = compose["services"]["minio-init"]
    script = " ".join(svc["entrypoint"][2:] + svc["command"]) if svc["entrypoint"][-1] == "-c" else ""
    env = env_of(svc)
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], script)


def test_runcap_writes_payloads_to_the_bucket_minio_init_creates(compose: dict[str, Any]) -> None:
    s = compose["services"]
    env = env_of(s["runcap"])
    script = minio_init_script(compose)
    created = re.findall(r'mc mb --ignore-existing "local/([^"]+)"', script)
    s3 = urlsplit(env["RUNCAP_S3_URL"])
    assert s3.scheme == "s3" and created == [s3.netloc]
    endpoint = urlsplit(env["AWS_ENDPOINT_URL"])
    assert endpoint.hostname == "minio" and endpoint.port == 9000
    assert endpoint.port in container_ports("minio", s["minio"])
    assert "mc alias set local http://minio:9000" in script
    # runcap's key is the user minio-init creates, with a policy on that bucket only
    user = re.search(r'mc admin user add local "([^"]+)" "([^"]+)"', script)
    assert user and (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == user.groups()
    assert "arn:aws:s3:::%s/*" in script and f'"{s3.netloc}" "{s3.netloc}"' in script
    assert env["AWS_DEFAULT_REGION"]
    # the root credentials minio-init logs in with are the server's
    assert env_of(s["minio-init"])["MINIO_ROOT_PASSWORD"] == env_of(s["minio"])["MINIO_ROOT_PASSWORD"]
    assert env_of(s["minio-init"])["MINIO_ROOT_USER"] == env_of(s["minio"])["MINIO_ROOT_USER"]


def test_runcap_ledger_is_the_compose_redis_with_aof(compose: dict[str, Any]) -> None:
    s = compose["services"]
    url = urlsplit(env_of(s["runcap"])["RUNCAP_REDIS_URL"])
    assert url.scheme == "redis" and url.hostname == "redis" and url.port == 6379
    cmd = s["redis"]["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert any(v.split(":")[1] == "/data" for v in s["redis"]["volumes"])  # the AOF survives


def test_runcap_admin_token_otlp_and_listen(compose: dict[str, Any]) -> None:
    s = compose["services"]
    env = env_of(s["runcap"])
    assert env["RUNCAP_ADMIN_TOKEN"] == sample_env()["RUNCAP_ADMIN_TOKEN"]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""  # off unless configured
    cmd = s["runcap"]["command"]
    assert cmd[:1] == ["serve"] and cmd[cmd.index("--listen") + 1] == "0.0.0.0:8787"
    assert ["8787:8787"] == s["runcap"]["ports"]
    # with the otel profile, the endpoint users are told to set is the collector's OTLP/HTTP port
    example = re.search(r"OTEL_EXPORTER_OTLP_ENDPOINT=(\S+)", ENV_EXAMPLE.read_text())
    assert example
    otlp = urlsplit(example.group(1))
    assert otlp.hostname == "otel-collector" and otlp.port == 4318
    collector = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "0.0.0.0:4318"
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and all(
        e in collector["exporters"] for e in pipeline["exporters"]
    )
    assert all(p in collector["processors"] for p in pipeline["processors"])


def test_runcap_configuration_loads_with_the_compose_environment(compose: dict[str, Any]) -> None:
    """runcap's own configuration loader accepts deploy/runcap.toml with the compose environment
    (unknown keys or bad URLs would stop the container at start-up)."""
    raw = tomllib.loads((REPO / "deploy" / "runcap.toml").read_text())
    env = env_of(compose["services"]["runcap"])
    config = build_config(raw, env, listen="0.0.0.0:8787")
    assert config.spans.clickhouse_url == env["RUNCAP_CLICKHOUSE_URL"]
    assert config.spans.s3_url and config.ledger.redis_url and config.admin_token
    assert config.spans.otlp_endpoint is None and config.spans.tracing
    assert config.caps.ceiling_max_usd_nanos is not None  # production has a dollar ceiling


def test_prometheus_scrapes_runcap_and_loads_its_alert_rules(compose: dict[str, Any]) -> None:
    """`--profile metrics`: the Prometheus it starts scrapes the runcap service on the port runcap
    listens on, evaluates the alert rules it mounts (the file the alert tests check), and its
    configuration passes Prometheus' own check; its UI is published on loopback only."""
    prom = compose["services"]["prometheus"]
    config_path = REPO / "deploy/prometheus/compose.yml"
    config = yaml.safe_load(config_path.read_text())
    (job,) = config["scrape_configs"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    command = compose["services"]["runcap"]["command"]
    listen_port = command[command.index("--listen") + 1].rsplit(":", 1)[1]
    assert targets == [f"runcap:{listen_port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mounted = {str(v).split(":")[1] for v in prom["volumes"]}
    assert {f"/etc/prometheus/{rule}" for rule in config["rule_files"]} <= mounted
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert all(str(p).startswith("127.0.0.1:") for p in prom["ports"])
    # runcap's Host check lets the scrape in: the service name is an allowed Host.
    runcap_toml = tomllib.loads((REPO / "deploy/runcap.toml").read_text())
    assert "runcap" in runcap_toml["local"]["allowed_hosts"]
    tool = shutil.which("promtool")
    if tool is None:
        missing("promtool is missing (scripts/setup.sh installs Debian's prometheus package)")
        return
    done = subprocess.run(
        [tool, "check", "config", str(config_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_grafana_reads_clickhouse_as_the_read_only_user(compose: dict[str, Any]) -> None:
    s = compose["services"]
    g, ch = env_of(s["grafana"]), env_of(s["clickhouse"])
    assert g["GF_INSTALL_PLUGINS"].split()[0] == "grafana-clickhouse-datasource"
    assert g["GRAFANA_CLICKHOUSE_PASSWORD"] == ch["GRAFANA_CLICKHOUSE_PASSWORD"]
    ds = yaml.safe_load((REPO / "dashboards/provisioning/datasources/clickhouse.yaml").read_text())
    [d] = ds["datasources"]
    j = d["jsonData"]
    assert j["host"] == "clickhouse" and j["port"] in container_ports("clickhouse", s["clickhouse"])
    assert j["defaultDatabase"] == ch["CLICKHOUSE_DB"]
    assert d["secureJsonData"]["password"] == "$GRAFANA_CLICKHOUSE_PASSWORD"  # from the container env
    init = (REPO / "deploy/clickhouse/initdb/01-grafana-user.sh").read_text()
    assert f"CREATE USER IF NOT EXISTS {j['username']} " in init and "GRANT SELECT ON ${db}.*" in init
    assert os.access(REPO / "deploy/clickhouse/initdb/01-grafana-user.sh", os.X_OK)
    assert s["grafana"]["depends_on"] == {"clickhouse": {"condition": "service_healthy"}}
    home = g["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    mount = next(v.split(":")[1] for v in s["grafana"]["volumes"] if v.startswith("./dashboards:"))
    assert home.startswith(mount + "/") and (REPO / "dashboards" / Path(home).name).is_file()


def test_initdb_script_is_valid_bash() -> None:
    bash = shutil.which("bash")
    if bash is None:
        missing("no bash")
    subprocess.run([bash, "-n", str(REPO / "deploy/clickhouse/initdb/01-grafana-user.sh")], check=True)


# -- the Dockerfile ----------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    )
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in joined.splitlines() if ln.strip()]


def test_dockerfile(compose: dict[str, Any]) -> None:
    text = (REPO / "Dockerfile").read_text()
    ins = instructions(text)
    [base] = [arg for op, arg in ins if op == "FROM"]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-bookworm)?", base), base
    installs = [arg for op, arg in ins if op == "RUN" and "pip install" in arg]
    assert len(installs) == 1
    extras = re.search(r'pip install "\.\[([\w,]+)\]"', installs[0])
    assert extras and set(extras.group(1).split(",")) == {"redis", "fast"}  # not `embedded` (chdb)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert set(extras.group(1).split(",")) <= set(pyproject["project"]["optional-dependencies"])
    users = [arg.strip() for op, arg in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0"), "runs as a non-root user"
    expose = {int(p) for op, arg in ins if op == "EXPOSE" for p in arg.split()}
    assert expose == {8787}
    assert (
        any(op == "HEALTHCHECK" and "/readyz" in arg for op, arg in ins)
        or "healthcheck" in compose["services"]["runcap"]
    )
    assert [arg for op, arg in ins if op == "ENTRYPOINT"] == ['["runcap"]']
    assert "--listen" in next(arg for op, arg in ins if op == "CMD")
    # what the image copies is in the build context (.dockerignore allow-list)
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :] and "!.env" not in ignore
    for op, arg in ins:
        if op == "COPY":
            for src in arg.split()[:-1]:
                assert (REPO / src).exists() and f"!{src.rstrip('/')}" in [i.rstrip("/") for i in ignore], src
    # a symlink in what is copied (proxy/sql -> ../queries) points at something copied too
    copied = [src.rstrip("/") for op, arg in ins if op == "COPY" for src in arg.split()[:-1]]
    for src in copied:
        links = [p for p in (REPO / src).rglob("*") if p.is_symlink()] if (REPO / src).is_dir() else []
        for link in links:
            target = link.resolve().relative_to(REPO)
            assert target.parts[0] in copied, f"{link.relative_to(REPO)} -> {target}, which is not copied"
    assert compose["services"]["runcap"]["build"] == {"context": ".", "dockerfile": "Dockerfile"}


# -- `docker compose config`, where it can run -------------------------------------------------


def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    probe = subprocess.run([docker, "compose", "version"], capture_output=True) if docker else None
    if probe is None or probe.returncode != 0:
        missing(
            "the docker compose plugin is not installed here (static checks above cover the file)",
            machine_lacks=True,  # no Docker engine on this kind of machine
        )
    env = {**os.environ, **sample_env()}
    r = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILE), "--profile", "otel", "config", "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
