"""A real redis-server (Debian's package) on a free 127.0.0.1 port with a temporary directory.

Tests run it without persistence (`--save "" --appendonly no`) unless they ask for it
(`persistent=True`: AOF, `appendfsync everysec`, as production should run it). Fault tests stop it
(`terminate`: SIGTERM, a clean shutdown), kill it (`kill9`), freeze it (`freeze`/`thaw`: SIGSTOP /
SIGCONT) and `start` it again on the same port and directory, reloading what it persisted.

`RedisClusterServers`: a Redis Cluster of real processes on loopback — 3 masters with 1 replica
each (6 `redis-server --cluster-enabled yes`), created with `redis-cli --cluster create`, waited
on until every node says `cluster_state:ok` and every replica is in sync; `master_of(key)`,
`kill9`, `hand_over` (a manual failover) and `wait_promoted` for failover tests.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.processes import stop_process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(
        self, *, persistent: bool = False, extra: tuple[str, ...] = (), port: int | None = None
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (scripts/setup.sh installs it: apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="runcap-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.persistent = persistent
        self.extra = extra
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or start again: same port, same directory, persisted data reloaded)."""
        aof = ["--appendonly", "no"]
        if self.persistent:
            aof = ["--appendonly", "yes", "--appendfsync", "everysec"]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", *aof, "--protected-mode", "yes", "--daemonize", "no",
             "--loglevel", "warning", *self.extra],
            stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start within 10 s")

    def terminate(self) -> None:
        """SIGTERM: Redis persists what it holds and exits; clients are cut."""
        self.thaw()
        stop_process(self.proc)

    def kill9(self) -> None:
        """SIGKILL: gone at once; only what reached the AOF survives."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.frozen = False

    def freeze(self) -> None:
        """SIGSTOP: connections stay open (and new ones are accepted by the kernel), nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        """Stop for good and delete the directory."""
        self.thaw()
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """3 masters + 3 replicas of a real Redis Cluster on 127.0.0.1 (see the module docstring)."""

    MASTERS = 3

    def __init__(self, *, node_timeout_ms: int = 1000) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
        self.cli = cli
        self.node_timeout_ms = node_timeout_ms
        flags = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout_ms))  # fmt: skip
        self.nodes = [RedisServer(extra=flags, port=_cluster_port()) for _ in range(2 * self.MASTERS)]

    @property
    def url(self) -> str:
        """Any live node's URL (the cluster client discovers the others)."""
        node = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        return node.url

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            self.wait_ok()
        except BaseException:
            self.stop()  # no node left running behind a failed start
            raise
        return self

    def info(self, node: RedisServer, section: str) -> dict[str, str]:
        out = subprocess.run(
            [self.cli, "-p", str(node.port), section.split()[0], *section.split()[1:]],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
        return dict(line.split(":", 1) for line in out.replace("\r", "").splitlines() if ":" in line)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says `cluster_state:ok`, sees 3 masters, and every master's
        replicas are online and caught up."""
        deadline = time.monotonic() + timeout
        while True:
            ok = all(self.info(n, "cluster info").get("cluster_state") == "ok" for n in self.live())
            masters = [n for n in self.live() if self.info(n, "info replication").get("role") == "master"]
            if ok and len(masters) == self.MASTERS:
                synced = True
                for m in masters:
                    rep = self.info(m, "info replication")
                    n = int(rep.get("connected_slaves", "0"))
                    offsets = [rep.get(f"slave{i}", "") for i in range(n)]
                    if any("state=online" not in o for o in offsets):
                        synced = False
                if synced:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("the redis cluster did not reach cluster_state:ok in time")
            time.sleep(0.05)

    def master_of(self, key: str) -> RedisServer:
        """The master serving `key`'s slot now."""
        out = subprocess.run(
            [self.cli, "-p", str(self.live()[0].port), "cluster", "keyslot", key],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
        slot = int(out.strip())
        for node in self.live():
            info = self.info(node, "info replication")
            if info.get("role") != "master":
                continue
            myself = next(line for line in self.info_lines(node, "cluster nodes") if "myself" in line)
            if any(_in_range(part, slot) for part in myself.split()[8:]):
                return node
        raise RuntimeError(f"no live master serves slot {slot}")

    def info_lines(self, node: RedisServer, command: str) -> list[str]:
        return subprocess.run(
            [self.cli, "-p", str(node.port), *command.split()], capture_output=True, text=True, timeout=10
        ).stdout.splitlines()

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        rep = self.info(master, "info replication")
        ports = {
            int(rep[f"slave{i}"].split("port=")[1].split(",")[0]) for i in range(int(rep["connected_slaves"]))
        }
        return [n for n in self.nodes if n.port in ports]

    def kill9(self, node: RedisServer) -> None:
        node.kill9()

    def cut_replication(self, master: RedisServer) -> None:
        """The master drops its replicas' links (`CLIENT KILL TYPE replica`): with the replica
        frozen, nothing the master acknowledges from now on reaches it (what the kernel had
        buffered before still does)."""
        subprocess.run(
            [self.cli, "-p", str(master.port), "client", "kill", "type", "replica"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip

    def hand_over(self, replica: RedisServer) -> None:
        """`CLUSTER FAILOVER` on `replica`: its master hands it the slots (no node dies); wait
        with `wait_promoted`."""
        command = [self.cli, "-p", str(replica.port), "cluster", "failover"]
        subprocess.run(command, check=True, capture_output=True, timeout=10)

    def wait_promoted(self, replica: RedisServer, timeout: float = 30.0) -> None:
        """Until `replica` is a master and the cluster is ok again (the dead master's slots served)."""
        deadline = time.monotonic() + timeout
        while self.info(replica, "info replication").get("role") != "master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica :{replica.port} was not promoted within {timeout} s")
            time.sleep(0.05)
        deadline = time.monotonic() + timeout
        while not all(self.info(n, "cluster info").get("cluster_state") == "ok" for n in self.live()):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not recover after the failover")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too: both below 65536."""
    import random

    for _ in range(1000):
        port = random.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _in_range(part: str, slot: int) -> bool:
    """`part` of a CLUSTER NODES line: a slot (`42`) or a range (`0-5460`)."""
    lo, _, hi = part.partition("-")
    return lo.isdigit() and int(lo) <= slot <= int(hi or lo)


async def wait_subscribed(
    url: str, channel: str, subscribers: int, timeout: float = 5.0, *, sharded: bool = False
) -> None:
    """Until `channel` has at least `subscribers` (PUBSUB NUMSUB; `sharded`: PUBSUB SHARDNUMSUB
    on the cluster node that owns the channel's slot): the readiness signal of a pub/sub
    listener, instead of a sleep that hopes it subscribed."""
    import asyncio

    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster

    client: aioredis.Redis | RedisCluster = RedisCluster.from_url(url) if sharded else aioredis.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if isinstance(client, RedisCluster):
                await client.initialize()
                node = client.get_node_from_key(channel)
                raw = await client.execute_command("PUBSUB SHARDNUMSUB", channel, target_nodes=node)
                counts = dict(raw)  # [(channel, count)], as redis-py parses it
            else:
                counts = dict(await client.pubsub_numsub(channel))
            have = counts.get(channel.encode(), 0)
            if have >= subscribers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{channel}: {have} of {subscribers} subscribers after {timeout} s")
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()
